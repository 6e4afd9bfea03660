"""A scrape reads a running job's rows on from where the last scrape stopped (`metrics._Rows`), and its goodput
is what a read of every row gives, whatever was written between: new steps, a missed step filled in later, a
step recomputed by a later generation (the newest row among them too), new events."""

from __future__ import annotations

import pytest

from orchestrator.observe.goodput import goodput
from orchestrator.observe.metrics import JobCollector
from orchestrator.state.events import StateChange
from orchestrator.state.states import JobState
from orchestrator.state.store import Store
from tests.unit.test_goodput import T0, _slice

NOW = T0 + 200.0


def _step(store: Store, generation: int, step: int, at: float) -> None:
    store.record_steps("job", generation, [(step, 5.0 / (step + 1) + generation, 1000.0 + step, 1.5)], at=at)


def test_each_scrape_reads_on_and_gives_what_a_read_of_every_row_gives(tmp_path):
    store = Store(tmp_path / "state.db")
    collector = JobCollector(store, clock=lambda: NOW)
    store.create_job("job", "lm", {"accelerator": "v4-8", "tier": "spot"}, at=T0)
    store.transition("job", JobState.PROVISIONING, "requesting", at=T0 + 5)
    _slice(store, "job", T0 + 5, "s1", "REQUESTED")
    _slice(store, "job", T0 + 20, "s1", "READY")
    store.transition("job", JobState.STARTING, "ready", data=StateChange(provision_s=15.0, slice="s1"), at=T0 + 20)
    store.transition("job", JobState.RUNNING, "joined", data=StateChange(init_s=5.0, generation=1), at=T0 + 25)

    def scrape_matches() -> None:
        job = store.job("job")
        got, fresh = collector._goodput(job), goodput(store, "job", now=NOW)
        assert got == fresh
        rows = collector._rows["job"]
        assert (rows.events, [rows.steps[k] for k in sorted(rows.steps)]) == (store.events("job"), store.steps("job"))

    for k in range(10):
        _step(store, 1, k, T0 + 30 + 2 * k)
    scrape_matches()
    _step(store, 1, 10, T0 + 50)
    _step(store, 1, 12, T0 + 54)  # 11's report went missing
    scrape_matches()
    _step(store, 1, 11, T0 + 52)  # filled in from the worker's history: a lower step, the same generation
    scrape_matches()
    store.import_event("job", "disruption", "preempted", {"kind": "preempted", "step": 12, "generation": 1},
                       at=T0 + 60)
    store.transition("job", JobState.RECOVERING, "reclaimed", data=StateChange(outcome="preempted"), at=T0 + 60,
                     preemptions=1)
    store.transition("job", JobState.PROVISIONING, "again", at=T0 + 61)
    store.transition("job", JobState.STARTING, "ready", data=StateChange(provision_s=9.0, slice="s2"), at=T0 + 70)
    store.transition("job", JobState.RUNNING, "joined", data=StateChange(init_s=4.0, generation=2), at=T0 + 74)
    store.import_event("job", "lost_work", "lost 3 steps", {"steps": 3, "seconds": 4.5, "from_step": 12,
                                                            "to_step": 9}, at=T0 + 75)
    _step(store, 2, 11, T0 + 76)  # the newest row (11's) written again: a new row all the same
    scrape_matches()
    for k in (9, 10, 12, 13):
        _step(store, 2, k, T0 + 78 + k)
    scrape_matches()
    assert store.steps_written_after("job", collector._rows["job"]._row) == ([], collector._rows["job"]._row)


def test_an_ended_job_s_rows_are_dropped_and_its_goodput_kept(tmp_path):
    store = Store(tmp_path / "state.db")
    collector = JobCollector(store, clock=lambda: NOW)
    store.create_job("job", "lm", {"accelerator": "v4-8", "tier": "spot"}, at=T0)
    store.transition("job", JobState.PROVISIONING, "requesting", at=T0 + 5)
    list(collector.collect())
    assert set(collector._rows) == {"job"}
    store.transition("job", JobState.CANCELLED, "cancelled", at=T0 + 9)
    list(collector.collect())
    assert collector._rows == {} and set(collector._ended) == {"job"}
    assert collector._ended["job"][1].end == pytest.approx(T0 + 9)
