"""The commands that move data: token files in (`data prepare`), a job's trained weights out (`export`)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from orchestrator.user.client import Client
from orchestrator.user.commands import console
from orchestrator.user.commands.console import fail


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

    err = console.err
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
            fail(str(e))
    console.out.print(summary.line(), highlight=False)


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
        fail("--latest and --step exclude each other: the newest committed step, or step N")
    if step is not None and step < 0:
        fail(f"--step must be a committed step (0 or more), got {step}")
    check_output_folder(output, force=force)  # the name and the folder, before the job and its checkpoint
    _jax_on_cpu()
    try:
        done = Client().export(job_id, output, step=step, latest=latest, force=force, subtree=subtree)
    except JobStateError as e:
        fail(f"job {e.job_id} is {e.state}: its final weights are those of a SUCCEEDED job; "
             "--latest exports its newest committed checkpoint, --step N a given one")
    except ExportError as e:
        fail(str(e))
    size = f"{done.bytes / 2**20:.1f} MiB" if done.bytes >= 2**20 else f"{done.bytes / 1024:.1f} KiB"
    console.out.print(f"wrote {done.out}: step {done.step}, {done.tensors} tensors, {done.parameters:,} parameters "
                      f"({size})", highlight=False)


def _jax_on_cpu() -> None:
    """JAX on the CPU only, if it has not started yet (in this command's own process): an export is read on the
    CPU, and JAX's look for a TPU, on a machine with libtpu and no TPU, prints a page of warnings to stderr."""
    import jax
    from jax._src import xla_bridge

    if not xla_bridge.backends_are_initialized():
        jax.config.update("jax_platforms", "cpu")
