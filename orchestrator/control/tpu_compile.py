"""A job's train step compiled by XLA's TPU compiler for a slice type and count, on this machine.

The program is the one the job's hosts would run on that slice: the settings are resolved
by `launch.launch_order`, as for a launch, and the trainer, mesh and kernels are built by
the workers' own code (`workers.tpu_target`); a user's own program is imported from its job's
folder and traced up to the step it declares. Nothing is provisioned and nothing runs.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from orchestrator.catalog import TpuType
from orchestrator.control.launch import launch_order
from orchestrator.domain.spec import JobSpec
from workers.order import BuiltInTrainer
from workers.tpu_target import (
    ProgramReport,
    Topology,
    compile_program,
    compile_train_step,
    keep_report,
    kept_report,
    program_key,
    user_program_key,
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

    The built-in trainer's step is built by the workers' own code; a user's program (an
    entrypoint) is imported from the job's folder and traced (`workers.tpu_target.compile_program`).

    Raises:
      workers.api.StepNotDeclared: the user's program does not give `ctx.loop` its step.
      workers.tpu_target.TargetUnavailable: no TPU compiler here (libtpu missing).
      EntrypointImportError: the user's program could not be imported.
      Whatever the compiler raises for a program it rejects, and whatever a user's program raises
      while it is traced.
    """
    order = launch_order(spec.moved(t.name, spec.tier, slices=slices), t.chips, t.hosts, slices=slices)
    target, program = topology(t, slices), order.program
    if isinstance(program, BuiltInTrainer):
        key = program_key(program.lm, order.settings, target)
    else:
        key = user_program_key(program.entrypoint, program.args, program.workdir, order.settings, target)
    if (kept := kept_report(cache_dir, key)) is not None:
        return kept, True
    if isinstance(program, BuiltInTrainer):
        _, report = compile_train_step(program.lm, order.settings, target)
    else:
        with _imported(program.entrypoint, program.workdir) as main:
            _, report = compile_program(main, order.settings, target, args=program.args)
    keep_report(cache_dir, key, report)
    return report, False


class EntrypointImportError(ImportError):
    """A job's entrypoint could not be imported here to be compiled."""


@contextlib.contextmanager
def _imported(entrypoint: str, workdir: str | None) -> Iterator[Callable[..., Any]]:
    """The function `entrypoint` ("module:function") names, imported from `workdir` as its hosts import it;
    the modules of that folder are forgotten afterwards (another job's folder may hold a module of the same name)."""
    module_name, _, fn_name = entrypoint.partition(":")
    before = set(sys.modules)
    added = workdir is not None and workdir not in sys.path
    if added:
        sys.path.insert(0, str(workdir))
    try:
        try:
            fn = getattr(importlib.import_module(module_name), fn_name)
        except Exception as e:
            raise EntrypointImportError(f"cannot import the entrypoint {entrypoint} from {workdir}: "
                                        f"{type(e).__name__}: {e}") from e
        yield fn
    finally:
        if added:
            sys.path.remove(str(workdir))
        if workdir is not None:
            root = Path(workdir).resolve()
            for name in set(sys.modules) - before:
                where = getattr(sys.modules[name], "__file__", None)
                if where and Path(where).resolve().is_relative_to(root):
                    del sys.modules[name]
