"""The read side at fleet scale: the dashboard's overview and the metrics endpoint over a store of many jobs,
most of them ended. What a request costs must follow what it shows (a page of jobs; the jobs not ended and the
last to end), not every job the store ever held; what is not shown is still counted."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from orchestrator.cluster import Home
from orchestrator.control.queue import queue_positions
from orchestrator.observe.dashboard.data import LIST_MAX, PAGE_SIZE, DashboardData
from orchestrator.observe.metrics import ENDED_KEPT, serve_metrics
from orchestrator.state.states import JobState
from orchestrator.state.store import Store

ENDED, RUNNING, QUEUED = 130, 40, 12  # ended first (the oldest), then running, then queued (the newest)


@pytest.fixture
def store(tmp_path) -> Store:
    s = Store(tmp_path / "home" / "state.db")
    spec = {"name": "j", "accelerator": "v4-8", "tier": "spot", "provider": "gcp",
            "gcp": {"project": "p", "zones": ["us-central2-b"]},
            "workload": {"type": "lm", "steps": 10}}
    at = 1_000.0
    for i in range(ENDED + RUNNING + QUEUED):
        job = f"job-{i:04d}"
        s.create_job(job, "j", spec, at=at + i)
        if i < ENDED:
            s.transition(job, JobState.CANCELLED, "cancelled", at=at + 1_000 + i)
        elif i < ENDED + RUNNING:
            for state in (JobState.PROVISIONING, JobState.STARTING, JobState.RUNNING):
                s.transition(job, state, "on", at=at + 1_000 + i)
        else:
            s.transition(job, JobState.QUEUED, "no capacity", at=at + 1_000 + i)
    return s


def test_the_overview_shows_a_page_of_jobs_the_live_first_and_counts_them_all(store, tmp_path):
    data = DashboardData(store, Home(tmp_path / "home"), queue_positions=queue_positions)
    first = data.overview(now=5_000.0)
    total = ENDED + RUNNING + QUEUED
    assert first["pages"] == -(-total // PAGE_SIZE) and first["page"] == 1
    assert len(first["jobs"]) == PAGE_SIZE
    ids = [r["id"] for r in first["jobs"]]
    live = [f"job-{i:04d}" for i in reversed(range(ENDED, total))]  # not ended, newest first
    assert ids == live[:PAGE_SIZE]
    totals = first["totals"]
    assert totals["jobs"] == total and totals["active"] == RUNNING + QUEUED
    assert totals["by_state"] == {"CANCELLED": ENDED, "RUNNING": RUNNING, "QUEUED": QUEUED}
    # The queue: every QUEUED job with its place (one line for gcp, in the order they were submitted).
    assert [q["id"] for q in first["queue"]] == [f"job-{i:04d}" for i in range(ENDED + RUNNING, total)]
    assert [q["position"] for q in first["queue"]] == list(range(1, QUEUED + 1))
    queued_rows = {r["id"]: r["queue_position"] for r in first["jobs"] if r["state"] == "QUEUED"}
    assert queued_rows == {f"job-{i:04d}": i - ENDED - RUNNING + 1 for i in range(ENDED + RUNNING, total)}
    # The last page: the oldest ended jobs; a page past the last is the last.
    last = data.overview(now=5_000.0, page=999)
    assert last["page"] == first["pages"]
    on_last = total - (first["pages"] - 1) * PAGE_SIZE
    assert [r["id"] for r in last["jobs"]] == [f"job-{i:04d}" for i in reversed(range(on_last))]
    assert all(r["done"] for r in last["jobs"])
    seen = [r["id"] for p in range(1, first["pages"] + 1) for r in data.overview(now=5_000.0, page=p)["jobs"]]
    assert sorted(seen) == sorted(f"job-{i:04d}" for i in range(total))  # every job on one page, once


def test_the_overview_lists_slices_up_to_its_limit_and_counts_their_chips(store, tmp_path):
    for i in range(LIST_MAX + 20):
        job = f"job-{ENDED + i % RUNNING:04d}"
        for state in ("REQUESTED", "PROVISIONING", "READY"):
            store.put_slice(f"s-{i:04d}", job, "gcp", "v4-8", "spot", state, {"hosts": [], "zone": "us-central2-b"})
    o = DashboardData(store, Home(tmp_path / "home"), queue_positions=queue_positions).overview(now=5_000.0)
    assert len(o["slices"]) == LIST_MAX and o["totals"]["slices"] == LIST_MAX + 20
    assert o["totals"]["chips_in_use"] == (LIST_MAX + 20) * 4  # v4-8: 4 chips


def test_metrics_carry_series_of_the_live_jobs_and_the_last_to_end_and_count_every_job(store):
    server, port = serve_metrics(store)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
            text = resp.read().decode()
    finally:
        server.stop()
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    with_series = {s.labels["job_id"] for s in samples if s.name == "orchestrator_job_info"}
    total = ENDED + RUNNING + QUEUED
    last_ended = {f"job-{i:04d}" for i in range(ENDED - ENDED_KEPT, ENDED)}
    assert with_series == {f"job-{i:04d}" for i in range(ENDED, total)} | last_ended
    counts = {s.labels["state"]: s.value for s in samples if s.name == "orchestrator_jobs"}
    assert counts["CANCELLED"] == ENDED and counts["RUNNING"] == RUNNING and counts["QUEUED"] == QUEUED
    assert sum(counts.values()) == total
