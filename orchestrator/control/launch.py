"""What a job's workers run, derived from the parsed spec in one place (`workload_for`), and the
fence written before each launch (`orchestrator.control.group` launches them)."""

from __future__ import annotations

import logging

from orchestrator import catalog
from orchestrator.domain.fit import microbatches_for
from orchestrator.domain.spec import EntrypointWorkload, JobSpec, LmWorkload
from policies.model.sharding import MeshError, plan_slices
from workers.settings import LmSettings, TrainingSettings

log = logging.getLogger(__name__)


def workload_for(spec: JobSpec, devices: int, hosts: int, *, slices: int = 1, memory_step: int | None = None) -> dict:
    """What every host of `slices` slices, each with `devices` chips on `hosts` hosts, runs for `spec`;
    `memory_step`: the step the survivors of a lost slice restore from their memory."""
    w = spec.workload
    settings = training_settings(spec, devices, hosts, slices=slices, memory_step=memory_step)
    common = {"settings": settings, "fence_dir": spec.checkpoint.directory,
              "storage_endpoint": spec.storage.endpoint, "metadata_url": metadata_url(spec)}
    if isinstance(w, EntrypointWorkload):
        return {"type": "entrypoint", "entrypoint": w.entrypoint, "args": w.args, "workdir": spec.workdir, **common}
    return {"type": "lm", "lm": lm_settings(w), "ahead": survivors_settings(spec, devices, hosts, slices), **common}


def survivors_settings(spec: JobSpec, devices: int, hosts: int, slices: int) -> TrainingSettings | None:
    """The settings of the runtime a lost slice of `slices` leaves, whose program is compiled while the
    job trains (`workers.ahead`); None for one slice, or a global batch that does not split over one fewer."""
    if slices < 2:
        return None
    try:
        return training_settings(spec, devices, hosts, slices=slices - 1)
    except MeshError:
        return None


def metadata_url(spec: JobSpec) -> str | None:
    """Where hosts long-poll for preemption and maintenance notices: the spec's, else its provider's
    (on gcp the GCE metadata server: a TPU VM always has one), else none."""
    if spec.recovery.metadata_url:
        return spec.recovery.metadata_url
    return spec.provider_facts.metadata_url


def training_settings(spec: JobSpec, devices: int, hosts: int, *, slices: int = 1,
                      memory_step: int | None = None) -> TrainingSettings:
    """The settings every host's program gets (`workers.api.Context.settings`), resolved for `spec`
    on `slices` slices of `devices` chips on `hosts` hosts each.

    The mesh is planned for one slice and its batch share; several slices multiply its ``data``
    axis, slice-major (the layout `mesh_utils.create_hybrid_device_mesh` gives TPU slices over
    DCN): parameters are sharded only inside a slice, so each slice holds a whole copy.
    """
    w = spec.workload
    shape = w.model.shape() if isinstance(w, LmWorkload) else None
    plan = plan_slices(num_devices=devices, num_hosts=hosts, wishes=w.mesh.model_dump(), shape=shape,
                       global_batch_size=w.global_batch_size, slices=slices)
    data, fsdp, model = plan.shape
    slice_type = _slice_type(spec, devices)
    return TrainingSettings(
        steps=w.steps, seq_len=w.seq_len, global_batch_size=w.global_batch_size, seed=w.seed,
        mesh_shape=(data * slices, fsdp, model), slices=slices, memory_step=memory_step,
        memory_interval=None if (every := spec.checkpoint.memory_interval_steps) == "auto" else every,
        data=w.data.path if w.data else None, checkpoint_dir=spec.checkpoint.directory,
        checkpoint_interval=spec.checkpoint.interval_steps, checkpoint_keep=spec.checkpoint.keep,
        precision=w.precision.compute, remat=w.remat, microbatches=microbatches_for(spec, slice_type.name, slices),
        kernel_blocks=w.kernel_blocks.model_dump(exclude_none=True) if w.kernel_blocks else None,
        peak_flops_per_chip=slice_type.peak_bf16_flops_per_chip)


def lm_settings(w: LmWorkload) -> LmSettings:
    """What the built-in trainer adds to the training settings: its model, schedule and kernels."""
    lr = w.learning_rate
    return LmSettings(model=w.model.shape(), lr_peak=lr.peak, lr_end=lr.end, warmup_steps=lr.warmup_steps,
                      weight_decay=lr.weight_decay, implementation=w.kernels)


def _slice_type(spec: JobSpec, devices: int) -> catalog.TpuType:
    """The type of the job's generation with `devices` chips (a resize or a move changes the size)."""
    t = spec.tpu_type
    return next((o for o in catalog.same_generation(t) if o.chips == devices), t)


def write_fence(spec: JobSpec, generation: int, owner: str | None = None) -> None:
    """Record the current generation, and whose folder it is (`owner`, the job id), beside the
    checkpoints before a group starts (`workers.fence.write_fence`: an atomic rename on disk, a
    generation precondition in a bucket).

    A worker checks it before every save, so workers of an older generation never write.
    Raises `workers.fence.FenceError` if the fence already holds this generation or a later
    one of the same job (another controller got there first).
    """
    from workers import fence as fences

    directory = spec.checkpoint.directory
    assert directory is not None, "a submitted job's spec has its checkpoint directory (Controller.submit fills it)"
    fences.write_fence(directory, generation, owner, endpoint=spec.storage.endpoint)
