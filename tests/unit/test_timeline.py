"""Markers as the report, the dashboard and `status` name them: causes told apart, every kind labelled."""

from __future__ import annotations

import pytest

from orchestrator.domain.shape import Shape
from orchestrator.observe.report import write_report
from orchestrator.observe.report_picture import _MARKER_STYLE
from orchestrator.observe.report_series import report_series
from orchestrator.observe.timeline import MARKER_KINDS, MARKER_TITLES, disruption_cause, markers, move_line
from orchestrator.state.events import Adopted, Disrupted, Launched, ResizeAsked, StateChange
from orchestrator.state.states import JobState
from orchestrator.state.store import Store
from tests.unit.test_goodput import T0, preempted_job


@pytest.mark.parametrize("kind,reason,cause", [
    ("preempted", "spot slice s1 reclaimed", "preemption"),
    ("infra_lost", "host 1 of slice s1 is gone", "host_lost"),
    ("infra_lost", "a worker died (ActorDiedError)", "worker_crash"),
    ("infra_lost", "a worker is unreachable (GetTimeoutError)", "worker_crash"),
    ("infra_lost", "no progress for 120 s (hung)", "hung"),
    ("app_failed", "ValueError: boom", "failure"),
    ("worker_aborted", "host 1's worker process died, its host still up: SIGABRT: ...", "worker_crash"),
    ("hung", "no step for 120 s while every worker answers (hung)", "hung"),
    ("user_exit", "host 0: the job's code called sys.exit(0) with 0 of 20 steps done", "failure"),
    ("import_error", "host 0: cannot import the entrypoint train:main: ...", "failure"),
    ("storage_failed", "host 0: OSError: [Errno 28] No space left on device", "failure"),
    ("platform_failed", "host 0 of slice s1 (v4-16) found no TPU: ...", "failure"),
    ("provision_failed", "no slice", None),
])
def test_a_crashed_worker_is_not_a_lost_host(kind, reason, cause):
    assert disruption_cause(kind, reason) == cause


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "state.db")
    preempted_job(s, "job-p")
    at = T0 + 95
    s.add_event("job-p", Disrupted("infra_lost", 12, "a worker died (ActorDiedError)", 2), "worker", at=at)
    s.add_event("job-p", Disrupted("infra_lost", 13, "host 0 of slice s2 is gone", 2), "host", at=at + 1)
    s.add_event("job-p", Adopted(), "the controller restarted and adopted the running generation 2", at=at + 2)
    s.add_event("job-p", ResizeAsked("v4-8", "v4-16", "spot", "requested", 15), "resize", at=at + 3)
    return s


def test_every_kind_of_marker_is_placed_and_labelled(store):
    found = markers(store.events("job-p"), store.steps("job-p"))
    kinds = [m.kind for m in found]
    assert {"checkpoint", "preemption", "restore", "worker_crash", "host_lost", "adoption", "move"} <= set(kinds)
    assert all(m.label and m.step is not None for m in found)
    adoption = next(m for m in found if m.kind == "adoption")
    assert adoption.step == 14  # placed at the steps done when it happened (step 13 was reported at that moment)
    assert next(m for m in found if m.kind == "move").label == "move v4-8 → v4-16 spot"
    assert set(MARKER_KINDS) <= set(MARKER_TITLES) and set(MARKER_KINDS) <= set(_MARKER_STYLE)


def test_the_report_draws_them_all(store, tmp_path):
    s = report_series(store, "job-p")
    assert {"worker_crash", "host_lost", "adoption", "move", "checkpoint"} <= {m.kind for m in s.markers}
    assert write_report(store, "job-p", tmp_path / "r.png").stat().st_size > 30_000


def test_status_says_what_a_move_is_doing(tmp_path):
    s = Store(tmp_path / "state.db")
    s.create_job("j-1", "j", {"name": "j", "accelerator": "v4-8", "workload": {"type": "lm", "steps": 10}})
    for state in (JobState.PROVISIONING, JobState.STARTING):
        s.transition("j-1", state, "x")
    s.add_event("j-1", Launched("j-1-1", ["n"], [1], 1), "launched")
    s.transition("j-1", JobState.RUNNING, "x", data=StateChange(generation=1), generation=1)
    s.put_slice("j-1-1", "j-1", "local", "v4-8", "spot", "REQUESTED", {})
    s.put_slice("j-1-1", "j-1", "local", "v4-8", "spot", "READY", {})
    assert move_line(s, s.job("j-1")) is None
    s.put_slice("j-1-2m1", "j-1", "local", "v4-32", "spot", "REQUESTED", {})  # make-before-break: beside it
    s.put_slice("j-1-2m1", "j-1", "local", "v4-32", "spot", "WAITING", {})
    assert move_line(s, s.job("j-1")) == "moving to v4-32 spot: waiting for capacity"
    s.add_event("j-1", ResizeAsked("v4-8", "v4-32", "spot", "ready", 5), "switching")
    assert move_line(s, s.job("j-1")) == "moving to v4-32 spot: checkpointing (step 5), then the old slice goes"
    s.place("j-1", Shape("v4-32", "spot"))
    s.transition("j-1", JobState.RESIZING, "moving")
    assert move_line(s, s.job("j-1")) == "moving to v4-32 spot: releasing the old slice"
    s.transition("j-1", JobState.QUEUED, "waiting")
    assert move_line(s, s.job("j-1")) == "moving to v4-32 spot: waiting for capacity"


def two_slice_job_running(tmp_path) -> Store:
    """A store with job j-1 running generation 1 on two v4-16 slices (j-1-1, j-1-1s2)."""
    s = Store(tmp_path / "state.db")
    s.create_job("j-1", "j", {"name": "j", "accelerator": "v4-16", "slices": 2, "workload": {"type": "lm"}})
    for state in (JobState.PROVISIONING, JobState.STARTING):
        s.transition("j-1", state, "x")
    for name in ("j-1-1", "j-1-1s2"):
        s.put_slice(name, "j-1", "local", "v4-16", "spot", "REQUESTED", {})
        s.put_slice(name, "j-1", "local", "v4-16", "spot", "READY", {})
    s.add_event("j-1", Launched("j-1-1", ["n1", "n2"], [1, 2], 1, 2, ["j-1-1", "j-1-1s2"]), "launched 1")
    s.transition("j-1", JobState.RUNNING, "x", data=StateChange(generation=1), generation=1)
    return s


def test_a_job_on_two_slices_is_not_moving(tmp_path):
    s = two_slice_job_running(tmp_path)
    assert move_line(s, s.job("j-1")) is None  # it said "moving to v4-16 spot: slice ready, switching ..."
    s.put_slice("j-1-2m1", "j-1", "local", "v4-32", "spot", "REQUESTED", {})  # a third, beside both: a move
    assert move_line(s, s.job("j-1")) == "moving to v4-32 spot: requesting the slice"


def test_the_status_lines_read_the_newest_events_and_find_an_older_launch_of_the_current_generation(tmp_path):
    from orchestrator.state.events import EventKind

    empty = Store(tmp_path / "empty.db")
    empty.create_job("j-0", "j", {"name": "j", "accelerator": "v4-16", "workload": {"type": "lm"}})
    assert empty.last_event("j-0", EventKind.LAUNCHED) is None
    s = two_slice_job_running(tmp_path)
    s.add_event("j-1", Launched("j-1-1", ["n1"], [1], 2, 1, ["j-1-1"]), "launched 2")  # generation 2 starting
    assert s.last_event("j-1", EventKind.LAUNCHED).reason == "launched 2"
    assert s.last_event("j-1", EventKind.STATE).to_state is JobState.RUNNING
    assert s.last_event("j-1", EventKind.STATE, to_state=JobState.STARTING).reason == "x"
    # generation 1 still runs on both slices: its own launch says so, not the newest one (which names one)
    assert move_line(s, s.job("j-1")) is None
