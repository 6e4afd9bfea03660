"""Compile before paying: does a job fit each slice it may use, and how fast could it go there, by XLA's TPU compiler.

For every option the job may run on (its own type and slice count, and the types and counts
autoscaling may choose), the job's train step is compiled for that slice's topology on this
machine, as its hosts would build it (`orchestrator.control.tpu_compile`). The compiler then
says, before anything is provisioned:

- whether the step compiles at all (a kernel Mosaic cannot lower, a sharding that does not
  partition), with its reason in one line;
- the HBM each chip needs at the step's peak (arguments, outputs, scratch, code), against the
  usable share of the chip's HBM (`policies.model.memory_fit.USABLE_FRACTION`, as the formula's
  check uses);
- the step's FLOPs and HBM traffic, and from them a roofline: the least time a step can take
  at the chip's peak rate and bandwidth (`workers.tpu_target.roofline_s`). It is a bound, not a
  measurement: nothing here runs on a TPU, and real steps reach some fraction of it (the
  MFU column says which fraction the bound itself would be: its FLOPs as MFU counts them).

A user's own program is compiled too when it declares its step (``ctx.loop(state,
step=train_step)``, `workers.api.Context.loop`): it is imported from its folder and traced
without running, as `orchestrator.control.tpu_compile` describes; one that does not declare
it raises `workers.api.StepNotDeclared`, which says so.

Reports are kept by program (`workers.tpu_target.program_key`) under the state directory, so
a second look at the same job is a file read.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rich.table import Table

from orchestrator import catalog
from orchestrator.domain.spec import AutoscalingConfig, JobSpec, LmWorkload
from policies.cost.compiled_prior import CompiledStep
from policies.model.memory_fit import GIB, USABLE_FRACTION
from workers.api import StepNotDeclared
from workers.tpu_target import ProgramReport, TargetUnavailable, roofline_s


@dataclass(frozen=True)
class CompiledOption:
    """One option the job may run on, as the TPU compiler sees it."""

    accelerator: str
    slices: int
    field: str  # the job file's field that allows it: accelerator, or autoscaling.accelerators
    report: ProgramReport | None  # None: it did not compile (`error`)
    error: str | None
    kept: bool  # the report was kept from an earlier compile of the same program
    wall_s: float  # what this look took here (the compile, or reading the kept report)

    @property
    def label(self) -> str:
        return _label(self.accelerator, self.slices)

    @property
    def tpu_type(self) -> catalog.TpuType:
        return catalog.lookup(self.accelerator)

    @property
    def usable_bytes(self) -> float:
        return USABLE_FRACTION * self.tpu_type.hbm_bytes_per_chip

    @property
    def fits(self) -> bool:
        return self.report is not None and self.report.hbm_bytes_per_chip <= self.usable_bytes

    @property
    def step_s(self) -> float | None:
        """The roofline time of one step (a lower bound), None without a report."""
        return None if self.report is None else roofline_s(self.report, self.tpu_type.generation.chip)

    def tokens_per_s(self, tokens_per_step: int) -> float | None:
        step = self.step_s
        return None if not step else tokens_per_step / step

    def mfu(self, model_flops_per_step: float) -> float | None:
        """The model FLOPs utilisation a step at the roofline time would have."""
        step = self.step_s
        if not step:
            return None
        chips = self.tpu_type.chips * self.slices
        return model_flops_per_step / step / (chips * self.tpu_type.peak_bf16_flops_per_chip)

    @property
    def out_of_memory(self) -> bool:
        """The compiler itself refused the step for want of HBM (it plans every buffer and stops there)."""
        return self.error is not None and "RESOURCE_EXHAUSTED" in self.error

    def refusal(self) -> str | None:
        """One line when the job cannot run here, else None."""
        if self.out_of_memory:
            reason = (self.error or "").split("RESOURCE_EXHAUSTED:", 1)[-1].strip()
            return f"{self.label}: training does not fit: the TPU compiler says: {reason}"
        if self.report is None:
            return f"{self.label}: the TPU compiler rejected the train step: {self.error}"
        if not self.fits:
            r, hbm = self.report, self.tpu_type.hbm_bytes_per_chip
            return (f"{self.label}: the TPU compiler needs {r.hbm_bytes_per_chip / GIB:.1f} GiB of HBM per chip, over "
                    f"the {self.usable_bytes / GIB:.1f} GiB usable of {hbm / GIB:.0f} GiB (arguments "
                    f"{r.argument_bytes / GIB:.1f}, scratch {r.temp_bytes / GIB:.1f})")
        return None


def options(spec: JobSpec) -> list[tuple[str, int, str]]:
    """(type, slice count, field) of every option the job may run on: its own, then autoscaling's."""
    from orchestrator.control.autoscaler import counted_options
    from orchestrator.domain.options import job_options

    found = [(spec.accelerator, spec.slices, "accelerator")]
    if spec.autoscaling is not None:
        auto: AutoscalingConfig = spec.autoscaling
        w = spec.workload
        tokens = (w.global_batch_size or 1) * (w.seq_len or 1)
        singles = job_options(auto.accelerators, [auto.tiers[0].value])
        for o in counted_options(spec, singles, tokens):
            if (o.name, o.count) not in [(a, n) for a, n, _ in found]:
                found.append((o.name, o.count, "autoscaling.accelerators"))
    return found


def compile_options(spec: JobSpec, *, cache_dir: Path | None,
                    progress: Callable[[str], None] = lambda line: None) -> list[CompiledOption]:
    """Every option of `spec` compiled (or its report read back), in `options` order.

    Raises:
      ValueError: the job runs a program of its own (nothing to compile before it runs).
      workers.tpu_target.TargetUnavailable: XLA's TPU compiler is not installed here.
    """
    from orchestrator.control.tpu_compile import EntrypointImportError, step_report

    own = not isinstance(spec.workload, LmWorkload)
    rows = []
    found = options(spec)
    for i, (name, count, field) in enumerate(found, 1):
        progress(f"[{i}/{len(found)}] compiling the train step for {_label(name, count)} ...")
        t0 = time.perf_counter()
        try:
            report, kept = step_report(spec, catalog.lookup(name), count, cache_dir=cache_dir)
            error = None
        except (TargetUnavailable, StepNotDeclared, EntrypointImportError):
            raise  # the same for every option: the caller says it once
        except (ValueError, RuntimeError, NotImplementedError) as e:  # how the compiler and Mosaic refuse
            report, kept, error = None, False, _one_line(e)
        except Exception as e:  # a user's program traced: whatever its own code raises is this option's verdict
            if not own:
                raise
            report, kept, error = None, False, "the program could not be traced: " + _one_line(e)
        rows.append(CompiledOption(name, count, field, report, error, kept, time.perf_counter() - t0))
    return rows


def compiled_steps(spec: JobSpec, rows: list[CompiledOption]) -> dict[str, CompiledStep]:
    """The compiler's step of each option that compiled and fits, by `Option.what` ("v4-16", "2xv4-16"): what the
    cost plan starts from (`policies.cost.compiled_prior`) before anything is measured."""
    w = spec.workload
    tokens = float((w.global_batch_size or 0) * (w.seq_len or 0))
    out = {}
    for r in rows:
        if r.fits and r.step_s and tokens:
            out[r.accelerator if r.slices == 1 else f"{r.slices}x{r.accelerator}"] = CompiledStep(tokens, r.step_s)
    return out


def model_flops_per_step(spec: JobSpec, rows: list[CompiledOption]) -> tuple[float | None, str]:
    """The model FLOPs of one step, for MFU and the cost plan, and where they come from: the built-in model's
    formula; a user's program's own figure (the `flops_per_step` it gives `ctx.loop`); else the compiler's count
    of the first option that compiled (every FLOP it runs, recomputation included: MFU from it reads high)."""
    w = spec.workload
    if isinstance(w, LmWorkload):
        return w.model.shape().flops_per_token(w.seq_len) * w.global_batch_size * w.seq_len, "the model's formula"
    compiled = [r.report for r in rows if r.report is not None]
    if not compiled:
        return None, "no option compiled"
    if compiled[0].model_flops_per_step:
        return compiled[0].model_flops_per_step, "the program's flops_per_step"
    return compiled[0].flops, "the compiler's count (the program states no flops_per_step)"


def _label(accelerator: str, slices: int) -> str:
    return accelerator if slices == 1 else f"{slices} x {accelerator}"


def _one_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]


def render(rows: list[CompiledOption], spec: JobSpec) -> Table:
    """A rich Table: each option's verdict and figures by the TPU compiler."""
    w = spec.workload
    tokens = (w.global_batch_size or 0) * (w.seq_len or 0)
    model_flops, flops_from = model_flops_per_step(spec, rows)
    table = Table(title=f"The train step by XLA's TPU compiler, per chip (usable HBM: {USABLE_FRACTION:.0%}). * the "
                        "roofline of the compiler's FLOPs and HBM bytes at the chip's peak: a bound, not measured",
                  caption=f"MFU: model FLOPs from {flops_from}")
    table.add_column("slice", no_wrap=True)
    for column in ("compiles", "HBM GiB", "usable", "fits", "compile s", "step ms*", "tokens/s*", "MFU*"):
        table.add_column(column, justify="right", no_wrap=True)
    for r in rows:
        took = "kept" if r.kept else f"{r.report.compile_s:.1f}" if r.report else f"{r.wall_s:.1f}"
        if r.report is None:
            table.add_row(r.label, "no HBM" if r.out_of_memory else "no", "-", f"{r.usable_bytes / GIB:.1f}", "no",
                          took, "-", "-", "-", style="red")
            continue
        speed, step = r.tokens_per_s(tokens) if tokens else None, r.step_s
        mfu = r.mfu(model_flops) if model_flops else None
        table.add_row(r.label, "yes", f"{r.report.hbm_bytes_per_chip / GIB:,.2f}", f"{r.usable_bytes / GIB:.1f}",
                      "yes" if r.fits else "no", took, "-" if step is None else f"{step * 1e3:,.3g}",
                      "-" if speed is None else f"{speed:,.0f}", "-" if mfu is None else f"{mfu:.0%}",
                      style=None if r.fits else "red")
    return table
