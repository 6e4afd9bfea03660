"""The watch loop waits on the driver's wake event: a group that says when it next has something to say is
looked at then (at most `watch.LOOK_S`), and a cancel or a stop asked from another thread ends the wait at once."""

from __future__ import annotations

import threading
import time

import pytest

from orchestrator.control.job import loop, watch
from orchestrator.control.job.driver import JobDriver
from orchestrator.state.states import JobState
from tests.unit.driver_world import ScriptedGroup, World, spec


class _Says:
    def __init__(self, quiet_s: float):
        self.quiet = quiet_s

    def quiet_s(self) -> float:
        return self.quiet


@pytest.mark.parametrize(("group", "wait_s"), [
    (object(), watch.POLL_S),  # says nothing (the Ray group): every POLL_S, as before
    (_Says(30.0), watch.LOOK_S),  # quiet for long: looked at every LOOK_S all the same
    (_Says(0.0), watch.POLL_S),  # something to say now: not sooner than POLL_S
    (_Says(0.6), 0.6),
])
def test_the_wait_is_the_groups_quiet_time_within_poll_and_look(group, wait_s):
    assert watch._wait_s(group) == pytest.approx(wait_s)


class QuietGroup(ScriptedGroup):
    """Says it has nothing to say for a minute: the loop waits on its wake event for LOOK_S (set to a minute)."""

    def quiet_s(self) -> float:
        return 60.0


@pytest.fixture
def world(tmp_path, monkeypatch):
    monkeypatch.setattr(watch, "POLL_S", 0.005)
    monkeypatch.setattr(watch, "LOOK_S", 60.0)
    w = World(tmp_path)
    w.group_for = lambda driver, s: w.groups.append(QuietGroup(w, driver, s)) or w.groups[-1]
    return w


def _start(world: World) -> tuple[JobDriver, threading.Event]:
    driver = world.submit(spec(workload={"type": "lm", "steps": 50}))
    done = threading.Event()
    loop.start(driver, lambda job_id: done.set())
    deadline = time.monotonic() + 20
    while not (world.groups and world.groups[0].step >= 0):  # launched, and waiting after its first look
        assert time.monotonic() < deadline, "the job did not launch"
        time.sleep(0.01)
    return driver, done


def test_a_cancel_ends_a_quiet_groups_wait_at_once(world):
    driver, done = _start(world)
    driver.cancel()
    assert done.wait(20), "the cancel waited out the group's quiet time (60 s)"
    assert world.store.job("job").state is JobState.CANCELLED
    assert world.groups[0].stop_reason is not None  # stopped at a committed step, as a cancel does


def test_a_stop_asked_from_outside_reaches_the_hosts_without_waiting_out_the_quiet_time(world):
    driver, done = _start(world)
    driver.view().on_stop("the budget is spent")  # the budget's stop, from the controller's thread
    deadline = time.monotonic() + 20
    while world.groups[0].stop_reason is None:
        assert time.monotonic() < deadline, "the stop waited out the group's quiet time (60 s)"
        time.sleep(0.01)
    driver.cancel()
    assert done.wait(20)
