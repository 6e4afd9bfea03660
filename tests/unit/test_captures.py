"""The controller's side of profile captures (`orchestrator.control.captures`): ask, gather, one event."""

from __future__ import annotations

import pytest

from orchestrator.control.attempt import Attempt
from orchestrator.control.captures import Captures, memory_total
from orchestrator.errors import JobStateError, ProfileError
from orchestrator.state.events import EventKind
from orchestrator.state.store import Store
from workers.protocol import ProfileDone


class FakeGroup:
    """A worker group of two hosts that keeps the capture requests handed to its hosts."""

    hosts = 2

    def __init__(self):
        self.asked = []

    def request_profile(self, req):
        self.asked.append(req)


@pytest.fixture
def setup(tmp_path):
    store = Store(tmp_path / "s.db")
    store.create_job("j", "j", {})
    att = Attempt(generation=3, started=True, group=FakeGroup())
    return store, att, Captures(store, "j")


def profiles(store):
    return [e for e in store.events("j") if e.kind is EventKind.PROFILE]


def test_every_host_is_asked_and_the_chosen_hosts_reports_make_one_event(setup):
    store, att, captures = setup
    asked = captures.ask(att, "/ckpt", 3, None, False)
    assert asked["path"] == f"/ckpt/profiles/{asked['capture']}" and asked["hosts"] == [0, 1]
    (req0,) = att.group.asked
    assert req0.hosts == (0, 1) and req0.number > 0
    with pytest.raises(ProfileError, match="is under way; ask again once it ends"):
        captures.ask(att, "/ckpt", 3, None, False)
    memory = ({"device": "tpu:0", "bytes_in_use": 2, "peak_bytes_in_use": 5, "bytes_limit": 16},
              {"device": "tpu:1", "bytes_in_use": 3, "peak_bytes_in_use": 4, "bytes_limit": 16})
    captures.done(0, ProfileDone(req0.capture_id, f"{req0.destination}/host-0", 12, 3, memory))
    captures.done(0, ProfileDone("another", "/x", 1, 1))  # not this capture: ignored
    assert profiles(store) == []
    captures.done(1, ProfileDone(req0.capture_id, f"{req0.destination}/host-1", 12, 3, memory))
    (event,) = profiles(store)
    p = event.payload
    assert (p.capture, p.path, p.hosts, p.first_step, p.steps, p.error) == (
        req0.capture_id, req0.destination, [0, 1], 12, 3, None)
    assert p.memory["1"] == {"devices": 2, "bytes_in_use": 5, "peak_bytes_in_use": 9, "bytes_limit": 32}
    assert event.reason == f"profiled steps 12-14 on hosts 0, 1: {req0.destination}"
    second = captures.ask(att, "/ckpt", 1, 1, True)  # the next one may begin; its number is newer
    assert att.group.asked[-1].number > req0.number and second["hosts"] == [1]


def test_a_capture_that_never_began_ends_with_the_hosts_reason(setup):
    store, att, captures = setup
    asked = captures.ask(att, "/ckpt", 3, 1, False)
    captures.done(1, ProfileDone(asked["capture"], None, None, 0, (), "training stopped after step 40 before "
                                                                       "the capture could begin"))
    (event,) = profiles(store)
    assert event.payload.path is None
    assert event.reason == (f"profile capture {asked['capture']} failed: host 1: training stopped after step 40 "
                            "before the capture could begin")


def test_a_capture_ends_with_its_attempt(setup, monkeypatch):
    store, att, captures = setup
    monkeypatch.setattr("orchestrator.control.captures.ENDED_WAIT_S", 0.01)
    asked = captures.ask(att, "/ckpt", 3, None, False)
    captures.attempt_ended(2, "an older generation")  # not the capture's: nothing
    assert profiles(store) == []
    captures.attempt_ended(3, "preempted")
    (event,) = profiles(store)
    assert event.payload.error == "the job's attempt ended before the capture did (preempted)"
    captures.abandon(asked["capture"], "late")  # already over: nothing more
    assert len(profiles(store)) == 1


def test_requests_that_cannot_be_asked(setup):
    store, att, captures = setup
    with pytest.raises(ProfileError, match="--steps must be 1 to 100, got 0"):
        captures.ask(att, "/ckpt", 0, None, False)
    with pytest.raises(ProfileError, match=r"--host 2: job j runs on 2 hosts \(0 to 1\), or use --host all"):
        captures.ask(att, "/ckpt", 3, 2, False)
    att.notice = "cancelled by the user"
    with pytest.raises(ProfileError, match=r"job j is stopping \(cancelled by the user\)"):
        captures.ask(att, "/ckpt", 3, None, False)
    with pytest.raises(JobStateError):
        captures.ask(Attempt(), "/ckpt", 3, None, False)
    assert att.group.asked == []


def test_memory_total_of_a_cpu_host():
    assert memory_total([{"device": "cpu:0"}, {"device": "cpu:1"}]) == {"devices": 2}
