"""After a controller restart: adopt each job's running worker group, or clean up for a relaunch.

Workers and their placement group are detached, so when the controller dies the job
trains on; the new controller finds the group by name (slice, generation, rank) from the
store's records instead of starting a second one. Whatever cannot be adopted is stopped,
and its slices released, before the job's driver relaunches it. A job may hold more
slices than it runs on (a move's new slice requested beside the running ones): those its
generation runs on (every slice of a multi-slice job, in launch order) are adopted, the
others released (a request never filled was never billed). The hosts' keepers are named
actors too: the adopted group finds them by name when a slice is lost later, or at once: a slice
whose host went while no controller ran is adopted as lost, and the others go on from memory.

`reconcile` is the whole pass a restarted controller makes over its store. Where the groups are found is
a `GroupFinder`: Ray's named actors (`RAY_GROUPS`) in the controller; the fleet benchmark's scripted
groups, which live outside the controller's process, in `benchmarks/fleet_world.py`. A gcp job's other
slices in the cloud are found from one listing of each provider for the whole pass, not one per job.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import ray

from orchestrator import catalog, cluster
from orchestrator.control.generation import kill_workers, pg_name, where_placed, worker_name
from orchestrator.control.launched import Launch
from orchestrator.domain.provider_facts import facts
from orchestrator.domain.shape import Shape
from orchestrator.domain.spec import JobSpec
from orchestrator.providers.base import Host, Slice, SliceProvider
from orchestrator.providers.local import LocalProvider
from orchestrator.state.events import Adopted, EventKind
from orchestrator.state.states import JobState, SliceState
from orchestrator.state.store import JobRecord, SliceRow, Store

log = logging.getLogger(__name__)

ANSWER_S = 30.0  # how long the workers have to answer after a restart (Ray may call them unavailable meanwhile)
SETTLE_S = 5.0  # how long the rest have once a whole slice answered
FIND_AT_ONCE = 32  # groups looked for at once after a restart: one that does not answer holds up only itself


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
    workers: list[Any]  # its `HostWorker` actors, rank order (None: one whose host went meanwhile)
    pg: Any  # their placement group
    last_step: int  # the newest step its worker 0 did
    group: Any = None  # a `GroupFinder`'s own group (a scripted one), for a driver that takes it as it is


@dataclass(frozen=True)
class Found:
    """A generation's group as a `GroupFinder` found it answering, with its first worker's step history."""

    workers: list[Any]
    pg: Any
    history: list[dict]
    group: Any = None  # see `Adoption.group`


class GroupFinder(Protocol):
    """Where a restarted controller finds a job's running group, and stops what is left of one it cannot adopt."""

    def find(self, store: Store, job: JobRecord, running: list[SliceRow]) -> Found:
        """The group of `job.generation` on `running`, every part answering; raises if it cannot be adopted."""
        ...

    def discard(self, job: JobRecord, running: list[SliceRow]) -> None:
        """Stop whatever is left of the generation's group on `running`."""
        ...


class RayGroups:
    """The groups of Ray's named, detached `HostWorker` actors (the controller's)."""

    def find(self, store: Store, job: JobRecord, running: list[SliceRow]) -> Found:
        workers, pg, history = _find_group(store, job, running)
        return Found(workers, pg, history)

    def discard(self, job: JobRecord, running: list[SliceRow]) -> None:
        for rec in running:
            t = catalog.lookup(rec.accelerator)
            kill_workers([w for i in range(t.hosts) if (w := _actor(worker_name(rec.name, job.generation, i)))],
                         _placement_group(pg_name(rec.name, job.generation)))


RAY_GROUPS = RayGroups()


class CloudListing:
    """What each cloud provider holds, listed once for a whole reconcile (a listing per job was N listings of
    every slice: quadratic in the jobs), by job. A provider that cannot be listed holds nothing here."""

    def __init__(self) -> None:
        self._by_provider: dict[int, dict[str, list[Slice]]] = {}

    def of(self, provider: SliceProvider, job_id: str) -> list[Slice]:
        """The provider's slices that carry `job_id` (as it is, or as a label value), as `provider.list(job_id=...)`."""
        from orchestrator.providers.gcp.gc import label_value

        if id(provider) not in self._by_provider:
            by_job: dict[str, list[Slice]] = {}
            try:
                for s in provider.list():
                    by_job.setdefault(s.job_id, []).append(s)
            except Exception:  # noqa: BLE001 -- a cloud out of reach must not stop the restart: said once
                log.exception("could not list the slices of provider %s; what it holds beside the jobs' slices is "
                              "left to `orchestrator gc`", provider.name)
            self._by_provider[id(provider)] = by_job
        by_job = self._by_provider[id(provider)]
        return [s for key in dict.fromkeys((job_id, label_value(job_id))) for s in by_job.get(key, [])]


def reconcile(plane: Reconciling, new_driver: Callable[[str, Adoption | None], Any], start: Callable[[Any], None],
              lost_with_the_cluster: Callable[[Any, int], None], *, groups: GroupFinder = RAY_GROUPS) -> None:
    """After a restart: adopt each job's running worker group, or clean up and relaunch; `new_driver(job_id,
    adoption)` makes a job's driver (it takes the job's reports from then on), `start(driver)` runs it;
    `lost_with_the_cluster(driver, generation)` records a running job none of whose workers was found
    (`orchestrator.control.job.loop`, above this module). Slices of jobs that are over are released.

    Every driver starts once the pass is over, in the pass's order. Started as the pass went, at N=1,000
    (`benchmarks/fleet.py --kill-controller`) the drivers already running competed with the pass for the
    process's one core (the GIL): its first 100 jobs took 5.6 s and the last was adopted 209 s after the
    restart. Started after it, the last was adopted 38.8 s after the restart. (An earlier try of that order
    seemed to stall after the pass; the likely cause, the emulator's listen backlog of 5 dropping the
    drivers' connections, was fixed before this one was measured.) What the workers report meanwhile is
    recorded all the same: a driver takes reports from when it is made, not when it starts. The running
    groups are looked for many at once from the start of the pass (`_find_all`), each job's taken in order.
    A relaunched job does not give back what the cloud still holds for a slice the store calls GONE.
    """
    live: dict[str, list[SliceRow]] = {}
    for rec in plane.store.slices(live_only=True):
        live.setdefault(rec.job_id, []).append(rec)
    jobs = plane.store.jobs(active_only=True)
    finding = _find_all(plane.store, jobs, live, groups)
    cloud, drivers = CloudListing(), []
    for job in jobs:
        adoption, history = adopt(plane, job, live.pop(job.id, []), groups=groups, cloud=cloud,
                                  finding=finding.get(job.id))
        driver = new_driver(job.id, adoption)
        if adoption is not None:
            missed = driver.progress.record_missed(job.generation, history)
            plane.store.add_event(job.id, Adopted(), f"the controller restarted and adopted the running "
                                  f"generation {job.generation} ({missed} missed steps recorded)")
        elif job.state in (JobState.STARTING, JobState.RUNNING):  # its workers went with the cluster
            lost_with_the_cluster(driver, job.generation)
        elif job.state not in (JobState.PENDING, JobState.QUEUED, JobState.RECOVERING):
            driver.transition(JobState.RECOVERING, "the controller restarted; relaunching")
        drivers.append(driver)
    for driver in drivers:
        start(driver)
    for recs in live.values():  # slices of jobs that are over
        for rec in recs:
            plane.release_record(rec)


@dataclass(frozen=True)
class Finding:
    """A running job's slices as `running_slices` split them, and its group as it is being looked for."""

    slices: tuple[list[SliceRow], list[SliceRow], bool]
    group: Future[Found]


def _find_all(store: Store, jobs: list[JobRecord], live: dict[str, list[SliceRow]],
              groups: GroupFinder) -> dict[str, Finding]:
    """Each running job's group, looked for `FIND_AT_ONCE` at a time while the pass goes on (by job).

    A group that does not answer keeps its finder waiting up to `ANSWER_S`. Looked for one job after
    another, each such group held up every job after it in the pass, and since every driver starts once
    the pass is over, every job: ten frozen groups could keep every driver from running for five minutes.
    """
    pool = ThreadPoolExecutor(FIND_AT_ONCE, thread_name_prefix="adoption-find")
    finding = {}
    for job in jobs:
        if job.state not in (JobState.STARTING, JobState.RUNNING):
            continue
        running, beside, whole = running_slices(store, job, live.get(job.id, []))
        if whole:
            finding[job.id] = Finding((running, beside, whole), pool.submit(groups.find, store, job, running))
    pool.shutdown(wait=False)  # its threads end once the last group is found
    return finding


def adopt(plane: Reconciling, job: JobRecord, slices: list[SliceRow], *, groups: GroupFinder = RAY_GROUPS,
          cloud: CloudListing | None = None,
          finding: Finding | None = None) -> tuple[Adoption | None, list[dict]]:
    """The job's running group as an `Adoption` (with its worker 0's step history), or None
    after stopping whatever is left of it; and the history to record (empty if none). `finding`: the
    job's slices as `_find_all` split them and its group as it is looking for it (None: both done here)."""
    running, beside, whole = finding.slices if finding is not None else running_slices(plane.store, job, slices)
    for rec in beside:  # a request waiting beside them (make-before-break): given back; the policy asks again
        plane.release_record(rec)
    if job.state in (JobState.STARTING, JobState.RUNNING) and whole:
        try:
            found = finding.group.result() if finding is not None else groups.find(plane.store, job, running)
        except Exception as e:  # noqa: BLE001 -- any part gone, however it fails, means relaunch (logged)
            log.warning("job %s: cannot adopt generation %d on %d slice(s) (%s)", job.id, job.generation,
                        len(running), e)
        else:
            keep = {rec.name for rec in running}
            cloud = cloud or CloudListing()
            taken = [_take_over(plane, job, rec, catalog.lookup(rec.accelerator), keep=keep, cloud=cloud)
                     for rec in running]
            provider = taken[0]
            held = tuple(p.get(rec.name) for p, rec in zip(taken, running, strict=True))
            first = held[0]
            launch = Launch(job.generation, held, Shape(first.tpu_type.name, first.tier.value, len(held)))
            last_step = max((h["step"] for h in found.history), default=-1)
            return Adoption(launch, provider, found.workers, found.pg, last_step, found.group), found.history
    groups.discard(job, running)  # whatever is left of the group: stopped, its slices released
    for rec in running:
        plane.release_record(rec)
    return None, []


def _find_group(store: Store, job: JobRecord, running: list[SliceRow]) -> tuple[list[Any], Any, list[dict]]:
    """The generation's workers on `running` (rank order: slice-major), its placement group (named after
    the first slice) and the step history of its first worker that answers. A worker that answers no
    call (its host went while no controller ran) is None, and ended: the group is adopted without it only
    where several slices run, another slice answers whole and the launch record names every host (the
    adopted group then finds the host lost at once, and the others go on from memory); else this raises."""
    ranks = [(rec.name, i) for rec in running for i in range(catalog.lookup(rec.accelerator).hosts)]
    workers = [_actor(worker_name(name, job.generation, i)) for name, i in ranks]
    pg = ray.util.get_placement_group(pg_name(running[0].name, job.generation))
    answered = _answering(workers, [name for name, _ in ranks])
    if not answered:
        raise RuntimeError(f"none of the {len(workers)} workers answered")
    if len(answered) < len(workers):
        broken = {ranks[r][0] for r in range(len(workers)) if r not in answered}
        if len(running) < 2 or len(broken) == len(running) or \
                len(where_placed(store, job.id, job.generation)) != len(workers):
            raise RuntimeError(f"{len(workers) - len(answered)} of {len(workers)} workers answered no call")
        gone = [r for r in range(len(workers)) if r not in answered]
        log.warning("job %s: host(s) %s of generation %d answered no call (gone while no controller ran); "
                    "adopting the others", job.id, gone, job.generation)
        kill_workers([workers[r] for r in gone], None)
        workers = [w if r in answered else None for r, w in enumerate(workers)]
    history: list[dict] = ray.get(workers[min(answered)].history.remote(), timeout=30)
    return workers, pg, history


def _answering(workers: list[Any], slice_of: list[str]) -> set[int]:
    """The ranks whose worker answers a call, waiting up to ANSWER_S for every one, or SETTLE_S once every
    host of some slice answered (the others' hosts may be gone: a frozen one never answers)."""
    deadline = time.monotonic() + ANSWER_S
    calls = {w.info.remote(): r for r, w in enumerate(workers) if w is not None}
    answered: set[int] = set()
    while calls and time.monotonic() < deadline:
        ready, _ = ray.wait(list(calls), num_returns=1, timeout=0.2)
        for ref in ready:
            r = calls.pop(ref)
            try:
                ray.get(ref)
                answered.add(r)
            except ray.exceptions.ActorUnavailableError:  # right after a restart Ray may say so of any: ask again
                time.sleep(0.2)
                calls[workers[r].info.remote()] = r
            except ray.exceptions.RayActorError:  # dead
                pass
        whole = [n for n in set(slice_of) if all(r in answered for r, s in enumerate(slice_of) if s == n)]
        if whole and deadline - time.monotonic() > SETTLE_S:
            deadline = time.monotonic() + SETTLE_S
    return answered


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


def _take_over(plane: Reconciling, job: JobRecord, rec: SliceRow, t: catalog.TpuType, *, keep: set[str],
               cloud: CloudListing):
    """Make the slice's provider follow it again; on gcp, also give back what else carries the job's
    label in the cloud (a request an earlier controller made and the store never heard of) and is not
    one of the slices adopted (`keep`), as the pass's listing (`cloud`) found it."""
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
    for found in cloud.of(provider, job.id):
        if found.name not in keep:
            log.info("job %s: releasing slice %s, found in the cloud beside the one its workers run on",
                     job.id, found.name)
            provider.release(found.name)
    return provider


def running_slices(store, job: JobRecord, slices: list[SliceRow]) -> tuple[list[SliceRow], list[SliceRow], bool]:
    """Of a job's live slices, those its current generation was launched on, in launch order; the
    others (a move's request waiting beside them, or a slice READY for a switch not made); and whether
    the first are all the generation was launched on (not if a slice of it is gone)."""
    launched = [e.payload for e in store.events(job.id, kind=EventKind.LAUNCHED)
                if e.payload.generation == job.generation]
    names = [n for n in (launched[-1].slice_names or [launched[-1].slice]) if n] if launched else []
    by_name = {r.name: r for r in slices}
    running = [by_name[n] for n in names if n in by_name]
    launched_on = set(names)
    return running, [r for r in slices if r.name not in launched_on], bool(names) and len(running) == len(names)
