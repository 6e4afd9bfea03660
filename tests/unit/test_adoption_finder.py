"""Adoption finds a job's running group through a `GroupFinder` (Ray's named actors in the controller, the
fleet benchmark's scripted groups outside it): a group found is adopted with the finder's own group and its
history's newest step; one that cannot be found is discarded through the same finder and its slices
released. A whole reconcile lists each cloud provider once, not once per job (one out of reach: once, holding
nothing)."""

from __future__ import annotations

import threading

from benchmarks.fleet import job_spec
from orchestrator import catalog
from orchestrator.control.adoption import CloudListing, Found, adopt
from orchestrator.domain.spec import JobSpec
from orchestrator.providers.base import Slice
from orchestrator.state.events import Launched
from orchestrator.state.states import JobState, SliceState
from orchestrator.state.store import SliceRow, Store


class _Local:
    """This machine's hosts, as adoption follows them again."""

    def __init__(self):
        self.followed: dict[str, Slice] = {}

    def adopt(self, s: Slice, pgids) -> None:
        self.followed[s.name] = s

    def get(self, name: str) -> Slice:
        return self.followed[name]


class _Plane:
    def __init__(self, store: Store):
        self.store, self.provider, self.released = store, _Local(), []

    def provider_for(self, spec):
        return self.provider

    def release_record(self, rec: SliceRow) -> None:
        self.released.append(rec.name)


class _Finder:
    def __init__(self, history=None, error: Exception | None = None):
        self.history, self.error, self.discarded = history or [], error, []

    def find(self, store, job, running) -> Found:
        if self.error is not None:
            raise self.error
        return Found([], None, self.history, group=("scripted", job.id, job.generation))

    def discard(self, job, running) -> None:
        self.discarded.append((job.id, job.generation, [r.name for r in running]))


def _running_job(tmp_path) -> tuple[Store, list[SliceRow]]:
    store = Store(tmp_path / "state.db")
    spec = job_spec(0, "http://127.0.0.1:1", steps=10, autoscale=False)
    del spec["gcp"]
    store.create_job("j", "j", JobSpec.from_dict({**spec, "provider": "local"}).model_dump(mode="json"))
    for state in (JobState.PROVISIONING, JobState.STARTING, JobState.RUNNING):
        store.transition("j", state, "on its way")
    store.bump_generation("j")
    store.add_event("j", Launched("j-1", ["n0", "n1"], None, 1, 1, ["j-1"]), "gen 1")
    data = {"pgids": [], "hosts": ["h0", "h1"], "zone": None}
    return store, [SliceRow("j-1", "j", "local", "v4-16", "spot", SliceState.READY, data, 0.0),
                   SliceRow("j-2m1", "j", "local", "v4-16", "spot", SliceState.REQUESTED, data, 0.0)]


def test_a_found_group_is_adopted_as_the_finder_found_it(tmp_path):
    store, slices = _running_job(tmp_path)
    plane, finder = _Plane(store), _Finder(history=[{"step": 6, "loss": 0.5}, {"step": 7, "loss": 0.4}])
    adoption, history = adopt(plane, store.job("j"), slices, groups=finder)
    assert adoption is not None and adoption.group == ("scripted", "j", 1)
    assert adoption.last_step == 7 and [h["step"] for h in history] == [6, 7]
    assert [s.name for s in adoption.launch.slices] == ["j-1"] and adoption.launch.generation == 1
    assert adoption.provider is plane.provider and list(plane.provider.followed) == ["j-1"]
    assert plane.released == ["j-2m1"] and finder.discarded == []  # the request beside it given back, no more


def test_a_group_not_found_is_discarded_through_the_finder_and_its_slices_released(tmp_path):
    store, slices = _running_job(tmp_path)
    plane, finder = _Plane(store), _Finder(error=RuntimeError("the hosts hold no group of this generation"))
    adoption, history = adopt(plane, store.job("j"), slices, groups=finder)
    assert adoption is None and history == []
    assert finder.discarded == [("j", 1, ["j-1"])]
    assert sorted(plane.released) == ["j-1", "j-2m1"] and plane.provider.followed == {}


class _Cloud:
    def __init__(self, slices: list[Slice]):
        self.slices, self.lists = slices, 0

    def list(self, *, job_id: str | None = None) -> list[Slice]:
        self.lists += 1
        return [s for s in self.slices if job_id is None or s.job_id == job_id]


def test_a_reconcile_lists_each_cloud_once_and_finds_a_jobs_slices_by_its_id_or_label():
    t = catalog.lookup("v4-16")
    cloud = _Cloud([Slice(name, job, t, catalog.Tier.SPOT, "z", SliceState.READY, (), "gcp")
                    for name, job in (("a-1", "Job-A"), ("a-2", "job-a"), ("b-1", "job-b"))])
    listing = CloudListing()
    assert [s.name for s in listing.of(cloud, "Job-A")] == ["a-1", "a-2"]  # "job-a" is Job-A's label value
    assert [s.name for s in listing.of(cloud, "job-b")] == ["b-1"]
    assert listing.of(cloud, "job-c") == []
    assert cloud.lists == 1


class _Unreachable:
    name = "gcp"

    def __init__(self):
        self.lists = 0

    def list(self, *, job_id: str | None = None) -> list[Slice]:
        self.lists += 1
        raise ConnectionError("the TPU API is out of reach")


def test_a_cloud_out_of_reach_holds_nothing_for_the_pass_and_is_asked_once():
    cloud, listing = _Unreachable(), CloudListing()
    assert listing.of(cloud, "job-a") == [] and listing.of(cloud, "job-b") == []
    assert cloud.lists == 1


class _Driver:
    def __init__(self, job_id: str, adoption, made: list[str]):
        self.job_id, self.adoption = job_id, adoption
        made.append(job_id)
        self.progress = self

    def record_missed(self, generation: int, history) -> int:
        return len(history)

    def transition(self, state, reason: str) -> None:
        raise AssertionError("a running job is adopted or lost with the cluster, not moved on here")


class _FailingFor(_Finder):
    def __init__(self, job_id: str):
        super().__init__(history=[{"step": 3}])
        self.job_id = job_id

    def find(self, store, job, running) -> Found:
        if job.id == self.job_id:
            raise RuntimeError("none of the workers answered")
        return super().find(store, job, running)


def _running_jobs(tmp_path, jobs: list[str]) -> Store:
    store = Store(tmp_path / "state.db")
    spec = job_spec(0, "http://127.0.0.1:1", steps=10, autoscale=False)
    del spec["gcp"]
    data = {"pgids": [], "hosts": ["h0", "h1"], "zone": None}
    for job in jobs:
        store.create_job(job, job, JobSpec.from_dict({**spec, "provider": "local"}).model_dump(mode="json"))
        for state in (JobState.PROVISIONING, JobState.STARTING, JobState.RUNNING):
            store.transition(job, state, "on its way")
        store.bump_generation(job)
        store.add_event(job, Launched(f"{job}-1", ["n0", "n1"], None, 1, 1, [f"{job}-1"]), "gen 1")
        for state in ("REQUESTED", "PROVISIONING", "READY"):
            store.put_slice(f"{job}-1", job, "local", "v4-16", "spot", state, data)
    return store


def test_every_driver_starts_once_the_pass_is_over_in_its_order_each_made_when_its_job_is_passed(tmp_path):
    """Drivers started as the pass went competed with it for the process's core (at N=1,000 the last job was
    adopted 209 s after the restart): each is made (and takes its job's reports) when the pass reaches its job,
    and started only when the pass has been over every job."""
    from orchestrator.control.adoption import reconcile

    store = _running_jobs(tmp_path, ["a", "b", "c"])
    plane, made, started, lost = _Plane(store), [], [], []

    def start(driver) -> None:
        assert made == ["a", "b", "c"], f"{driver.job_id} started with only {made} made"
        started.append(driver.job_id)

    reconcile(plane, lambda job_id, adoption: _Driver(job_id, adoption, made), start,
              lambda driver, generation: lost.append((driver.job_id, generation)), groups=_FailingFor("b"))
    assert started == ["a", "b", "c"] and lost == [("b", 1)]
    assert [e.reason for e in store.events("a") if e.kind == "adopted"] == [
        "the controller restarted and adopted the running generation 1 (1 missed steps recorded)"]



class _AnsweringTogether(_Finder):
    """Each group answers only once every job's group is being looked for: a pass that looks for one
    group after another waits on the first until it gives up."""

    def __init__(self, jobs: int):
        super().__init__(history=[{"step": 3}])
        self.together = threading.Barrier(jobs, timeout=5.0)

    def find(self, store, job, running) -> Found:
        self.together.wait()  # raises BrokenBarrierError if the others never come
        return super().find(store, job, running)


def test_the_groups_are_looked_for_at_once_so_one_that_is_slow_to_answer_holds_up_only_itself(tmp_path):
    """A group that does not answer keeps its finder waiting up to ANSWER_S (30 s). Looked for one after another,
    it held up every job after it in the pass, and so every driver (they start when the pass is over)."""
    from orchestrator.control.adoption import FIND_AT_ONCE, reconcile

    jobs = [f"j{i}" for i in range(6)]
    assert len(jobs) <= FIND_AT_ONCE
    store = _running_jobs(tmp_path, jobs)
    plane, made, started, lost = _Plane(store), [], [], []
    reconcile(plane, lambda job_id, adoption: _Driver(job_id, adoption, made), lambda d: started.append(d.job_id),
              lambda driver, generation: lost.append((driver.job_id, generation)), groups=_AnsweringTogether(len(jobs)))
    assert lost == [] and started == jobs  # every group found, in the pass's order
    assert all(len([e for e in store.events(j) if e.kind == "adopted"]) == 1 for j in jobs)

def test_the_checkpoints_hosts_committed_while_no_controller_ran_are_recorded_once_from_their_history(tmp_path):
    """A worker's history keeps each checkpoint with the step it followed (`saved_entry`): the controller that
    adopts the group records those its store lacks, once (a fleet restart at N=1,000 lost 904 of these events)."""
    from orchestrator.state.events import CheckpointSaved, EventKind
    from tests.unit.driver_world import World, spec
    from workers.protocol import Saved, saved_entry

    world = World(tmp_path)
    driver = world.submit(spec())
    world.store.add_event("job", CheckpointSaved(10, 0.1), "saved step 10")  # reported before the restart
    history = [{"step": s, "loss": 1.0 / (s + 1), "at": 100.0 + s} for s in range(8, 22)]
    for i, saved in ((1, 10), (11, 20)):  # steps 9 and 19 each followed by its checkpoint
        history[i] = {**history[i], **saved_entry(Saved(saved, 0.2))}
    assert driver.progress.record_missed(1, history) == 14
    assert driver.progress.record_missed(1, history) == 0  # again (a catch-up after the adoption): nothing twice
    saves = [e for e in world.store.events("job", kind=EventKind.CHECKPOINT)]
    assert [(e.payload.step, e.reason) for e in saves] == [(10, "saved step 10"), (20, "saved step 20")]
    assert saves[1].payload.blocking_s == 0.2 and saves[1].at == history[11]["saved_at"]


def test_a_save_reported_and_not_yet_written_is_not_recorded_again_from_the_history(tmp_path):
    """The reports are written by the store's writer a moment after they arrive. A history read in that moment
    (an adoption, a catch-up) must not take a save already reported for one the store lacks: at N=1,000 a
    restart recorded 10 jobs' checkpoints twice so, until the history was read by the writer after the reports."""
    import threading

    from orchestrator.control.store_faults import HeldWrites
    from orchestrator.state.events import CheckpointSaved, EventKind
    from tests.unit.driver_world import World, spec
    from workers.protocol import Saved, saved_entry

    world = World(tmp_path)
    driver = world.submit(spec())
    gate = threading.Event()

    def gated_batch():  # the writer is slow to get to its queue (busy elsewhere): nothing of it is written yet
        gate.wait(10)
        return world.store.batch()

    world.held = HeldWrites(world.store_health, gated_batch)
    world.held.add(lambda: world.store.add_event("job", CheckpointSaved(20, 0.2), "saved step 20"))  # the report
    history = [{"step": s, "loss": 1.0 / (s + 1), "at": 100.0 + s} for s in range(18, 22)]
    history[1] = {**history[1], **saved_entry(Saved(20, 0.2))}
    missed: list[int] = []
    reader = threading.Thread(target=lambda: missed.append(driver.progress.record_missed(1, history)))
    reader.start()
    reader.join(1.0)  # reads while the report waits (a reader that did not wait for the writer is done by now)
    gate.set()
    reader.join(10)
    world.held.flush()
    assert missed == [4]
    saves = [e.payload.step for e in world.store.events("job", kind=EventKind.CHECKPOINT)]
    assert saves == [20]
