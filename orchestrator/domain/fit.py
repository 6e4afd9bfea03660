"""Does a job fit the slices it may run on? The spec's memory-fit check and the microbatch count per slice.

The glue between the job spec and the pure estimate in `policies.model.memory_fit`: for the job's
accelerator and every type autoscaling may move it to, resolve the mesh, resolve
``gradient_accumulation: auto`` to the fewest microbatches that fit, and compare the
per-chip estimate with the type's HBM (`orchestrator.catalog`). Slices are TPUs, so
``precision.compute: auto`` counts as bfloat16 here.

A user program's model is its own: nothing is estimated for it, and ``auto`` means one
microbatch (the program may choose otherwise).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from orchestrator import catalog
from orchestrator.domain.workload import EntrypointWorkload, LmWorkload
from policies.model.memory_fit import GIB, USABLE_FRACTION, Fit, TrainingJob, advice, fit
from policies.model.sharding import MeshError, MeshPlan, plan_slices


class _Types(Protocol):
    @property
    def accelerators(self) -> Sequence[str]: ...


class FitSpec(Protocol):
    """What the fit reads of a job spec (`orchestrator.domain.spec.JobSpec` is one). A Protocol, not an import:
    the spec asks the fit while it validates, so the fit sits below it."""

    @property
    def accelerator(self) -> str: ...

    @property
    def autoscaling(self) -> _Types | None: ...

    @property
    def workload(self) -> LmWorkload | EntrypointWorkload: ...


@dataclass(frozen=True)
class SliceFit:
    """One slice type's verdict: its mesh, and the estimate at the microbatch count chosen or asked for."""

    accelerator: str
    field: str  # the spec field that names this type: accelerator, or autoscaling.accelerators
    mesh: MeshPlan | None  # None: the mesh wishes do not divide this type (`mesh_error` says why)
    fit: Fit | None  # None without a mesh, or when the asked microbatch count does not divide the rows
    mesh_error: str | None = None
    advice: tuple[str, ...] = ()  # when it does not fit

    @property
    def microbatches(self) -> int | None:
        return None if self.fit is None else self.fit.estimate.microbatches


def candidate_types(spec: FitSpec) -> list[tuple[str, str]]:
    """(type name, spec field) for every slice type the job may run on, the spec's own first."""
    names = [(spec.accelerator, "accelerator")]
    for name in spec.autoscaling.accelerators if spec.autoscaling else []:
        if name not in [n for n, _ in names]:
            names.append((name, "autoscaling.accelerators"))
    return names


def training_job(w: LmWorkload) -> TrainingJob:
    return TrainingJob(shape=w.model.shape(), seq_len=w.seq_len, global_batch_size=w.global_batch_size,
                       compute_dtype=w.precision.compute_dtype("tpu"), remat=w.remat)


def slice_fit(spec: FitSpec, accelerator: str, field: str = "accelerator", *, slices: int = 1) -> SliceFit:
    """The built-in trainer's memory on one slice type (`spec.workload` must be an `LmWorkload`), each of
    `slices` slices training its share of the batch."""
    w, t = spec.workload, catalog.lookup(accelerator)
    assert isinstance(w, LmWorkload), "the built-in trainer's memory is of the lm workload (callers check)"
    try:
        mesh = plan_slices(num_devices=t.chips, num_hosts=t.hosts, wishes=w.mesh.model_dump(), shape=w.model.shape(),
                           global_batch_size=w.global_batch_size, slices=slices)
    except MeshError as e:
        return SliceFit(accelerator, field, None, None, mesh_error=f"workload.{e.field}: {e}")
    asked = None if w.gradient_accumulation == "auto" else w.gradient_accumulation
    if asked is not None and mesh.rows_per_shard % asked:
        return SliceFit(accelerator, field, mesh, None)
    job = training_job(w)
    verdict = fit(job, mesh, t.hbm_bytes_per_chip, asked)
    tips = () if verdict.fits else tuple(advice(job, mesh, t.hbm_bytes_per_chip, asked))
    return SliceFit(accelerator, field, mesh, verdict, advice=tips)


def memory_problems(spec: FitSpec, *, check_hbm: bool = True) -> list[tuple[str, str]]:
    """(field, message) for each slice type the job may run on where it cannot run: the mesh does not
    divide it, the microbatch count does not divide its rows, or (`check_hbm`) training does not fit its
    HBM by the estimate."""
    problems = []
    for name, field in candidate_types(spec):
        f = slice_fit(spec, name, field)
        w = spec.workload
        if f.mesh is None:
            if field != "accelerator":  # the job's own type's mesh problem is reported on its own
                problems.append((field, f"{name}: {f.mesh_error}"))
        elif f.fit is None:
            problems.append(("workload.gradient_accumulation",
                             f"{w.gradient_accumulation} microbatches do not divide the {f.mesh.rows_per_shard} rows "
                             f"each batch shard gets on {name} (global_batch_size {w.global_batch_size} over "
                             f"data*fsdp={f.mesh.batch_shards}); use a divisor of {f.mesh.rows_per_shard} or 'auto'"))
        elif check_hbm and not f.fit.fits:
            problems.append((field, refusal(f)))
    return problems


def refusal(f: SliceFit) -> str:
    """One line: the figures per chip, what dominates, and what would fit."""
    assert f.fit is not None, "a refusal is of a fit that was worked out"
    e, v = f.fit.estimate, f.fit
    parts = ", ".join(f"{k} {b / GIB:.1f}" for k, b in e.parts.items() if b)
    return (f"{f.accelerator}: training needs {e.total / GIB:.1f} GiB per chip but {v.usable_bytes / GIB:.1f} GiB is "
            f"usable ({USABLE_FRACTION:.0%} of {v.hbm_bytes / GIB:.1f} GiB HBM), with {e.microbatches} "
            f"microbatch{'es' if e.microbatches != 1 else ''} of {e.tokens:,} tokens a chip; {e.dominant} "
            f"dominate (GiB: {parts}); alternatives: " + "; ".join(f.advice))


def microbatches_for(spec: FitSpec, accelerator: str, slices: int = 1) -> int:
    """How many microbatches a step is split into on `slices` x `accelerator` (``gradient_accumulation``
    resolved: the fewest that fit each slice's share of the batch)."""
    w = spec.workload
    if w.gradient_accumulation != "auto":
        return w.gradient_accumulation
    if w.type != "lm":  # a user's program splits its own batch
        return 1
    f = slice_fit(spec, accelerator, slices=slices)
    return f.microbatches or 1
