"""The admission line: priority first, then submission time; strict, so big jobs are not starved."""

from __future__ import annotations

import pytest

from policies.decisions.admission import WaitingJob, admit, line

A = WaitingJob("a", priority=0, submitted_at=1.0, hosts=2)
B = WaitingJob("b", priority=0, submitted_at=2.0, hosts=1)
URGENT = WaitingJob("urgent", priority=5, submitted_at=3.0, hosts=4)
BIG = WaitingJob("big", priority=0, submitted_at=0.5, hosts=8)


@pytest.mark.parametrize("waiting, job, free, expected", [
    ([A], "a", 2, (True, 1)),                    # alone and it fits
    ([A], "a", 1, (False, 1)),                   # alone, too few hosts: waits first in line
    ([A, B], "b", 8, (False, 2)),                # hosts free, but a is ahead
    ([A, B], "a", 8, (True, 1)),
    ([A, B, URGENT], "urgent", 4, (True, 1)),     # a higher priority goes first, though submitted last
    ([A, B, URGENT], "a", 8, (False, 2)),
    ([BIG, B], "b", 4, (False, 2)),              # strict: b does not pass a big job that waits for hosts
    ([BIG, B], "big", 4, (False, 1)),
    ([BIG, B], "big", 8, (True, 1)),
    ([A, WaitingJob("huge", 0, 9.0, 16)], "huge", 0, (True, 2)),  # more than the pool has: waiting cannot help
])
def test_admission(waiting, job, free, expected):
    d = admit(waiting, job, free_hosts=free, total_hosts=8)
    assert (d.admit, d.position) == expected
    assert d.reason


def test_the_reason_says_why_and_what_is_free():
    d = admit([BIG, B], "b", free_hosts=4, total_hosts=8)
    assert d.reason == "position 2 in the queue, behind big (priority 0); 4 of 8 hosts free"
    d = admit([BIG], "big", free_hosts=4, total_hosts=8)
    assert "needs 8 hosts, 4 of 8 free" in d.reason


def test_equal_keys_order_by_id_so_every_process_agrees():
    x, y = WaitingJob("x", 0, 1.0, 1), WaitingJob("y", 0, 1.0, 1)
    assert [w.job_id for w in line([y, x])] == ["x", "y"]


@pytest.mark.parametrize("refusals, jitter, expected", [
    (1, 0.0, 15.0), (2, 0.0, 30.0), (3, 0.0, 60.0), (6, 0.0, 300.0), (20, 0.0, 300.0),  # capped
    (1, 0.99, 15.0 * (1 - 0.495)),
])
def test_retry_after_doubles_to_a_cap_with_jitter(refusals, jitter, expected):
    from policies.decisions.admission import retry_after

    assert retry_after(refusals, jitter) == pytest.approx(expected)


def test_a_job_that_left_the_line_since_it_was_read_has_no_place(tmp_path):
    """`status` reads the job, then the line: a job admitted or cancelled in between has no place (None),
    not an error."""
    from orchestrator.control.queue import queue_position
    from orchestrator.state.states import JobState
    from orchestrator.state.store import Store

    store = Store(tmp_path / "state.db")
    for job_id in ("a", "b"):
        store.create_job(job_id, job_id, {"name": job_id, "accelerator": "v4-16", "workload": {"type": "lm"}})
        store.transition(job_id, JobState.QUEUED, "waiting for hosts")
    read = store.job("b")
    assert queue_position(store, read) == 2
    store.transition("b", JobState.CANCELLED, "cancelled by the user")
    assert queue_position(store, read) is None


def test_list_reads_the_line_once_and_gives_every_queued_job_its_place(tmp_path, monkeypatch):
    """`orchestrator list` (`Client.jobs`) places every queued job from one read of the line, the same places
    `status` gives one job at a time; a read of the whole line per job made the list quadratic in the jobs."""
    from orchestrator.control import queue
    from orchestrator.state.states import JobState
    from orchestrator.user.client import Client

    client = Client(home=tmp_path / "home")
    for job_id in ("a", "b", "c", "d"):
        client.store.create_job(job_id, job_id, {"name": job_id, "accelerator": "v4-16", "workload": {"type": "lm"}})
        if job_id != "d":  # d stays PENDING: no place
            client.store.transition(job_id, JobState.QUEUED, "waiting for hosts")
    one_by_one = {j.id: queue.queue_position(client.store, j) for j in client.store.jobs()}
    reads = []
    whole_line = client.store.jobs
    monkeypatch.setattr(client.store, "jobs", lambda **kw: reads.append(kw) or whole_line(**kw))
    listed = {s.id: s.queue_position for s in client.jobs()}
    assert listed == one_by_one == {"a": 1, "b": 2, "c": 3, "d": None}
    assert len(reads) == 1, reads
