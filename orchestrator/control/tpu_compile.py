"""A job's train step compiled by XLA's TPU compiler for a slice type and count, on this machine.

The program is the one the job's hosts would run on that slice: the settings are resolved
by `launch.workload_for`, as for a launch, and the trainer, mesh and kernels are built by
the workers' own code (`workers.tpu_target`). Nothing is provisioned and nothing runs.
"""

from __future__ import annotations

import os

from orchestrator.catalog import TpuType
from orchestrator.control.launch import workload_for
from orchestrator.domain.spec import JobSpec, LmWorkload
from workers.tpu_target import (
    ProgramReport,
    Topology,
    compile_train_step,
    keep_report,
    kept_report,
    program_key,
)


def topology(t: TpuType, slices: int = 1) -> Topology:
    """The compile target of `slices` slices of type `t`."""
    return Topology(t.generation.chip.name, t.topology, hosts=t.hosts, slices=slices)


def compile_step(spec: JobSpec, t: TpuType, slices: int = 1) -> ProgramReport:
    """The compiler's report of `spec`'s train step on `slices` x `t` (the built-in trainer's jobs)."""
    return step_report(spec, t, slices)[0]


def step_report(spec: JobSpec, t: TpuType, slices: int = 1, *,
                cache_dir: str | os.PathLike | None = None) -> tuple[ProgramReport, bool]:
    """The compiler's report of `spec`'s train step on `slices` x `t`, and whether it was kept from before
    (in `cache_dir`, by `workers.tpu_target.program_key`: the same settings, target, code and compiler).

    Raises:
      ValueError: `spec` runs a program of its own (its step is not known before it runs).
      workers.tpu_target.TargetUnavailable: no TPU compiler here (libtpu missing).
      Whatever the compiler raises for a program it rejects.
    """
    if not isinstance(spec.workload, LmWorkload):
        raise ValueError(f"job {spec.name}: workload.type {spec.workload.type!r} runs its own program; only the "
                         "built-in trainer's step can be compiled before it runs")
    on = spec.moved(t.name, spec.tier, slices=slices)
    work = workload_for(on, t.chips, t.hosts, slices=slices)
    target = topology(t, slices)
    key = program_key(work["lm"], work["settings"], target)
    if (kept := kept_report(cache_dir, key)) is not None:
        return kept, True
    _, report = compile_train_step(work["lm"], work["settings"], target)
    keep_report(cache_dir, key, report)
    return report, False
