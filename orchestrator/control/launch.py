"""What a job's workers run, resolved from the placed spec in one place, and the fence written before each launch.

`launch_plan` resolves a generation's plan once, when it is launched (`JobDriver.new_launch`): the
shape it runs on and the `workers.order.LaunchOrder` every host of it is handed
(`orchestrator.control.group` launches them). The plan is recorded as a `Planned` event, which
`orchestrator status` shows, so what the status says is what the workers were told.
`launch_order` resolves the order alone, for a shape that is not launched (a compile ahead, a
prior, a test's reference run).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from orchestrator import catalog
from orchestrator.domain.fit import microbatches_for
from orchestrator.domain.shape import Shape
from orchestrator.domain.spec import EntrypointWorkload, JobSpec, LmWorkload
from orchestrator.state.events import Planned
from policies.model.sharding import MeshError, plan_slices
from workers.order import BuiltInTrainer, LaunchOrder, Program, UserEntrypoint
from workers.settings import LmSettings, TrainingSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LaunchPlan:
    """One generation's launch, resolved once from its placed spec: where it runs and what every host runs."""

    generation: int
    shape: Shape  # the type, tier and count of the slices it runs on
    order: LaunchOrder  # what every host is handed: the settings (mesh, microbatches, intervals) and the program

    @property
    def planned(self) -> Planned:
        """The plan as the store records it (and `orchestrator status` shows it)."""
        settings, program = self.order.settings, self.order.program
        return Planned(generation=self.generation, accelerator=self.shape.accelerator, tier=self.shape.tier,
                       slices=self.shape.count, mesh=list(settings.mesh_shape) if settings.mesh_shape else None,
                       microbatches=settings.microbatches,
                       checkpoint_interval=settings.checkpoint_interval if settings.checkpoint_dir else None,
                       memory_interval=settings.memory_interval if self.shape.count > 1 else None,
                       memory_step=settings.memory_step,
                       entrypoint=program.entrypoint if isinstance(program, UserEntrypoint) else None)


def launch_plan(spec: JobSpec, generation: int, slices: int, *, memory_step: int | None = None) -> LaunchPlan:
    """Generation `generation` of `spec` (placed on its slices' type and tier) on `slices` slices;
    `memory_step`: the step the survivors of a lost slice restore from their memory."""
    t = spec.tpu_type
    order = launch_order(spec, t.chips, t.hosts, slices=slices, memory_step=memory_step)
    return LaunchPlan(generation, Shape(spec.accelerator, spec.tier.value, slices), order)


def launch_order(spec: JobSpec, devices: int, hosts: int, *, slices: int = 1,
                 memory_step: int | None = None) -> LaunchOrder:
    """What every host of `slices` slices, each with `devices` chips on `hosts` hosts, runs for `spec`;
    `memory_step`: the step the survivors of a lost slice restore from their memory."""
    return LaunchOrder(settings=training_settings(spec, devices, hosts, slices=slices, memory_step=memory_step),
                       program=program(spec, devices, hosts, slices), fence_dir=spec.checkpoint.directory,
                       storage_endpoint=spec.storage.endpoint, metadata_url=metadata_url(spec))


def program(spec: JobSpec, devices: int, hosts: int, slices: int) -> Program:
    """The program the hosts run: a user's entrypoint, from the job's folder, or the built-in trainer."""
    w = spec.workload
    if isinstance(w, EntrypointWorkload):
        return UserEntrypoint(w.entrypoint, dict(w.args), spec.workdir)
    return BuiltInTrainer(lm_settings(w), survivors_settings(spec, devices, hosts, slices))


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
