"""Refusals are capacity facts: a spot request the replayed trace cannot fill waits with no host
started and expires unbilled; events are taken per slice; a job holding two slices is adopted
on the one its generation runs on."""

from __future__ import annotations

import json
import time

import pytest

from orchestrator import catalog, cluster
from orchestrator.control.adoption import running_slices
from orchestrator.control.waiting import Look, Waiting, look
from orchestrator.observe.billing import billed_slices
from orchestrator.providers.base import CapacityError, SliceEventKind, SliceRequest
from orchestrator.providers.capacity import SpotCapacity
from orchestrator.providers.local import LocalProvider
from orchestrator.state.events import EventKind, Launched, SliceChanged
from orchestrator.state.states import SliceState
from orchestrator.state.store import SliceRow, Store
from policies.cost.clock import Clock


def trace_file(tmp_path, counts, gap_s=60.0):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"metadata": {"gap_seconds": gap_s}, "data": counts}))
    return str(path)


def provider_with_store(tmp_path):
    store = Store(tmp_path / "state.db")
    store.create_job("j", "j", {})

    def save(s, pgids):
        store.put_slice(s.name, s.job_id, s.provider, s.tpu_type.name, s.tier.value, s.state.value,
                        {"pgids": pgids, "hosts": []},
                        event=SliceChanged(s.name, s.tpu_type.name, s.tpu_type.chips, s.tier.value, s.state.value,
                                           s.tpu_type.usd_per_hour(s.tier)))

    home = cluster.Home(tmp_path / "home").ensure()
    return LocalProvider(home, "127.0.0.1:1", max_hosts=2, on_change=save), store


def spot_request(name, capacity, timeout_s=None):
    return SliceRequest("j", name, catalog.lookup("v4-8"), catalog.Tier.SPOT, queue_timeout_s=timeout_s,
                        spot_capacity=capacity)


def test_trace_clock_and_capacity(tmp_path):
    clock = Clock(origin=1000.0, scale=60.0, start_s=120.0)
    assert clock.trace_s(1001.0) == 180.0 and clock.wall_s(300.0) == 5.0
    cap = SpotCapacity(trace_file(tmp_path, [1, 0, 1]), clock)
    # Trace seconds 120, 180, 240: tick 2 (1 -> a v4-32's 16 chips), tick 0 after the wrap (1), tick 1 (0).
    assert [cap.chips(1000.0 + dt) for dt in (0.0, 1.0, 2.0)] == [16, 16, 0]


def test_a_spot_request_above_capacity_waits_unstarted_and_expires_unbilled(tmp_path):
    p, store = provider_with_store(tmp_path)
    cap = SpotCapacity(trace_file(tmp_path, [0] * 100), Clock(origin=time.time(), scale=60.0))
    s = p.request(spot_request("s1", cap, timeout_s=0.3))
    assert s.state is SliceState.WAITING and p._pgids["s1"] == []  # no host started
    assert p.hosts_in_use() == 0  # a waiting request holds no host
    w = Waiting("s1", "v4-8", "spot", time.monotonic(), 0.3)
    assert look(p, w)[0] is Look.WAITING
    time.sleep(0.4)  # past the 0.3 s queue timeout: the provider reads it off the clock at the next look
    kind, _, why = look(p, w)
    assert kind is Look.REFUSED and "queue timeout" in why
    states = [e.payload.state for e in store.events("j", kind=EventKind.SLICE)]
    assert states == ["REQUESTED", "WAITING", "GONE", "RELEASED"]
    assert billed_slices(store.events("j"), end=time.time()) == []  # never filled, never billed


def test_wait_ready_turns_a_refusal_into_a_capacity_error(tmp_path):
    p, _ = provider_with_store(tmp_path)
    cap = SpotCapacity(trace_file(tmp_path, [0] * 100), Clock(origin=time.time(), scale=60.0))
    p.request(spot_request("s1", cap, timeout_s=0.2))
    with pytest.raises(CapacityError, match="queue timeout"):
        p.wait_ready("s1", timeout_s=5)
    assert p.get("s1").state is SliceState.RELEASED


def test_events_are_taken_per_slice(tmp_path):
    p, _ = provider_with_store(tmp_path)
    cap = SpotCapacity(trace_file(tmp_path, [0] * 100), Clock(origin=time.time(), scale=60.0))
    p.request(spot_request("mine", cap, timeout_s=0.1))
    p.request(spot_request("other", cap, timeout_s=0.1))
    time.sleep(0.2)  # past both 0.1 s queue timeouts: the provider reads them off the clock when polled
    mine = p.poll_events(slices=["mine"])
    assert [(e.slice_name, e.kind) for e in mine] == [("mine", SliceEventKind.NO_CAPACITY)]
    # The other job's event was left for it, not dropped.
    assert [(e.slice_name, e.kind) for e in p.poll_events(slices=["other"])] == [
        ("other", SliceEventKind.NO_CAPACITY)]


def test_two_slice_adoption_keeps_the_running_one(tmp_path):
    store = Store(tmp_path / "state.db")
    store.create_job("j", "j", {})
    store.bump_generation("j")
    store.bump_generation("j")
    store.add_event("j", Launched("j-1", ["n"], [1], 1), "gen 1")
    store.add_event("j", Launched("j-2", ["n"], [1], 2), "gen 2")
    job = store.job("j")
    recs = [SliceRow(name, "j", "local", "v4-8", "spot", SliceState.READY, {}, 0.0) for name in ("j-3m1", "j-2")]
    running, beside, whole = running_slices(store, job, recs)
    assert [r.name for r in running] == ["j-2"] and whole and [r.name for r in beside] == ["j-3m1"]
    # No launch of this generation on any live slice: nothing is adopted, both are released.
    running, beside, whole = running_slices(store, job, [recs[0]])
    assert running == [] and not whole and [r.name for r in beside] == ["j-3m1"]


def test_a_multi_slice_generation_is_adopted_whole_in_launch_order_or_not_at_all(tmp_path):
    store = Store(tmp_path / "state.db")
    store.create_job("j", "j", {})
    store.bump_generation("j")
    store.add_event("j", Launched("j-1b", ["n1", "n2"], [1, 2], 1, 2, ["j-1b", "j-1a"]), "gen 1 on two slices")
    job = store.job("j")
    recs = [SliceRow(name, "j", "local", "v4-8", "spot", SliceState.READY, {}, 0.0)
            for name in ("j-1a", "j-1b", "j-2m1")]
    running, beside, whole = running_slices(store, job, recs)
    assert [r.name for r in running] == ["j-1b", "j-1a"] and whole  # rank order is the launch's slice order
    assert [r.name for r in beside] == ["j-2m1"]
    # One slice of the generation gone while no controller ran: the group is not whole, its rest is stopped.
    running, beside, whole = running_slices(store, job, recs[:1])
    assert [r.name for r in running] == ["j-1a"] and not whole and beside == []


def test_queue_timeout_counts_across_refusals(tmp_path):
    """A spot job without autoscaling waits for capacity up to its queue_timeout, counted from its
    first refusal, not reset by each new request; it says why it waits in its status."""
    import threading

    from orchestrator.control.queue import AdmissionQueue
    from orchestrator.domain.spec import JobSpec
    from orchestrator.state.states import JobState
    from policies.decisions.recovery import OutcomeKind

    p, store = provider_with_store(tmp_path)
    spec = JobSpec.from_dict({"name": "j", "queue_timeout": "PT5M"})
    store.create_job("k", "k", spec.model_dump(mode="json"))
    q = AdmissionQueue(store, p)
    now = time.monotonic()
    assert q.wait_turn("k", spec, threading.Event(), refused="no spot", refusals=1, since=now - 10,
                       limit_s=60) is None  # admitted: 10 s of a 60 s limit
    job = store.job("k")
    assert job.state is JobState.QUEUED and "no capacity: no spot" in job.reason
    ended = q.wait_turn("k", spec, threading.Event(), refused="no spot", refusals=2, since=now - 61, limit_s=60)
    assert ended is not None and ended.kind is OutcomeKind.PROVISION_FAILED and "queue_timeout" in ended.reason


def test_a_job_file_names_its_capacity_trace(tmp_path):
    """`capacity_trace.path` is taken from the job file's folder; a bad one is an error naming the field."""
    from orchestrator.domain.spec import JobSpec
    from orchestrator.errors import SpecError

    trace_file(tmp_path, [1, 0])
    (tmp_path / "job.yaml").write_text("name: demo\ncapacity_trace: {path: trace.json, time_scale: 60}\n")
    spec = JobSpec.from_yaml(tmp_path / "job.yaml")
    assert spec.capacity_trace.path == str(tmp_path / "trace.json") and spec.capacity_trace.time_scale == 60
    (tmp_path / "bad.yaml").write_text("name: demo\ncapacity_trace: {path: missing.json}\n")
    with pytest.raises(SpecError, match="capacity_trace.path"):
        JobSpec.from_yaml(tmp_path / "bad.yaml")
    with pytest.raises(SpecError, match="capacity_trace"):
        JobSpec.from_dict({"name": "x", "provider": "gcp", "gcp": {"project": "p", "zones": ["z"]},
                           "capacity_trace": {"path": str(tmp_path / "trace.json")}})
