"""The `orchestrator` command: a thin layer over `orchestrator.Client`.

Exit codes: 0 the job succeeded (or the command did what it said), 1 the job failed
or was cancelled, or the cluster failed; 2 a usage or validation error. An error the
orchestrator raises on purpose (`OrchestratorError`) is shown as `error:` lines, one per
problem, never as a traceback; any other exception is a bug and keeps its traceback. A
reader that stops reading early (`orchestrator schema | head`) ends the command quietly
with exit code 0: the rest of the output is dropped.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import sys
from pathlib import Path
from typing import NoReturn, Optional

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

from orchestrator.domain.spec import JobSpec, json_schema
from orchestrator.errors import ClusterError, OrchestratorError, RequestError, SpecError
from orchestrator.state.states import JobState
from orchestrator.user.client import Client, JobStatus
from orchestrator.user.preflight import gcp_problems
from orchestrator.user.progress import user_metrics, utilisation, watch
from orchestrator.user.terminal import fit_fields, table, unique_prefixes, wrap


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
                _print_error(line)
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
out = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)

EXIT_OK, EXIT_JOB_FAILED, EXIT_USAGE = 0, 1, 2

AddressOpt = typer.Option(None, "--address", help="Ray cluster address; default: the embedded local cluster.")


def _print_error(line: str) -> None:
    err.print(f"[red]error:[/red] {escape(line)}", markup=True, highlight=False)


def _fail(message: str, code: int = EXIT_USAGE) -> NoReturn:
    _print_error(message)
    raise typer.Exit(code)


def _job_exit(st: JobStatus) -> int:
    return EXIT_OK if st.state is JobState.SUCCEEDED else EXIT_JOB_FAILED


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


CompileOpt = typer.Option(False, "--compile", help="Compile the train step for every slice the job may use with "
                          "XLA's TPU compiler (needs libtpu): does it fit, and how fast could it go.")


@app.command()
def validate(job_file: Path = typer.Argument(..., help="The job's YAML file."), compile: bool = CompileOpt) -> None:
    """Check a job file; print the resolved spec. With --compile the TPU compiler's figures decide whether
    training fits each slice, in place of the estimate."""
    spec = JobSpec.from_yaml(job_file, check_memory=not compile)
    problems = gcp_problems(spec)  # what TPU VMs need, before anything is provisioned
    if problems:
        raise SpecError(str(job_file), problems)
    t, n = spec.tpu_type, spec.slices
    hosts = f"{t.hosts * n} host" + ("s" if t.hosts * n != 1 else "")
    what = f"{spec.accelerator}: {t.chips} chips on {hosts}" if n == 1 else \
        f"{spec.accelerator} x {n}: {t.chips * n} chips on {hosts} in {n} slices"
    if compile:
        _compile_check(spec, job_file)
    out.print(f"{job_file}: valid ({what}, {spec.tier.value})", highlight=False)


def _compile_check(spec: JobSpec, job_file: Path) -> list | None:
    """The TPU compiler's table for every option of `spec`, and its rows; exit 2 (nothing provisioned) naming
    each option that does not compile or fit. None, with a warning that says why, for a program of the
    user's own that does not declare its step (it goes on as without --compile)."""
    from orchestrator import cluster
    from orchestrator.control.tpu_compile import EntrypointImportError
    from orchestrator.user.compiled import compile_options, render
    from workers.api import StepNotDeclared
    from workers.tpu_target import TargetUnavailable

    cache = cluster.Home.default().ensure().tpu_programs
    try:
        rows = compile_options(spec, cache_dir=cache, progress=lambda line: err.print(line, highlight=False))
    except StepNotDeclared as e:
        err.print(f"warning: {job_file}: --compile: not compiled: {e}; checked without the compiler",
                  highlight=False, markup=False)
        return None
    except (ValueError, TargetUnavailable, EntrypointImportError) as e:
        _fail(f"{job_file}: --compile: {e}")
    out.print(render(rows, spec))
    refused = [(r.field, line) for r in rows if (line := r.refusal()) is not None]
    if refused:
        raise SpecError(str(job_file), refused)
    return rows


@app.command()
def schema() -> None:
    """Print the JSON Schema of job files (for editors)."""
    print(json.dumps(json_schema(), indent=2))


@app.command()
def submit(job_file: Path = typer.Argument(..., help="The job's YAML file."),
           detach: bool = typer.Option(False, "--detach", "-d", help="Return the job id at once."),
           quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress display."),
           as_json: bool = typer.Option(False, "--json", help="Progress as JSON Lines, for scripts."),
           fresh: bool = typer.Option(False, "--fresh", help="Start from step 0: move the checkpoints in the job's "
                                      "folder aside to <folder>.replaced-<UTC time>."),
           resume_anyway: bool = typer.Option(False, "--resume-anyway", help="Resume the checkpoints in the job's "
                                              "folder even if another model, optimizer or data wrote them."),
           compile: bool = typer.Option(False, "--compile", help="First compile the train step for every slice the "
                                        "job may use with XLA's TPU compiler (needs libtpu); submit nothing if one "
                                        "does not compile or fit."),
           address: Optional[str] = AddressOpt) -> None:
    """Submit a job; wait for it with a progress display unless --detach.

    Checkpoints of the same run in the job's folder are resumed; a folder another running job
    uses, or one holding checkpoints of a run with other settings, is refused (exit 2).
    """
    if fresh and resume_anyway:
        _fail("--fresh and --resume-anyway exclude each other: start over, or resume")
    spec = JobSpec.from_yaml(job_file, check_memory=not compile)
    if compile:
        _compile_check(spec, job_file)  # exit 2 before any cluster or slice is touched
    client = Client(address=address)
    try:
        job = client.submit(spec, workdir=job_file.parent, source=str(job_file), fresh=fresh,
                            resume_anyway=resume_anyway)
    except OrchestratorError:
        client.close()
        raise
    print(job.id, flush=True)
    if detach:
        client.close(stop_owned_cluster=False)
        err.print(f"follow it with: orchestrator logs {job.id} --follow   (stop the cluster: orchestrator down)")
        raise typer.Exit(EXIT_OK)
    try:
        st = watch(job, out, mode="quiet" if quiet else "json" if as_json else "auto")
    except KeyboardInterrupt:
        client.close(stop_owned_cluster=False)
        err.print(f"\nstopped waiting; the job goes on. cancel it with: orchestrator cancel {job.id}")
        raise typer.Exit(130)
    client.close()
    if not as_json:
        _print_final(st)
    raise typer.Exit(_job_exit(st))


def _print_final(st: JobStatus) -> None:
    color = "green" if st.state is JobState.SUCCEEDED else "red"
    out.print(f"[{color}]{st.state_name}[/{color}] {st.id}: {st.reason}", highlight=False)
    if st.state is JobState.FAILED and st.error:
        err.print(st.error, markup=False, highlight=False)


@app.command()
def status(job_id: Optional[str] = typer.Argument(None, help="Job id, id prefix, or name."),
           events: bool = typer.Option(False, "--events", "-e", help="Show the job's events."),
           as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")) -> None:
    """Show one job (exit code 1 if it failed) or, with no JOB, all jobs."""
    client = Client()
    if job_id is None:
        _print_jobs(client.jobs(), as_json, client.store_fault())
        return
    job = client.job(job_id)
    st = job.status()
    if as_json:
        from orchestrator.observe.goodput import goodput

        data = _status_dict(st)
        data["goodput"] = goodput(client.store, st.id).to_dict()
        if events:
            data["events"] = [vars(e) for e in job.events()]
        print(json.dumps(data, indent=2, default=str))
    else:
        from orchestrator.observe.goodput import goodput

        for line in status_lines(st, goodput(client.store, st.id), width=out.width):
            out.print(line, markup=False, highlight=False)
        if st.error and st.state is JobState.FAILED:
            out.print("  last error:", highlight=False)
            out.print(st.error, markup=False, highlight=False)
        if events:
            for e in job.events():
                what = (f"{e.from_state.value if e.from_state else ''} -> {e.to_state.value}" if e.to_state
                        else e.kind.value)
                for line in wrap(f"{_time(e.at)}  {what}: {e.reason}", out.width, hanging=" " * 14):
                    out.print(line, markup=False, highlight=False)
    if st.done and st.state is not JobState.SUCCEEDED:
        raise typer.Exit(EXIT_JOB_FAILED)


def _time(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts).strftime("%H:%M:%S.%f")[:-3]


def _status_dict(st: JobStatus) -> dict:
    d = dict(vars(st))
    d["state"] = st.state.value
    d["cause"] = st.cause.value if st.cause else None  # FAILED's cause (setup, budget, ...)
    return d


def status_lines(st: JobStatus, g, *, width: int) -> list[str]:
    """`status JOB` as lines of at most `width` columns (see `orchestrator.user.terminal`)."""
    from orchestrator.observe.goodput import format_duration

    where = f", position {st.queue_position} in the queue" if st.queue_position else ""
    lines = wrap(f"{st.id}  {st.state_name}{where}  ({st.reason})", width, hanging="  ")
    for note in (st.moving, st.stalled, st.warning, st.store_fault):
        if note:
            lines += wrap(note, width, indent="  ", hanging="    ")
    wall = ("wall time " if st.done else "running for ") + format_duration(st.wall_s or 0.0)
    lines += fit_fields([f"{st.accelerator} {st.tier}", f"step {st.step}/{st.total_steps or '?'}",
                         f"loss {_fmt(st.loss, '.4f')}", f"{_fmt(st.tokens_per_s, ',.0f')} tokens/s", wall],
                        width, indent="  ", sep="   ")
    by = ", ".join(f"{a} {t} ${usd:,.2f}" for (a, t), usd in sorted(g.usd_by.items()))
    lines += fit_fields([f"goodput {g.goodput_fraction:.1%}", f"cost ${g.usd_total:,.2f}" + (f" ({by})" if by else "")],
                        width, indent="  ", sep="   ")
    lines += fit_fields([_count(g.preemptions, "preemption"), _count(g.failures, "failure"),
                         _count(g.restarts, "restart"), f"{g.productive_steps} steps kept",
                         f"{g.lost_steps} recomputed"], width, indent="  ", sep=", ")
    if utilisation(st.metrics):
        lines += fit_fields(utilisation(st.metrics).split("  "), width, indent="  ")
    if user_metrics(st.metrics):
        lines += wrap(f"metrics: {user_metrics(st.metrics)}", width, indent="  ", hanging="    ")
    return lines


def _count(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


def _print_jobs(jobs: list[JobStatus], as_json: bool, fault: str | None = None) -> None:
    if as_json:
        print(json.dumps([_status_dict(s) for s in jobs], indent=2))
        return
    for line in jobs_lines(jobs, width=out.width):
        out.print(line, markup=False, highlight=False)
    stalled = [s for s in jobs if s.stalled]
    if stalled:
        for line in wrap(f"{len(stalled)} job(s) not ended, but {stalled[0].stalled}", out.width):
            out.print(f"[yellow]{escape(line)}[/yellow]", highlight=False)
    if fault:
        for line in wrap(fault, out.width):
            out.print(f"[yellow]{escape(line)}[/yellow]", highlight=False)


def jobs_lines(jobs: list[JobStatus], *, width: int) -> list[str]:
    """`list` as a table of at most `width` columns: full ids where they fit, else each id's shortest
    unique prefix (every command takes it as JOB); the created and loss columns go first when narrow."""
    from orchestrator.observe.goodput import format_duration

    if not jobs:
        return ["no jobs yet"]

    def rows(ids: dict[str, str]) -> list[list[str]]:
        return [[ids[s.id], s.state_name + (f" #{s.queue_position}" if s.queue_position else ""),
                 f"{s.accelerator} {s.tier}", f"{s.step}/{s.total_steps or '?'}", _fmt(s.loss, ".4f"),
                 format_duration(s.wall_s or 0.0),
                 dt.datetime.fromtimestamp(s.created_at).strftime("%m-%d %H:%M")] for s in jobs]

    headers = ["id", "state", "slice", "step", "loss", "wall time", "created"]
    full = table(headers, rows({s.id: s.id for s in jobs}), width, right=(3, 4, 5), drop_order=())
    if max(map(len, full)) <= width:
        return full
    return table(headers, rows(unique_prefixes([s.id for s in jobs])), width, right=(3, 4, 5), drop_order=(6, 4))


@app.command("list")
def list_jobs(as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")) -> None:
    """List all jobs."""
    client = Client()
    _print_jobs(client.jobs(), as_json, client.store_fault())


@app.command()
def logs(job_id: str = typer.Argument(..., help="Job id, id prefix, or name."),
         follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing until the job ends, with progress."),
         as_json: bool = typer.Option(False, "--json", help="With --follow: progress as JSON Lines.")) -> None:
    """Print a job's worker output, each line prefixed with its host."""
    job = Client().job(job_id)
    if follow:
        lines = job.follow_logs(poll_s=0.0)  # each next() reads what arrived since the last

        def drain(progress) -> None:
            for line in _available(lines):
                (progress.console if progress else out).print(line, markup=False, highlight=False)

        watch(job, out, mode="json" if as_json else "auto", on_poll=drain)
        drain(None)
    else:
        sys.stdout.write(job.logs())
        st = job.status()
        if st.store_fault:  # the job's log may be on the same full disk: the controller says it
            err.print(f"[yellow]{escape(st.store_fault)}[/yellow]", highlight=False)


def _available(lines) -> list[str]:
    """The log lines `follow_logs` has now, without waiting for more."""
    out_lines = []
    for line in lines:
        if line is None:
            break
        out_lines.append(line)
    return out_lines


@app.command()
def cancel(job_id: str = typer.Argument(..., help="Job id, id prefix, or name.")) -> None:
    """Cancel a job: its hosts checkpoint the current step and stop, and its slice is released."""
    client = Client()
    try:
        job = client.job(job_id)
        client.cancel(job.id)
    finally:
        client.close(stop_owned_cluster=False)
    out.print(f"cancel requested for {job.id}", highlight=False)


@app.command()
def resize(job_id: str = typer.Argument(..., help="Job id, id prefix, or name."),
           accelerator: str = typer.Argument(..., help="The slice type to move to, e.g. v4-32."),
           reason: str = typer.Option("requested by the user", help="Recorded in the job's events.")) -> None:
    """Move a running job to another slice size (checkpoint, new slice, resharded restore)."""
    client = Client()
    try:
        job = client.resize(job_id, accelerator, reason=reason)
    finally:
        client.close(stop_owned_cluster=False)
    out.print(f"resizing {job.id} to {accelerator}", highlight=False)


@app.command()
def profile(job_id: str = typer.Argument(..., help="Job id, id prefix, or name."),
            steps: int = typer.Option(3, "--steps", help="Steps to trace, 1 to 100."),
            host: str = typer.Option("all", "--host", help="all, or one host's number (0 is the first)."),
            memory: bool = typer.Option(False, "--memory", help="Also save a pprof profile of device memory."),
            timeout: float = typer.Option(300.0, "--timeout", help="Seconds to wait for the capture."),
            as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")) -> None:
    """Trace N steps of a running job on its hosts; say where the trace is and what it shows."""
    from orchestrator.user.capture import MAX_STEPS, render

    if host != "all" and not (host.isascii() and host.isdigit() and len(host) <= 100):  # "²" is a digit int() refuses
        _fail(f"--host must be all or a host's number, got {host!r}")
    if not 1 <= steps <= MAX_STEPS:
        _fail(f"--steps must be 1 to {MAX_STEPS}, got {steps}")
    if not 0 < timeout < math.inf:  # NaN too: a wait against it would never end
        _fail(f"--timeout must be a number of seconds above 0, got {timeout}")
    client = Client()
    try:
        capture = client.profile(job_id, steps=steps, host=None if host == "all" else int(host), memory=memory,
                                 timeout_s=timeout)
    finally:
        client.close(stop_owned_cluster=False)
    if as_json:
        print(json.dumps(capture.to_dict(), indent=2, default=str))
        return
    for line in render(capture):
        out.print(line, markup=False, highlight=False)


@app.command()
def report(job_id: str = typer.Argument(..., help="Job id, id prefix, or name."),
           output: Path = typer.Option(..., "--output", "-o", help="A .png or .html file to write."),
           force: bool = typer.Option(False, "--force", help="Replace an existing file.")) -> None:
    """Write a picture of a job's life: loss, throughput, slices, cost, disruptions, goodput."""
    from orchestrator.observe.report import write_report

    client = Client()
    path = write_report(client.store, client.job(job_id).id, output, force=force)
    out.print(f"wrote {path}", highlight=False)


data_app = typer.Typer(cls=_Commands, no_args_is_help=True, help="Token files for training (see workers.tokens).")
app.add_typer(data_app, name="data")


@data_app.command("prepare")
def data_prepare(src: Path = typer.Argument(..., help="A folder of text files (searched recursively)."),
                 output: str = typer.Option(..., "--output", "-o", help="The folder of token files to write "
                                                                         "(or gs://BUCKET/FOLDER)."),
                 vocab_size: Optional[int] = typer.Option(None, "--vocab-size",
                                                          help="Train a byte-level BPE of this size (default 8192)."),
                 tokenizer: Optional[Path] = typer.Option(None, "--tokenizer",
                                                          help="Use this tokenizer.json instead of training one."),
                 pattern: str = typer.Option("*.txt", "--pattern", help="Which files of SRC to read."),
                 force: bool = typer.Option(False, "--force", help="Replace a non-empty output folder.")) -> None:
    """Turn a folder of text files into token files that `workload.data.path` can name."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TaskID, TextColumn, TimeRemainingColumn

    from orchestrator.user.data_prepare import prepare
    from workers.tokens import DataError

    # The bars show on a terminal only, gone once done (elsewhere rich would print an empty line as they stop).
    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                  console=err, transient=True, disable=not err.is_terminal) as bars:
        tasks: dict[str, TaskID] = {}

        def progress(what: str, done: int, total: int) -> None:
            if what not in tasks:
                tasks[what] = bars.add_task(what, total=total)
            bars.update(tasks[what], completed=done)

        try:
            summary = prepare(src, output, vocab_size=vocab_size, tokenizer=tokenizer, pattern=pattern, force=force,
                              progress=progress)
        except DataError as e:
            _fail(str(e))
    out.print(summary.line(), highlight=False)


@app.command()
def export(job_id: str = typer.Argument(..., help="Job id, id prefix, or name."),
           output: str = typer.Option(..., "--output", "-o", help="The folder to write (model.safetensors, "
                                                                    "config.json), or gs://BUCKET/FOLDER."),
           step: Optional[int] = typer.Option(None, "--step", help="Export this committed step (any job state)."),
           latest: bool = typer.Option(False, "--latest", help="Export the newest committed step of a job that "
                                                                "did not succeed."),
           force: bool = typer.Option(False, "--force", help="Replace a non-empty output folder."),
           subtree: Optional[str] = typer.Option(None, "--subtree", help="The part of the state to write, by key "
                                                 "path (opt_state/mu, ema); / for the whole state. Default: params "
                                                 "(the whole state when it has none).")) -> None:
    """Write a job's trained parameters as safetensors with their config (read back: workers.export.load)."""
    from orchestrator.errors import JobStateError
    from orchestrator.user.outputs import check_output_folder
    from workers.export import ExportError

    if latest and step is not None:
        _fail("--latest and --step exclude each other: the newest committed step, or step N")
    if step is not None and step < 0:
        _fail(f"--step must be a committed step (0 or more), got {step}")
    check_output_folder(output, force=force)  # the name and the folder, before the job and its checkpoint
    _jax_on_cpu()
    try:
        done = Client().export(job_id, output, step=step, latest=latest, force=force, subtree=subtree)
    except JobStateError as e:
        _fail(f"job {e.job_id} is {e.state}: its final weights are those of a SUCCEEDED job; "
              "--latest exports its newest committed checkpoint, --step N a given one")
    except ExportError as e:
        _fail(str(e))
    size = f"{done.bytes / 2**20:.1f} MiB" if done.bytes >= 2**20 else f"{done.bytes / 1024:.1f} KiB"
    out.print(f"wrote {done.out}: step {done.step}, {done.tensors} tensors, {done.parameters:,} parameters ({size})",
              highlight=False)


def _jax_on_cpu() -> None:
    """JAX on the CPU only, if it has not started yet (in this command's own process): an export is read on the
    CPU, and JAX's look for a TPU, on a machine with libtpu and no TPU, prints a page of warnings to stderr."""
    import jax
    from jax._src import xla_bridge

    if not xla_bridge.backends_are_initialized():
        jax.config.update("jax_platforms", "cpu")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
             add_help_option=False)
def emulator(ctx: typer.Context) -> None:
    """Emulated Google Cloud on 127.0.0.1: the TPU API; with --vms, VMs behind its nodes and Cloud Storage.
    Subcommands: slices, reclaim, poweroff, notice (`orchestrator emulator --help`)."""
    from orchestrator.emulator.cli import main as emulator_main  # the emulator loads only here (a tool beside)

    raise typer.Exit(emulator_main(list(ctx.args)))


@app.command()
def gc(project: str = typer.Option(..., help="Google Cloud project."),
       zone: list[str] = typer.Option(..., "--zone", help="Zone to look in (repeatable)."),
       endpoint: Optional[str] = typer.Option(None, help="TPU API endpoint (the emulator's URL in tests)."),
       dry_run: bool = typer.Option(False, "--dry-run", help="List, do not delete.")) -> None:
    """Delete Cloud TPU slices labelled by this tool whose jobs are gone (leaked slices)."""
    from orchestrator.domain.locations import check_endpoint
    from orchestrator.providers.gcp import GcpTpuProvider, collect_leaked

    if not project.strip():
        _fail("--project must name a Google Cloud project, got ''")
    if endpoint is not None:  # "" would mean Google's, with this machine's credentials: not what was asked
        try:
            endpoint = check_endpoint(endpoint)
        except ValueError as e:
            _fail(f"--endpoint {e}")
    client = Client()
    live = {j.id for j in client.store.jobs(active_only=True)}
    provider = GcpTpuProvider(project, zone, endpoint=endpoint, join_check=lambda s: [])
    leaked = collect_leaked(provider, live, dry_run=dry_run)
    verb = "would delete" if dry_run else "deleted"
    out.print(f"{verb} {len(leaked)} leaked slice(s){': ' + ', '.join(leaked) if leaked else ''}", highlight=False)


@app.command()
def plan(job_file: Path = typer.Argument(..., help="The job's YAML file."),
         trace: Optional[Path] = typer.Option(None, "--trace",
                                              help="A spot capacity trace (JSON, as in policies/evaluation/traces)."),
         deadline_hours: Optional[float] = typer.Option(None, help="Overrides the job file's deadline."),
         compile: bool = CompileOpt) -> None:
    """For each slice type and tier: expected cost, time and deadline risk; and the policy's plan."""
    from orchestrator.domain.fit import slice_fit
    from orchestrator.domain.spec import AutoscalingConfig, LmWorkload
    from orchestrator.user.planning import deadline_problem, moves_lines, plan_spec, render_memory, render_plan
    from policies.evaluation.traces import TraceError

    if deadline_hours is not None and (problem := deadline_problem(deadline_hours)) is not None:
        _fail(f"--deadline-hours must be {problem}")  # before the job file is read
    spec = JobSpec.from_yaml(job_file, check_memory=not compile)
    own = not isinstance(spec.workload, LmWorkload)
    if own and not compile:
        _fail(f"{job_file}: plan needs the built-in lm workload's model size; for a program of your own, plan "
              "--compile takes its step's FLOPs from the TPU compiler (declare it: ctx.loop(state, step=...))")
    if deadline_hours is None and spec.deadline is None:  # before any compile
        _fail(f"{job_file}: deadline: plan needs a deadline (in the job file, or --deadline-hours)")
    if trace is not None and not trace.is_file():
        _fail(f"{trace}: file not found")
    flops, steps = None, None
    if compile:  # the compiler's table first: the plan starts from the steps it compiled
        from orchestrator.user.compiled import compiled_steps, model_flops_per_step

        rows = _compile_check(spec, job_file)
        flops = model_flops_per_step(spec, rows)[0] if rows is not None and own else None
        steps = compiled_steps(spec, rows) if rows is not None else None
    try:
        result = plan_spec(spec, deadline_hours=deadline_hours, trace_path=trace, model_flops_per_step=flops,
                           compiled=steps)
    except ValueError as e:
        _fail(f"{job_file}: {e}")
    except TraceError as e:
        _fail(str(e))
    out.print(render_plan(result))
    for line in moves_lines(result, width=out.width):
        out.print(line, markup=False, highlight=False)
    if not own and not compile:  # with --compile, the compiler's HBM figures above replace the estimate
        auto = spec.autoscaling or AutoscalingConfig()
        out.print(render_memory([slice_fit(spec, name) for name in auto.accelerators]))


@app.command()
def up() -> None:
    """Start the embedded local Ray cluster (127.0.0.1, token auth) and its controller."""
    client = Client()
    client.connect()  # a ClusterError ends the command, exit 1
    import orchestrator.cluster as c

    info = c.read_cluster(client.home)
    if info is None:  # it went again between the two looks
        raise ClusterError(f"the cluster in {client.home.root} stopped just after it started; see its logs there")
    import ray

    ray.get(client.controller().ping.remote())
    client.close(stop_owned_cluster=False)
    urls = json.loads((client.home.root / "metrics.json").read_text())
    out.print(f"cluster up at {info.address} (state in {client.home.root})", highlight=False)
    out.print(f"metrics at {urls['url']}", highlight=False)
    if urls.get("dashboard"):
        out.print(f"dashboard at {urls['dashboard']} (`orchestrator dashboard` prints its login link)", highlight=False)
    out.print("stop it with: orchestrator down", highlight=False)


@app.command()
def dashboard(open_browser: bool = typer.Option(False, "--open", help="Also open it in the web browser.")) -> None:
    """Print the dashboard's login link (all jobs, live); starts the local cluster if none runs.

    The link carries the cluster's token once: the page logs in, keeps a session cookie and
    drops the token from the address. Keep the link to yourself as you would the token.
    """
    import ray

    from orchestrator.cluster import ensure_token

    client = Client()
    try:
        url = ray.get(client.controller().dashboard_url.remote(), timeout=60)
    finally:
        client.close(stop_owned_cluster=False)
    if url is None:
        _fail(f"the controller could not serve the dashboard; see {client.home.root / 'logs' / 'controller.log'}", 1)
    ensure_token(client.home)
    token = client.home.token_file.read_text().strip()
    link = f"{url}?token={token}"
    print(link, flush=True)  # plain print: a terminal must not wrap or style the one line to copy
    if open_browser:
        import webbrowser

        webbrowser.open(link)


@app.command()
def down() -> None:
    """Cancel active jobs, release every slice and stop the embedded cluster."""
    stopped = Client(stopping=True).down()
    out.print("cluster stopped" if stopped else "no cluster was running", highlight=False)


def main() -> None:
    app()  # errors become `error:` lines in _Commands.invoke


if __name__ == "__main__":
    main()
