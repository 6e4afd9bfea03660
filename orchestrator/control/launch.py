"""What a job's workers run, derived from the parsed spec in one place (`workload_for`), and the
fence written before each launch (`orchestrator.control.group` launches them)."""

from __future__ import annotations

import logging

from orchestrator import catalog
from orchestrator.domain.fit import microbatches_for
from orchestrator.domain.spec import EntrypointWorkload, JobSpec, LmWorkload
from policies.model.sharding import plan_mesh
from workers.notices import GCE_METADATA_URL
from workers.train import TrainConfig

log = logging.getLogger(__name__)


def workload_for(spec: JobSpec, devices: int, hosts: int) -> dict:
    """What every host of a slice with `devices` chips on `hosts` hosts runs for `spec`."""
    w = spec.workload
    ckpt = spec.checkpoint.directory
    common = {"fence_dir": ckpt, "storage_endpoint": spec.storage.endpoint, "metadata_url": metadata_url(spec),
              "peak_flops_per_chip": spec.tpu_type.peak_bf16_flops_per_chip}  # for MFU
    if isinstance(w, EntrypointWorkload):
        return {"type": "entrypoint", "entrypoint": w.entrypoint, "args": w.args, "checkpoint_dir": ckpt,
                "workdir": spec.workdir, "training": training_settings(spec, devices, hosts), **common}
    assert isinstance(w, LmWorkload)
    return {"type": "lm", "config": train_config(spec, devices, hosts).to_dict(), **common}


def metadata_url(spec: JobSpec) -> str | None:
    """Where hosts long-poll for preemption and maintenance notices: the spec's, else on gcp
    the GCE metadata server (a TPU VM always has one), else none."""
    if spec.recovery.metadata_url:
        return spec.recovery.metadata_url
    return GCE_METADATA_URL if spec.provider == "gcp" else None


def training_settings(spec: JobSpec, devices: int, hosts: int) -> dict:
    """What a user program's `workers.api.Context` is told: its settings, resolved on this slice."""
    w = spec.workload
    assert isinstance(w, EntrypointWorkload)
    plan = plan_mesh(num_devices=devices, num_hosts=hosts, wishes=w.mesh.model_dump(), shape=None,
                     global_batch_size=w.global_batch_size or devices)
    return {"steps": w.steps, "seq_len": w.seq_len, "global_batch_size": w.global_batch_size, "seed": w.seed,
            "mesh_shape": list(plan.shape), "data": w.data.path if w.data else None,
            "checkpoint_interval": spec.checkpoint.interval_steps, "checkpoint_keep": spec.checkpoint.keep,
            "precision": w.precision.compute, "remat": w.remat,
            "microbatches": microbatches_for(spec, _slice_type(spec, devices).name),
            "kernel_blocks": w.kernel_blocks.model_dump(exclude_none=True) if w.kernel_blocks else None}


def train_config(spec: JobSpec, devices: int, hosts: int) -> TrainConfig:
    """The built-in trainer's config for `spec` on a slice of `devices` chips on `hosts` hosts."""
    w = spec.workload
    assert isinstance(w, LmWorkload), "the built-in trainer runs only the lm workload (`workload_for` checks)"
    shape = w.model.shape()
    plan = plan_mesh(num_devices=devices, num_hosts=hosts, wishes=w.mesh.model_dump(), shape=shape,
                     global_batch_size=w.global_batch_size)
    return TrainConfig(
        model=shape, seq_len=w.seq_len, global_batch_size=w.global_batch_size, steps=w.steps, seed=w.seed,
        lr_peak=w.learning_rate.peak, lr_end=w.learning_rate.end, warmup_steps=w.learning_rate.warmup_steps,
        weight_decay=w.learning_rate.weight_decay, mesh_shape=plan.shape, checkpoint_dir=spec.checkpoint.directory,
        checkpoint_interval=spec.checkpoint.interval_steps, checkpoint_keep=spec.checkpoint.keep,
        implementation=w.kernels, data=w.data.path if w.data else None, precision=w.precision.compute,
        remat=w.remat, microbatches=microbatches_for(spec, _slice_type(spec, devices).name),
        kernel_blocks=w.kernel_blocks.model_dump(exclude_none=True) if w.kernel_blocks else None)


def _slice_type(spec: JobSpec, devices: int) -> catalog.TpuType:
    """The type of the job's generation with `devices` chips (a resize or a move changes the size)."""
    t = spec.tpu_type
    return next((o for o in catalog.same_generation(t) if o.chips == devices), t)


def write_fence(spec: JobSpec, generation: int, owner: str | None = None) -> None:
    """Record the current generation, and whose folder it is (`owner`, the job id), beside the
    checkpoints before a group starts (`workers.storage.write_fence`: an atomic rename on disk, a
    generation precondition in a bucket).

    A worker checks it before every save, so workers of an older generation never write.
    Raises `workers.storage.FenceError` if the fence already holds this generation or a later
    one of the same job (another controller got there first).
    """
    from workers import storage

    directory = spec.checkpoint.directory
    assert directory is not None, "a submitted job's spec has its checkpoint directory (Controller.submit fills it)"
    storage.write_fence(directory, generation, owner, endpoint=spec.storage.endpoint)
