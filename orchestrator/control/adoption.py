"""After a controller restart: adopt each job's running worker group, or clean up for a relaunch.

Workers and their placement group are detached, so when the controller dies the job
trains on; the new controller finds the group by name (slice, generation, rank) from the
store's records instead of starting a second one. Whatever cannot be adopted is stopped,
and its slices released, before the job's driver relaunches it. A job may hold two
slices (a move's new slice requested beside the running one): the one its generation
runs on is adopted, the other released (a request never filled was never billed).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol

import ray
import tenacity

from orchestrator import catalog, cluster
from orchestrator.control.group import kill_workers, pg_name, worker_name
from orchestrator.control.launched import Launch
from orchestrator.domain.provider_facts import facts
from orchestrator.domain.shape import Shape
from orchestrator.domain.spec import JobSpec
from orchestrator.providers.base import Host, Slice, SliceProvider
from orchestrator.providers.local import LocalProvider
from orchestrator.state.events import EventKind
from orchestrator.state.states import JobState, SliceState
from orchestrator.state.store import JobRecord, SliceRow, Store

log = logging.getLogger(__name__)


class Reconciling(Protocol):
    """What adoption needs of the controller that restarted."""

    @property
    def store(self) -> Store: ...

    @property
    def provider(self) -> LocalProvider: ...  # this machine's hosts

    def provider_for(self, spec: JobSpec) -> SliceProvider: ...

    def release_record(self, rec: SliceRow) -> None: ...


@dataclass(frozen=True)
class Adoption:
    """A running generation a restarted controller found: what it was launched with, its workers."""

    launch: Launch
    provider: SliceProvider
    workers: list[Any]  # its `HostWorker` actors, rank order
    pg: Any  # their placement group
    last_step: int  # the newest step its worker 0 did


def adopt(plane: Reconciling, job: JobRecord, slices: list[SliceRow]) -> tuple[Adoption | None, list[dict]]:
    """The job's running group as an `Adoption` (with its worker 0's step history), or None
    after stopping whatever is left of it; and the history to record (empty if none)."""
    workers, pg = [], None
    if job.spec.slices > 1:  # not adopted: relaunched from storage (its workers span slices a restart cannot rejoin)
        log.warning("job %s: a multi-slice job's workers are not adopted after a controller restart; relaunching",
                    job.id)
        for rec in slices:
            t = catalog.lookup(rec.accelerator)
            kill_workers([w for i in range(t.hosts) if (w := _actor(worker_name(rec.name, job.generation, i)))],
                         _placement_group(pg_name(rec.name, job.generation)))
            plane.release_record(rec)
        return None, []
    running, beside = running_slice(plane.store, job, slices)
    for rec in beside:  # a request waiting beside it (make-before-break): given back; the policy asks again
        plane.release_record(rec)
    if job.state in (JobState.STARTING, JobState.RUNNING) and running is not None:
        rec = running
        t = catalog.lookup(rec.accelerator)
        try:
            workers = [ray.get_actor(worker_name(rec.name, job.generation, i), namespace=cluster.NAMESPACE)
                       for i in range(t.hosts)]
            pg = ray.util.get_placement_group(pg_name(rec.name, job.generation))
            # Right after a restart Ray may answer "temporarily unavailable" while it resolves the actors.
            probe = tenacity.Retrying(
                stop=tenacity.stop_after_delay(30), wait=tenacity.wait_fixed(1), reraise=True,
                retry=tenacity.retry_if_exception_type(ray.exceptions.ActorUnavailableError))
            probe(lambda: ray.get([w.info.remote() for w in workers], timeout=30))
            history: list[dict] = probe(lambda: ray.get(workers[0].history.remote(), timeout=30))
        except Exception as e:  # noqa: BLE001 -- any part gone, however it fails, means relaunch (logged)
            log.warning("job %s: cannot adopt generation %d (%s)", job.id, job.generation, e)
        else:
            provider = _take_over(plane, job, rec, t)
            s = provider.get(rec.name)
            launch = Launch(job.generation, (s,), Shape(s.tpu_type.name, s.tier.value, 1))
            return Adoption(launch, provider, workers, pg, max((h["step"] for h in history), default=-1)), history
    kill_workers(workers, pg)
    if running is not None:
        plane.release_record(running)
    return None, []


def _actor(name: str):
    try:
        return ray.get_actor(name, namespace=cluster.NAMESPACE)
    except ValueError:  # none by that name
        return None


def _placement_group(name: str):
    try:
        return ray.util.get_placement_group(name)
    except ValueError:  # none by that name (only the first slice's name names the group)
        return None


def _take_over(plane: Reconciling, job: JobRecord, rec: SliceRow, t: catalog.TpuType):
    """Make the slice's provider follow it again; on gcp, also give back what else carries the job's
    label in the cloud (a request an earlier controller made and the store never heard of)."""
    hosts = tuple(Host(i, r) for i, r in enumerate(rec.data["hosts"]))
    s = Slice(rec.name, job.id, t, catalog.Tier(rec.tier), rec.data.get("zone"), SliceState.READY, hosts,
              rec.provider)
    if not facts(rec.provider).owns_cloud_resources:  # hosts on this machine: follow their process groups
        plane.provider.adopt(s, rec.data["pgids"])
        return plane.provider
    from orchestrator.providers.gcp import GcpTpuProvider

    spec = job.spec
    provider = plane.provider_for(spec)
    assert isinstance(provider, GcpTpuProvider) and spec.gcp is not None, "a slice in a cloud is on gcp"
    provider.adopt(s, rec.data.get("zone") or spec.gcp.zones[0])
    for found in provider.list(job_id=job.id):
        if found.name != s.name:
            log.info("job %s: releasing slice %s, found in the cloud beside the one its workers run on",
                     job.id, found.name)
            provider.release(found.name)
    return provider


def running_slice(store, job: JobRecord, slices: list[SliceRow]) -> tuple[SliceRow | None, list[SliceRow]]:
    """Of a job's live slices, the one its current generation was launched on (None if none
    is), and the others: a move's request waiting beside it, or a slice READY for a switch not
    made. A job holds two slices while a move is made before break."""
    launched = [e.payload.slice for e in store.events(job.id, kind=EventKind.LAUNCHED)
                if e.payload.generation == job.generation]
    name = launched[-1] if launched else None
    running = next((r for r in slices if r.name == name), None)
    return running, [r for r in slices if r is not running]
