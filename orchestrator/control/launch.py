"""Gang launch of a job's workers on a ready slice, and their teardown.

One `HostWorker` per host, all or none (a placement group with one bundle per host);
host 0 brings up the JAX runtime's coordinator and the others join once it listens.
Workers are detached actors named by slice, generation and rank, so a restarted
controller finds them (`orchestrator.control.adoption`). What the workers run derives
from the parsed spec in one place, `workload_for`.
"""

from __future__ import annotations

import logging
import secrets
import time

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from orchestrator import catalog, cluster
from orchestrator.control import shipping
from orchestrator.control.attempt import Attempt, pg_name, worker_name
from orchestrator.domain.fit import microbatches_for
from orchestrator.domain.spec import EntrypointWorkload, JobSpec, LmWorkload
from orchestrator.state.events import Launched
from orchestrator.state.store import Store
from policies.decisions.recovery import Outcome, OutcomeKind
from policies.model.sharding import plan_mesh
from workers import inbox
from workers.host import HostWorker
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


def launch(store: Store, home: cluster.Home, job_id: str, spec: JobSpec, att: Attempt) -> Outcome | None:
    """Start generation `att.generation` on `att.slice`; an outcome only if its workers could not all be placed."""
    s = att.held_slice
    t = s.tpu_type
    timeout = spec.recovery.start_timeout_s
    bundles = [{"TPU": float(t.chips_per_host), h.resource: 1.0} for h in s.hosts]
    att.pg = placement_group(bundles, strategy="STRICT_SPREAD", name=pg_name(s.name, att.generation),
                             lifetime="detached")
    try:
        ray.get(att.pg.ready(), timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        return Outcome(OutcomeKind.PROVISION_FAILED,
                       f"the {t.hosts} workers of slice {s.name} could not all be placed within {timeout:.0f} s "
                       f"(each needs {t.chips_per_host} TPU chips on its own host)", transient=True)
    code = shipping.kept(home.job_dir(job_id))
    env = shipping.runtime_env(code, ship_project=spec.provider != "local")  # what the hosts cannot have
    actor = ray.remote(HostWorker)
    att.workers = [
        actor.options(  # type: ignore[misc]  # ray types .remote() of an actor class as the handle or the class
            num_cpus=0, resources={"TPU": float(t.chips_per_host)}, max_concurrency=8, runtime_env=env,
                      scheduling_strategy=PlacementGroupSchedulingStrategy(att.pg, placement_group_bundle_index=i),
                      name=worker_name(s.name, att.generation, i), namespace=cluster.NAMESPACE, lifetime="detached")
        .remote(job_id=job_id, generation=att.generation, rank=i, num_hosts=t.hosts,
                devices_per_host=t.chips_per_host, platform="cpu", compile_cache_dir=str(home.compile_cache),
                controller=_report_to(spec), workload_type=spec.workload.type)
        for i in range(t.hosts)
    ]
    placed: list[dict] = ray.get([w.info.remote() for w in att.workers], timeout=timeout)
    store.add_event(job_id, Launched(s.name, [p["node_id"] for p in placed], [p["pid"] for p in placed],
                                     att.generation),
                    f"{t.hosts} workers of generation {att.generation} on slice {s.name}")
    coordinator: str | None = None
    if t.hosts > 1:
        # Ray types an actor handle's methods as Never.
        coordinator = ray.get(att.workers[0].coordinator_address.remote(), timeout=120)  # type: ignore[assignment]
    workload = workload_for(spec, t.chips, t.hosts)
    if code is not None:
        workload["workdir"] = None  # the shipped copy (the runtime environment's working_dir), not the folder
    share_key = secrets.token_bytes(32)  # seals what hosts hand each other through the coordinator
    ray.get(att.workers[0].start.remote(coordinator, workload, share_key), timeout=120)
    if coordinator is not None:  # the others join once host 0 listens (an early one waits out a backoff)
        ray.get(att.workers[0].coordinator_listening.remote(coordinator, 10.0), timeout=30)
    ray.get([w.start.remote(coordinator, workload, share_key) for w in att.workers[1:]], timeout=120)
    att.last_progress = time.monotonic()
    return None


def _report_to(spec: JobSpec):
    """Where the workers send their reports. A TPU VM has only the shipped packages and cannot load the
    controller's class, so its hosts report to the controller's inbox (`workers.inbox`); a local host
    shares this machine's installation and reports to the controller directly, by name."""
    if spec.provider == "local":
        return (cluster.CONTROLLER_NAME, cluster.NAMESPACE)
    return inbox.start(cluster.NAMESPACE, cluster.CONTROLLER_NAME, ray.get_runtime_context().get_node_id())


def teardown(att: Attempt) -> None:
    """Kill the attempt's workers, remove its placement group, release its slice (each idempotent)."""
    att.accepting = False  # a dying group's last words must not land after its disruption
    kill_workers(att.workers, att.pg)
    att.workers, att.pg = [], None
    if att.slice is not None:
        att.chosen_provider.release(att.slice.name)
        att.slice = None


def kill_workers(workers: list, pg) -> None:
    for w in workers:
        try:
            ray.kill(w, no_restart=True)
        except Exception:  # already gone with its host
            pass
    if pg is not None:
        try:
            remove_placement_group(pg)
        except Exception:
            pass


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
