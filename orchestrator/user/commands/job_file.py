"""The commands that read a job file and run nothing: `validate`, `schema` and `plan`, and the compile check."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from orchestrator.domain.spec import JobSpec, json_schema
from orchestrator.errors import SpecError
from orchestrator.user.commands import console
from orchestrator.user.commands.console import fail
from orchestrator.user.preflight import gcp_problems

CompileOpt = typer.Option(False, "--compile", help="Compile the train step for every slice the job may use with "
                          "XLA's TPU compiler (needs libtpu): does it fit, and how fast could it go.")


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
        compile_check(spec, job_file)
    console.out.print(f"{job_file}: valid ({what}, {spec.tier.value})", highlight=False)


def compile_check(spec: JobSpec, job_file: Path) -> list | None:
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
        rows = compile_options(spec, cache_dir=cache, progress=lambda line: console.err.print(line, highlight=False))
    except StepNotDeclared as e:
        console.err.print(f"warning: {job_file}: --compile: not compiled: {e}; checked without the compiler",
                          highlight=False, markup=False)
        return None
    except (ValueError, TargetUnavailable, EntrypointImportError) as e:
        fail(f"{job_file}: --compile: {e}")
    console.out.print(render(rows, spec))
    refused = [(r.field, line) for r in rows if (line := r.refusal()) is not None]
    if refused:
        raise SpecError(str(job_file), refused)
    return rows


def schema() -> None:
    """Print the JSON Schema of job files (for editors)."""
    print(json.dumps(json_schema(), indent=2))


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
        fail(f"--deadline-hours must be {problem}")  # before the job file is read
    spec = JobSpec.from_yaml(job_file, check_memory=not compile)
    own = not isinstance(spec.workload, LmWorkload)
    if own and not compile:
        fail(f"{job_file}: plan needs the built-in lm workload's model size; for a program of your own, plan "
             "--compile takes its step's FLOPs from the TPU compiler (declare it: ctx.loop(state, step=...))")
    if deadline_hours is None and spec.deadline is None:  # before any compile
        fail(f"{job_file}: deadline: plan needs a deadline (in the job file, or --deadline-hours)")
    if trace is not None and not trace.is_file():
        fail(f"{trace}: file not found")
    flops, steps = None, None
    if compile:  # the compiler's table first: the plan starts from the steps it compiled
        from orchestrator.user.compiled import compiled_steps, model_flops_per_step

        rows = compile_check(spec, job_file)
        flops = model_flops_per_step(spec, rows)[0] if rows is not None and own else None
        steps = compiled_steps(spec, rows) if rows is not None else None
    try:
        result = plan_spec(spec, deadline_hours=deadline_hours, trace_path=trace, model_flops_per_step=flops,
                           compiled=steps)
    except ValueError as e:
        fail(f"{job_file}: {e}")
    except TraceError as e:
        fail(str(e))
    out = console.out
    out.print(render_plan(result))
    for line in moves_lines(result, width=out.width):
        out.print(line, markup=False, highlight=False)
    if not own and not compile:  # with --compile, the compiler's HBM figures above replace the estimate
        auto = spec.autoscaling or AutoscalingConfig()
        out.print(render_memory([slice_fit(spec, name) for name in auto.accelerators]))
