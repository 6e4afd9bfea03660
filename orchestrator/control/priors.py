"""The controller's compiled priors: the TPU compiler's reports of a job's step, kept from before, as the
cost policy's speed for the options the job has not measured (`policies.cost.compiled_prior`).

The reports are the ones `orchestrator plan/validate/submit --compile` kept in the state
directory (`programs_dir`), found by the same key (`workers.tpu_target.program_key`: the
settings the job's hosts would run with on that option, the target, the code and the
compiler). Nothing is compiled here: the controller asks the policy every decision interval,
and a compile takes minutes. An option without a kept report is priced by the scaling
model, as before; so is every option of a job that runs its own program (its key is not
known here). The key covers the code that builds the step (kernels, workers, policies/model):
after an edit there, the reports kept before are not found, and the scaling model prices the
job until `--compile` runs again.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from orchestrator import catalog
from orchestrator.domain.spec import JobSpec, LmWorkload
from policies.cost.compiled_prior import CompiledStep, Priced, priced
from policies.cost.slice_options import Option
from policies.model.sharding import MeshError
from workers.order import BuiltInTrainer

log = logging.getLogger(__name__)


def programs_dir() -> Path:
    """Where the CLI's `--compile` keeps the compiler's reports: the state directory's tpu-programs."""
    from orchestrator.cluster.home import Home

    return Home.default().tpu_programs


def kept_steps(spec: JobSpec, options: Sequence[Option], *,
               cache_dir: str | os.PathLike | None = None) -> dict[str, CompiledStep]:
    """The compiled step of each of `options` (by `Option.what`) whose report is kept in `cache_dir`
    (default `programs_dir()`); none for a job that runs its own program, or an empty folder."""
    cache = Path(cache_dir) if cache_dir is not None else programs_dir()
    w = spec.workload
    if not isinstance(w, LmWorkload) or not cache.is_dir() or not any(cache.glob("*.json")):
        return {}
    # The TPU compiler's side (jax) is imported only where reports are kept to be read.
    from orchestrator.control.launch import launch_order
    from orchestrator.control.tpu_compile import topology
    from workers.tpu_target import kept_report, program_key, roofline_s

    tokens_per_step = float(w.global_batch_size * w.seq_len)
    out: dict[str, CompiledStep] = {}
    for o in {o.what: o for o in options}.values():
        t = catalog.lookup(o.name)
        try:
            order = launch_order(spec.moved(t.name, spec.tier, slices=o.count), t.chips, t.hosts, slices=o.count)
        except MeshError:  # no mesh for the job on this option: nothing was compiled for it
            continue
        assert isinstance(order.program, BuiltInTrainer), "an LmWorkload runs the built-in trainer"
        # The key leaves out the checkpoint folder the store fills in (`JobSpec.with_checkpoint_directory`):
        # the CLI's --compile, which ran before the job had one, kept the report under this key.
        report = kept_report(cache, program_key(order.program.lm, order.settings, topology(t, o.count)))
        if report is not None:
            out[o.what] = CompiledStep(tokens_per_step, roofline_s(report, t.generation.chip))
    return out


def with_priors(spec: JobSpec, options: Sequence[Option], measured: Mapping[str, float], *,
                cache_dir: str | os.PathLike | None = None) -> Priced:
    """`options` priced for the policy: measured where the job ran (by `Option.what`), else the compiled
    prior where a report is kept, else as given (the scaling model)."""
    found = priced(options, kept_steps(spec, options, cache_dir=cache_dir), measured)
    if found.calibrations:
        log.debug("job %s: compiled priors for %s", spec.name,
                  ", ".join(f"{w} ({c.source}, {c.share:.2f} of the roofline)" for w, c in found.calibrations.items()))
    return found
