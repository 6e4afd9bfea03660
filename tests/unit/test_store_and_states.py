"""The store's guarded transitions and events, and the lifecycle tables."""

from __future__ import annotations

import threading

import pytest

from orchestrator.errors import IllegalTransitionError, JobNotFoundError
from orchestrator.state.events import StateChange
from orchestrator.state.states import JOB_TRANSITIONS, SLICE_TRANSITIONS, JobState, SliceState, check_slice
from orchestrator.state.store import Store


def test_every_state_is_in_the_tables():
    assert set(JOB_TRANSITIONS) == set(JobState)
    assert set(SLICE_TRANSITIONS) == set(SliceState)
    for s in JobState:
        assert (JOB_TRANSITIONS[s] == frozenset()) == s.terminal


def test_guarded_transition_records_an_event(tmp_path):
    store = Store(tmp_path / "s.db")
    store.create_job("j1", "j", {})
    store.transition("j1", JobState.PROVISIONING, "asking", data=StateChange(slice="s1"))
    with pytest.raises(IllegalTransitionError, match="cannot go from PROVISIONING to SUCCEEDED"):
        store.transition("j1", JobState.SUCCEEDED, "too early")
    assert store.job("j1").state is JobState.PROVISIONING
    events = store.events("j1")
    assert [(e.from_state, e.to_state) for e in events] == [(None, "PENDING"), ("PENDING", "PROVISIONING")]
    assert events[1].data == {"slice": "s1"} and events[1].reason == "asking"


def test_terminal_states_are_final(tmp_path):
    store = Store(tmp_path / "s.db")
    store.create_job("j1", "j", {})
    store.transition("j1", JobState.CANCELLED, "user")
    for target in JobState:
        with pytest.raises(IllegalTransitionError):
            store.transition("j1", target, "again")


def test_concurrent_writers_do_not_lose_transitions(tmp_path):
    store = Store(tmp_path / "s.db")
    for i in range(20):
        store.create_job(f"j{i}", "j", {})

    def drive(i):
        s = Store(tmp_path / "s.db")  # another connection, as another process would have
        s.transition(f"j{i}", JobState.PROVISIONING, "x")
        s.record_steps(f"j{i}", 1, [(k, 1.0 / (k + 1), None, None) for k in range(10)])

    threads = [threading.Thread(target=drive, args=(i,)) for i in range(20)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert all(store.job(f"j{i}").state is JobState.PROVISIONING for i in range(20))
    assert all(len(store.steps(f"j{i}")) == 10 for i in range(20))


def test_recomputed_step_keeps_the_newest_generation(tmp_path):
    store = Store(tmp_path / "s.db")
    store.create_job("j1", "j", {})
    store.record_steps("j1", 1, [(0, 3.0, None, None), (1, 2.5, None, None)])
    store.record_steps("j1", 2, [(1, 2.4, None, None)])
    assert [(m.step, m.generation, m.loss) for m in store.steps("j1")] == [(0, 1, 3.0), (1, 2, 2.4)]


def test_find_job_by_prefix_and_name(tmp_path):
    store = Store(tmp_path / "s.db")
    store.create_job("train-abc123", "train", {})
    assert store.find_job("train-abc").id == "train-abc123"
    assert store.find_job("train").id == "train-abc123"
    with pytest.raises(JobNotFoundError):
        store.find_job("other")


def test_slice_transitions():
    check_slice("s", SliceState.READY, SliceState.PREEMPTING)
    with pytest.raises(IllegalTransitionError):
        check_slice("s", SliceState.RELEASED, SliceState.READY)


def test_active_jobs_are_those_not_ended(tmp_path):
    store = Store(tmp_path / "s.db")
    for i, target in enumerate([None, JobState.QUEUED, JobState.FAILED, JobState.CANCELLED]):
        store.create_job(f"j{i}", "j", {}, at=float(i))
        if target is not None:
            store.transition(f"j{i}", target, "x")
    assert [j.id for j in store.jobs(active_only=True)] == ["j0", "j1"]
    assert [j.id for j in store.jobs()] == ["j0", "j1", "j2", "j3"]
