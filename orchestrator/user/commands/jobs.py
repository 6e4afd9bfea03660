"""The commands on jobs: `submit`, then `status`, `list`, `logs`, `cancel`, `resize`, `profile` and `report`."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from orchestrator.domain.spec import JobSpec
from orchestrator.errors import OrchestratorError
from orchestrator.state.states import JobState
from orchestrator.user.client import Client
from orchestrator.user.commands import console
from orchestrator.user.commands.console import EXIT_JOB_FAILED, EXIT_OK, fail
from orchestrator.user.commands.job_file import compile_check
from orchestrator.user.commands.views import clock_time, print_jobs, status_dict, status_lines
from orchestrator.user.job import JobStatus
from orchestrator.user.progress import watch
from orchestrator.user.terminal import wrap

AddressOpt = typer.Option(None, "--address", help="Ray cluster address; default: the embedded local cluster.")


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
        fail("--fresh and --resume-anyway exclude each other: start over, or resume")
    spec = JobSpec.from_yaml(job_file, check_memory=not compile)
    if compile:
        compile_check(spec, job_file)  # exit 2 before any cluster or slice is touched
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
        console.err.print(f"follow it with: orchestrator logs {job.id} --follow   "
                          "(stop the cluster: orchestrator down)")
        raise typer.Exit(EXIT_OK)
    try:
        st = watch(job, console.out, mode="quiet" if quiet else "json" if as_json else "auto")
    except KeyboardInterrupt:
        client.close(stop_owned_cluster=False)
        console.err.print(f"\nstopped waiting; the job goes on. cancel it with: orchestrator cancel {job.id}")
        raise typer.Exit(130) from None
    client.close()
    if not as_json:
        _print_final(st)
    raise typer.Exit(EXIT_OK if st.state is JobState.SUCCEEDED else EXIT_JOB_FAILED)


def _print_final(st: JobStatus) -> None:
    color = "green" if st.state is JobState.SUCCEEDED else "red"
    console.out.print(f"[{color}]{st.state_name}[/{color}] {st.id}: {st.reason}", highlight=False)
    if st.state is JobState.FAILED and st.error:
        console.err.print(st.error, markup=False, highlight=False)


def status(job_id: Optional[str] = typer.Argument(None, help="Job id, id prefix, or name."),
           events: bool = typer.Option(False, "--events", "-e", help="Show the job's events."),
           as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")) -> None:
    """Show one job (exit code 1 if it failed) or, with no JOB, all jobs."""
    client = Client()
    if job_id is None:
        print_jobs(client.jobs(), as_json, client.store_fault())
        return
    from orchestrator.observe.goodput import goodput

    job = client.job(job_id)
    st = job.status()
    out = console.out
    if as_json:
        data = status_dict(st)
        data["goodput"] = goodput(client.store, st.id).to_dict()
        if events:
            data["events"] = [vars(e) for e in job.events()]
        print(json.dumps(data, indent=2, default=str))
    else:
        for line in status_lines(st, goodput(client.store, st.id), width=out.width):
            out.print(line, markup=False, highlight=False)
        if st.error and st.state is JobState.FAILED:
            out.print("  last error:", highlight=False)
            out.print(st.error, markup=False, highlight=False)
        if events:
            for e in job.events():
                what = (f"{e.from_state.value if e.from_state else ''} -> {e.to_state.value}" if e.to_state
                        else e.kind.value)
                for line in wrap(f"{clock_time(e.at)}  {what}: {e.reason}", out.width, hanging=" " * 14):
                    out.print(line, markup=False, highlight=False)
    if st.done and st.state is not JobState.SUCCEEDED:
        raise typer.Exit(EXIT_JOB_FAILED)


def list_jobs(as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")) -> None:
    """List all jobs."""
    client = Client()
    print_jobs(client.jobs(), as_json, client.store_fault())


def logs(job_id: str = typer.Argument(..., help="Job id, id prefix, or name."),
         follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing until the job ends, with progress."),
         as_json: bool = typer.Option(False, "--json", help="With --follow: progress as JSON Lines.")) -> None:
    """Print a job's worker output, each line prefixed with its host."""
    job = Client().job(job_id)
    if follow:
        lines = job.follow_logs(poll_s=0.0)  # each next() reads what arrived since the last

        def drain(progress) -> None:
            for line in _available(lines):
                (progress.console if progress else console.out).print(line, markup=False, highlight=False)

        watch(job, console.out, mode="json" if as_json else "auto", on_poll=drain)
        drain(None)
    else:
        sys.stdout.write(job.logs())
        st = job.status()
        if st.store_fault:  # the job's log may be on the same full disk: the controller says it
            console.err.print(f"[yellow]{escape(st.store_fault)}[/yellow]", highlight=False)


def _available(lines) -> list[str]:
    """The log lines `follow_logs` has now, without waiting for more."""
    out_lines = []
    for line in lines:
        if line is None:
            break
        out_lines.append(line)
    return out_lines


def cancel(job_id: str = typer.Argument(..., help="Job id, id prefix, or name.")) -> None:
    """Cancel a job: its hosts checkpoint the current step and stop, and its slice is released."""
    client = Client()
    try:
        job = client.job(job_id)
        client.cancel(job.id)
    finally:
        client.close(stop_owned_cluster=False)
    console.out.print(f"cancel requested for {job.id}", highlight=False)


def resize(job_id: str = typer.Argument(..., help="Job id, id prefix, or name."),
           accelerator: str = typer.Argument(..., help="The slice type to move to, e.g. v4-32."),
           reason: str = typer.Option("requested by the user", help="Recorded in the job's events.")) -> None:
    """Move a running job to another slice size (checkpoint, new slice, resharded restore)."""
    client = Client()
    try:
        job = client.resize(job_id, accelerator, reason=reason)
    finally:
        client.close(stop_owned_cluster=False)
    console.out.print(f"resizing {job.id} to {accelerator}", highlight=False)


def profile(job_id: str = typer.Argument(..., help="Job id, id prefix, or name."),
            steps: int = typer.Option(3, "--steps", help="Steps to trace, 1 to 100."),
            host: str = typer.Option("all", "--host", help="all, or one host's number (0 is the first)."),
            memory: bool = typer.Option(False, "--memory", help="Also save a pprof profile of device memory."),
            timeout: float = typer.Option(300.0, "--timeout", help="Seconds to wait for the capture."),
            as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")) -> None:
    """Trace N steps of a running job on its hosts; say where the trace is and what it shows."""
    from orchestrator.user.capture import MAX_STEPS, render

    if host != "all" and not (host.isascii() and host.isdigit() and len(host) <= 100):  # "²" is a digit int() refuses
        fail(f"--host must be all or a host's number, got {host!r}")
    if not 1 <= steps <= MAX_STEPS:
        fail(f"--steps must be 1 to {MAX_STEPS}, got {steps}")
    if not 0 < timeout < math.inf:  # NaN too: a wait against it would never end
        fail(f"--timeout must be a number of seconds above 0, got {timeout}")
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
        console.out.print(line, markup=False, highlight=False)


def report(job_id: str = typer.Argument(..., help="Job id, id prefix, or name."),
           output: Path = typer.Option(..., "--output", "-o", help="A .png or .html file to write."),
           force: bool = typer.Option(False, "--force", help="Replace an existing file.")) -> None:
    """Write a picture of a job's life: loss, throughput, slices, cost, disruptions, goodput."""
    from orchestrator.observe.report import write_report

    client = Client()
    path = write_report(client.store, client.job(job_id).id, output, force=force)
    console.out.print(f"wrote {path}", highlight=False)
