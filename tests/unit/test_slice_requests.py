"""A multi-slice job's slice requests (`orchestrator.control.job.requests`), waited on together.

On GCP each slice is a queued resource that waits for capacity and boots on its own, so the slices
of one attempt fill in any order. The requests run against a fake cloud whose script says, per
request, what each look at it finds; the driver test runs the whole job on it.
"""

from __future__ import annotations

import threading
import time

import pytest

from orchestrator.control.autoscaler import Choice
from orchestrator.control.job import watch
from orchestrator.control.job.requests import Requests
from orchestrator.control.queue import AdmissionQueue
from orchestrator.domain.shape import Shape
from orchestrator.domain.spec import JobSpec
from orchestrator.errors import ProvisioningError
from orchestrator.providers.base import CapacityError, Host, Slice, SliceRequest
from orchestrator.state.events import EventKind
from orchestrator.state.states import JobState, SliceState
from orchestrator.state.store import Store
from policies.cost.moves import Move
from tests.unit.driver_world import FakeProvider, ScriptedPolicy, World, choice, option, spec

Q, W, P, R, G = SliceState.REQUESTED, SliceState.WAITING, SliceState.PROVISIONING, SliceState.READY, SliceState.GONE


class QueuedCloud(FakeProvider):
    """Requests that wait for capacity until their script says otherwise: `script[name]` is what each
    look at the request finds (REQUESTED, not yet in the cloud's queue; WAITING for capacity;
    PROVISIONING while its hosts start; READY; GONE when refused), the last one for every look after it.
    A request the script does not name is READY at its first look."""

    def __init__(self, store: Store, script: dict[str, list[SliceState]]):
        super().__init__(store)
        self.script = {name: list(states) for name, states in script.items()}
        self.asked: list[str] = []
        self.refused_at_once: set[str] = set()  # requests refused as they are made

    def request(self, req: SliceRequest) -> Slice:
        if req.name in self.refused_at_once:
            raise CapacityError(f"no {req.tpu_type.name} {req.tier.value} capacity now", slice_name=req.name)
        self.asked.append(req.name)
        return self._put(Slice(req.name, req.job_id, req.tpu_type, req.tier, req.zone, SliceState.REQUESTED,
                               provider="local"))

    def check(self, name: str) -> Slice:
        s = self.slices[name]
        if s.state.terminal:
            return s
        states = self.script.get(name, [R])
        target = states.pop(0) if len(states) > 1 else states[0]
        if target is s.state:
            return s
        if target is R and s.state is W:  # capacity came and its hosts joined between two looks
            s = self._put(Slice(s.name, s.job_id, s.tpu_type, s.tier, s.zone, P, (), "local"))
        hosts = tuple(Host(i, f"{name}-w{i}") for i in range(s.tpu_type.hosts)) if target is R else ()
        return self._put(Slice(s.name, s.job_id, s.tpu_type, s.tier, s.zone, target, hosts, "local"))


def autoscaled_spot(slices: int = 2, **extra) -> JobSpec:
    """A spot job the cost policy put on `slices` x v4-16: it takes the part of them that can be had."""
    raw = spec(autoscaling={"accelerators": ["v4-16"], "max_slices": slices}, deadline="PT24H", **extra)
    return JobSpec.from_dict(raw).moved("v4-16", "spot", slices=slices)


def all_or_none(slices: int = 2, **extra) -> JobSpec:
    """A spot job on `slices` x v4-16 that no policy chooses: it starts on all of them or on none."""
    return JobSpec.from_dict(spec(slices=slices, **extra))


class Asking:
    """One job's `Requests` on the scripted cloud, as its driver holds them, the job PROVISIONING."""

    def __init__(self, tmp_path, job: JobSpec, script: dict[str, list[SliceState]]):
        self.store = Store(tmp_path / "state.db")
        self.store.create_job("job", job.name, job.model_dump(mode="json"))
        self.store.transition("job", JobState.PROVISIONING, "admitted")
        self.cloud = QueuedCloud(self.store, script)
        self.requests = Requests(self.store, "job", threading.Event(), self.transition)
        self.requests.use(self.cloud)
        self.spec = job

    def transition(self, target: JobState, reason: str, *, data=None) -> None:
        self.store.transition("job", target, reason, data=data)

    def provision(self, *, within_s: float = 10.0) -> list[Slice]:
        """The attempt's slices; the test fails if it still waits after `within_s`."""
        deadline = time.monotonic() + within_s
        return self.requests.provision_all(self.spec, 1, 0, limit_s=None,
                                           still_wanted=lambda s: time.monotonic() < deadline)

    def states(self) -> list[JobState | None]:
        return [e.to_state for e in self.store.events("job") if e.kind is EventKind.STATE]

    def autoscaled(self) -> list[str]:
        return [e.reason for e in self.store.events("job") if e.kind is EventKind.AUTOSCALE]

    def state_of(self, name: str) -> SliceState:
        return self.cloud.slices[name].state


def test_a_spot_job_that_takes_part_starts_on_the_second_slice_when_it_fills_first(tmp_path):
    """The first request never gets capacity; the second gets it at its third look: the job starts on
    the second, and the first is let go (the policy adds a slice back when capacity comes)."""
    asking = Asking(tmp_path, autoscaled_spot(), {"job-1": [W], "job-1s1": [W, W, R]})
    started = time.monotonic()
    got = asking.provision()
    assert [s.name for s in got] == ["job-1s1"] and got[0].state is R
    assert time.monotonic() - started < 5  # not held back by the first request
    assert asking.state_of("job-1") is SliceState.RELEASED and asking.cloud.asked == ["job-1", "job-1s1"]
    assert asking.autoscaled() == ["1 of 2 slices could be had now; starting on them (the others were let go; "
                                   "the policy adds slices when capacity comes)"]
    assert asking.states() == ["PENDING", "PROVISIONING", "QUEUED", "PROVISIONING"]
    assert asking.requests.waiting is None


def test_a_spot_job_that_takes_part_keeps_a_slice_whose_hosts_are_starting(tmp_path):
    """The second is READY first while capacity came for the first and its hosts start: the job waits
    for them and starts on both, in slice order; only a request still waiting for capacity is let go."""
    asking = Asking(tmp_path, autoscaled_spot(), {"job-1": [W, P, P, P, R], "job-1s1": [W, R]})
    got = asking.provision()
    assert [s.name for s in got] == ["job-1", "job-1s1"] and {s.state for s in got} == {R}
    assert asking.autoscaled() == []


def test_an_all_or_none_job_waits_for_all_its_slices_in_whatever_order_they_fill(tmp_path):
    asking = Asking(tmp_path, all_or_none(), {"job-1": [W, W, W, W, P, R], "job-1s1": [W, R]})
    got = asking.provision()
    assert [s.name for s in got] == ["job-1", "job-1s1"] and {s.state for s in got} == {R}  # slice order
    assert asking.states() == ["PENDING", "PROVISIONING", "QUEUED", "PROVISIONING"]
    assert asking.autoscaled() == []


def test_a_job_is_queued_only_while_the_cloud_says_a_request_waits_for_capacity(tmp_path):
    """Requests the cloud has not yet put in its queue (REQUESTED) are no news of capacity: the job stays
    PROVISIONING, and says nothing of a wait."""
    asking = Asking(tmp_path, all_or_none(), {"job-1": [Q, Q, R], "job-1s1": [Q, R]})
    assert [s.name for s in asking.provision()] == ["job-1", "job-1s1"]
    assert asking.states() == ["PENDING", "PROVISIONING"]


def test_an_all_or_none_job_lets_every_slice_go_once_one_is_refused_whatever_its_place(tmp_path):
    """The second request is refused while the first still waits for capacity: none is held, at once,
    rather than after the first's wait."""
    asking = Asking(tmp_path, all_or_none(), {"job-1": [W], "job-1s1": [W, G]})
    started = time.monotonic()
    with pytest.raises(CapacityError) as refused:
        asking.provision(within_s=30)
    assert refused.value.slice_name == "job-1s1"
    assert time.monotonic() - started < 5
    assert asking.state_of("job-1") is SliceState.RELEASED and asking.state_of("job-1s1") is SliceState.GONE
    assert asking.requests.waiting is None


def test_a_spot_job_that_takes_part_lets_every_slice_go_when_the_policy_no_longer_wants_them(tmp_path):
    asking = Asking(tmp_path, autoscaled_spot(), {"job-1": [W], "job-1s1": [W]})
    with pytest.raises(CapacityError, match="no longer wants"):
        asking.provision(within_s=1)
    assert asking.state_of("job-1") is asking.state_of("job-1s1") is SliceState.RELEASED
    assert asking.requests.waiting is None


def test_a_slice_whose_hosts_do_not_start_is_asked_for_again_while_the_others_are_kept(tmp_path):
    """The second slice's hosts never join within the start timeout: it alone is given back and asked for
    again under the next name (after a backoff); the first, READY meanwhile, is kept."""
    job = all_or_none(recovery={"start_timeout_s": 0.5})
    asking = Asking(tmp_path, job, {"job-1": [W, R], "job-1s1": [P]})
    got = asking.provision(within_s=30)
    assert [s.name for s in got] == ["job-1", "job-1s1b"]
    assert asking.cloud.asked == ["job-1", "job-1s1", "job-1s1b"]
    assert asking.state_of("job-1s1") is SliceState.RELEASED


def test_a_request_the_policy_kept_waiting_is_waited_on_not_asked_for_again(tmp_path):
    """Slices asked for beside a running one (a move) that the policy still wants when the job provisions:
    the same requests, whichever fills first."""
    asking = Asking(tmp_path, all_or_none(), {"job-1m1": [W, W, R], "job-1m1s1": [W, R]})
    assert asking.requests.ask_beside(asking.spec, Shape("v4-16", "spot", 2), generation=0, adding=None)
    got = asking.provision()
    assert [s.name for s in got] == ["job-1m1", "job-1m1s1"]
    assert asking.cloud.asked == ["job-1m1", "job-1m1s1"]


def test_asked_for_all_or_none_a_refusal_at_once_leaves_nothing(tmp_path):
    asking = Asking(tmp_path, all_or_none(), {})
    asking.cloud.refused_at_once.add("job-1s1")
    with pytest.raises(CapacityError) as refused:
        asking.provision()
    assert refused.value.slice_name == "job-1s1" and asking.cloud.asked == ["job-1"]
    assert asking.state_of("job-1") is SliceState.RELEASED and asking.requests.waiting is None


class FailingStarts(QueuedCloud):
    """A cloud where the hosts of the requests named in `failing` exit while starting (the local provider's
    ProvisioningError after its own restarts): capacity was there, the start failed."""

    def __init__(self, store: Store, failing: set[str]):
        super().__init__(store, {})
        self.failing = failing

    def check(self, name: str) -> Slice:
        if name in self.failing and not self.slices[name].state.terminal:
            self.release(name)
            raise ProvisioningError(f"host 0 of slice {name} exited while starting (3 tries)", slice_name=name,
                                    transient=True)
        return super().check(name)


def test_a_slice_whose_hosts_exit_while_starting_is_a_failed_start_asked_for_again_not_a_lack_of_capacity(tmp_path):
    asking = Asking(tmp_path, all_or_none(slices=1), {})
    asking.cloud = FailingStarts(asking.store, {"job-1"})
    asking.requests.use(asking.cloud)
    got = asking.provision()
    assert [s.name for s in got] == ["job-1b"] and asking.cloud.asked == ["job-1", "job-1b"]
    assert JobState.QUEUED not in asking.states()  # the job never said it waited for capacity
    assert asking.state_of("job-1") is SliceState.RELEASED


def test_starts_that_keep_failing_end_the_attempt_as_a_failure_to_provision_not_a_refusal(tmp_path):
    asking = Asking(tmp_path, all_or_none(slices=2), {})
    asking.cloud = FailingStarts(asking.store, {"job-1s1", "job-1s1b", "job-1s1c"})
    asking.requests.use(asking.cloud)
    with pytest.raises(ProvisioningError) as e:
        asking.provision(within_s=30)
    assert not isinstance(e.value, CapacityError) and e.value.transient  # a failure, tried again with backoff
    assert "job-1s1c: could not start: host 0 of slice job-1s1c exited while starting" in str(e.value)
    assert asking.cloud.asked == ["job-1", "job-1s1", "job-1s1b", "job-1s1c"]  # the first slice was kept
    assert asking.state_of("job-1") is SliceState.RELEASED and asking.requests.waiting is None
    assert JobState.QUEUED not in asking.states()


# -- the whole job -------------------------------------------------------------------------


@pytest.fixture
def world(tmp_path, monkeypatch):
    monkeypatch.setattr(watch, "POLL_S", 0.005)  # a poll is a step of the scripted workers
    monkeypatch.setattr(watch, "SETTLE_S", 0.05)
    world = World(tmp_path)
    world.provider = QueuedCloud(world.store, {"job-1": [W], "job-1s1": [W, W, R]})
    world.queue = AdmissionQueue(world.store, world.provider)
    return world


def test_an_autoscaled_job_starts_on_the_second_of_two_spot_slices_when_it_fills_first(world):
    policy = ScriptedPolicy()
    driver = world.submit(spec(autoscaling={"accelerators": ["v4-16"], "max_slices": 2}, deadline="PT24H"),
                          policy=policy)
    two = option("v4-16", 2)

    def decide(spec_, current, *, waiting=None, ready=False) -> Choice:
        if current is None:
            return choice(Move(target=two), "v4-16", 2)
        return choice(Move(target=option("v4-16", current[2])), "v4-16", current[2])  # no grow: the start is tested

    policy.decide = decide
    driver.moves.ask_now()
    world.run(driver)
    job = world.store.job("job")
    assert job.state is JobState.SUCCEEDED and job.failures == 0
    [group] = world.groups
    assert group.slices == ["job-1s1"] and group.hosts == 2 and group.spec.slices == 1
    assert world.provider.slices["job-1"].state is SliceState.RELEASED
    assert [e.reason for e in world.store.events("job") if e.kind is EventKind.AUTOSCALE
            and e.reason.startswith("1 of 2 slices could be had now")]


def test_a_restarted_controller_asks_for_no_name_an_earlier_one_used(tmp_path):
    """The counts that name requests start again under a new controller; the store's slices say which names
    the job used, and those are passed over (a released slice cannot be asked for again: the store refuses)."""
    asking = Asking(tmp_path, all_or_none(), {"job-1m1": [W], "job-1m1s1": [W], "job-1g2": [W]})
    assert asking.requests.ask_beside(asking.spec, Shape("v4-16", "spot", 2), generation=0, adding=None)
    asking.requests.drop("the policy changed its mind")
    asking.requests.ask_one(asking.spec, generation=0)
    asking.requests.drop("not wanted")
    asking.cloud.release("job-1")  # not asked: a name the first provisioning would take, released
    asking.store.put_slice("job-1", "job", "local", "v4-16", "spot", "RELEASED", {})

    restarted = Requests(asking.store, "job", threading.Event(), asking.transition)  # a new controller's
    restarted.use(asking.cloud)
    assert restarted.ask_beside(asking.spec, Shape("v4-16", "spot", 2), generation=0, adding=None)
    restarted.drop("again")
    restarted.ask_one(asking.spec, generation=0)
    restarted.drop("again")
    asking.requests = restarted
    got = asking.provision()
    assert [s.name for s in got] == ["job-1b", "job-1s1"]
    assert asking.cloud.asked == ["job-1m1", "job-1m1s1", "job-1g2", "job-1m2", "job-1m2s1", "job-1g3", "job-1b",
                                  "job-1s1"]
