"""The `orchestrator` command: a thin layer over `orchestrator.Client`, its subcommands in
`orchestrator.user.commands` by subject.

Exit codes: 0 the job succeeded (or the command did what it said), 1 the job failed
or was cancelled, or the cluster failed; 2 a usage or validation error. An error the
orchestrator raises on purpose (`OrchestratorError`) is shown as `error:` lines, one per
problem, never as a traceback; any other exception is a bug and keeps its traceback. A
reader that stops reading early (`orchestrator schema | head`) ends the command quietly
with exit code 0: the rest of the output is dropped.
"""

from __future__ import annotations

import os
import sys

import typer
from typer.core import TyperGroup

from orchestrator.errors import OrchestratorError, RequestError
from orchestrator.user.commands import cluster, data, job_file, jobs
from orchestrator.user.commands.console import EXIT_JOB_FAILED, EXIT_OK, EXIT_USAGE, print_error
from orchestrator.user.commands.views import status_lines  # noqa: F401  # kept for tests/integration/test_limits.py


class _Commands(TyperGroup):
    """The command group; an `OrchestratorError` out of any command ends it with `error:` lines."""

    def invoke(self, ctx: typer.Context):  # type: ignore[override]  # typer's base types it as its vendored click's
        try:
            try:
                return super().invoke(ctx)
            finally:
                sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's last flush
        except OrchestratorError as e:
            for line in str(e).splitlines() or [type(e).__name__]:
                print_error(line)
            ctx.exit(EXIT_USAGE if isinstance(e, RequestError) else EXIT_JOB_FAILED)
        except BrokenPipeError:  # the reader stopped reading (`| head`): what it wanted, it has
            _drop_stdout()
            ctx.exit(EXIT_OK)


def _drop_stdout() -> None:
    """Point stdout at /dev/null, so nothing after a closed pipe fails on it again."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # not a real file (a test's runner): nothing to redirect
        pass


app = typer.Typer(cls=_Commands, add_completion=False, no_args_is_help=True,
                  help="Run JAX training jobs on (spot) Cloud TPU slices, or on a local Ray cluster.")

# In the order `--help` lists them.
app.command()(job_file.validate)
app.command()(job_file.schema)
app.command()(jobs.submit)
app.command()(jobs.status)
app.command("list")(jobs.list_jobs)
app.command()(jobs.logs)
app.command()(jobs.cancel)
app.command()(jobs.resize)
app.command()(jobs.profile)
app.command()(jobs.report)
data_app = typer.Typer(cls=_Commands, no_args_is_help=True, help="Token files for training (see workers.tokens).")
data_app.command("prepare")(data.data_prepare)
app.add_typer(data_app, name="data")
app.command()(data.export)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
             add_help_option=False)
def emulator(ctx: typer.Context) -> None:
    """Emulated Google Cloud on 127.0.0.1: the TPU API; with --vms, VMs behind its nodes and Cloud Storage.
    Subcommands: slices, reclaim, poweroff, notice (`orchestrator emulator --help`)."""
    # The emulator is a tool beside the product: it loads only here (tests/checks/test_packaging.py).
    from orchestrator.emulator.cli import main as emulator_main

    raise typer.Exit(emulator_main(list(ctx.args)))


app.command()(cluster.gc)
app.command()(job_file.plan)
app.command()(cluster.up)
app.command()(cluster.dashboard)
app.command()(cluster.down)


def main() -> None:
    app()  # errors become `error:` lines in _Commands.invoke


if __name__ == "__main__":
    main()
