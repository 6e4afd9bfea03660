"""Spare workers: the next generation's worker process on each host, started while this one trains.

A launch's workers are new processes: each imports Ray, JAX and the trainer before it can join
the runtime, about 1.5 s of CPU a host, and after a lost slice that sits between the kill and
the next step. So once a generation has stepped, its group starts a spare on each of its hosts
for the next generation, named as that generation's worker on the same slice and host
(`worker_name`). The next launch on those slices (the survivors of a lost slice going on from
memory, a relaunch after a failure, a move back) takes the spares (`take`: each learns its rank)
and starts processes only where none waits.

A spare holds no Ray resources (the running generation's placement group holds the hosts) and,
like a worker before the runtime is up, only imports: it starts no backend, so the chips stay
the running worker's. A spare no launch takes ends with its slice (released, or its host lost);
one that does not answer is ended and a fresh worker started in its place.

Whether a job has spares: `recovery.spare_workers`, or its provider's default
(`ProviderFacts.spare_workers`: on for TPU VMs, off for local hosts, where a spare doubles this
machine's processes).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from orchestrator import cluster

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from orchestrator.domain.spec import JobSpec

log = logging.getLogger(__name__)

# How long a spare has to answer `take` before it is ended and replaced: one still starting (importing) is
# waited for, as it is ahead of a fresh process; one on a lost host fails at once.
TAKE_S = 60.0
FREED_S = 30.0  # how long an ended spare's name may take to be free for the fresh worker


def wanted(spec: JobSpec) -> bool:
    """Whether `spec`'s generations start spares for the next one."""
    chosen = spec.recovery.spare_workers
    return spec.provider_facts.spare_workers if chosen is None else chosen


def take(names: list[str], num_hosts: int, controller: Any) -> list[ActorHandle | None]:
    """The spare waiting under each of `names` (rank order), now rank i of `num_hosts`, reporting to
    `controller`; None where none waits or it did not answer (ended, its name freed for a fresh worker)."""
    found = {rank: w for rank, name in enumerate(names) if (w := _named(name)) is not None}
    asked: dict[int, Any] = {rank: w.take.remote(rank, num_hosts, controller) for rank, w in found.items()}
    taken: list[ActorHandle | None] = [None] * len(names)
    deadline = time.monotonic() + TAKE_S
    for rank, ref in asked.items():
        try:
            ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
            taken[rank] = found[rank]
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as e:
            log.info("spare %s did not answer (%s): a fresh worker starts in its place", names[rank], e)
            _end(found[rank], names[rank])
    return taken


def start(worker_class: Any, runtime_env: dict | None, where: list[tuple[str, str, dict]]) -> None:
    """Start a spare for each (Ray node id, worker name, `HostWorker` kwargs but the rank) of `where`; one whose
    name is taken (a spare made before a controller restart) is left as it is."""
    for node, name, worker_args in where:
        try:
            worker_class.options(
                num_cpus=0, max_concurrency=8, runtime_env=runtime_env, name=name, namespace=cluster.NAMESPACE,
                lifetime="detached", scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
            ).remote(rank=None, **worker_args)
        except ValueError:  # the name is taken: a spare waits there already
            log.debug("a spare %s waits already", name)


def _named(name: str) -> ActorHandle | None:
    try:
        return ray.get_actor(name, namespace=cluster.NAMESPACE)
    except ValueError:
        return None


def _end(worker: ActorHandle, name: str) -> None:
    try:
        ray.kill(worker, no_restart=True)
    except Exception as e:  # noqa: BLE001 -- gone with its host already
        log.debug("spare %s already gone: %s", name, e)
    deadline = time.monotonic() + FREED_S
    while _named(name) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
