"""Capacity memory pooled across jobs: what earlier jobs' slices showed of spot in a zone is
where the next job there starts, through the real store and in the simulator."""

from __future__ import annotations

import pytest

from orchestrator.control.autoscaler import snapshot
from orchestrator.domain.spec import JobSpec
from orchestrator.state.store import Store
from policies.cost.capacity_memory import POOL_HORIZON_S, estimates, pooled
from policies.cost.policy import CostPolicy
from policies.cost.slice_history import SliceRecord, read_history
from policies.cost.slice_options import ON_DEMAND, SPOT, Option
from policies.cost.spot_estimates import REFUSAL_HOLDS_S
from policies.evaluation.simulator import SimJob, simulate
from policies.evaluation.traces import SpotTrace

T0 = 1_700_000_000.0
HOUR = 3600.0


def _spec(zone: str | None = None) -> dict:
    spec = JobSpec.from_dict({
        "name": "pool", "accelerator": "v4-16", "tier": "spot", "zone": zone,
        "workload": {"type": "lm", "steps": 20_000, "global_batch_size": 16, "seq_len": 32,
                     "model": {"d_model": 64, "n_layers": 2, "n_heads": 4, "d_ff": 128, "vocab_size": 256}},
        "autoscaling": {"accelerators": ["v4-16", "v4-32"], "tiers": ["spot", "on-demand"]},
        "deadline": "P3D",
    })
    return spec.model_dump(mode="json")


def _slice(store, job_id, name, states, *, chips=16, zone=None):
    for at, state in states:
        data = {"name": name, "accelerator": "v4-32" if chips == 16 else "v4-16", "chips": chips, "tier": "spot",
                "state": state}
        if zone:
            data["zone"] = zone
        store.import_event(job_id, "slice", f"slice {name} {state}", data, at=at)


def test_a_new_job_starts_from_what_the_last_job_in_its_zone_learned(tmp_path):
    store = Store(tmp_path / "db.sqlite")
    store.create_job("first", "first", _spec("us-central2-b"), at=T0)
    # the first job's v4-32 spot slice lived 30 min and was reclaimed twice; then its request waited 3 h unfilled
    _slice(store, "first", "a", [(T0, "REQUESTED"), (T0, "READY"), (T0 + 0.5 * HOUR, "GONE")], zone="us-central2-b")
    _slice(store, "first", "b", [(T0 + HOUR, "REQUESTED"), (T0 + HOUR, "READY"), (T0 + 1.5 * HOUR, "GONE")],
           zone="us-central2-b")
    _slice(store, "first", "c", [(T0 + 2 * HOUR, "REQUESTED"), (T0 + 2 * HOUR, "WAITING"),
                                 (T0 + 5 * HOUR, "RELEASED")], zone="us-central2-b")
    gone = T0 + 5 * HOUR
    store.create_job("next", "next", _spec("us-central2-b"), at=gone + 60)
    store.create_job("elsewhere", "elsewhere", _spec("europe-west4-a"), at=gone + 60)
    store.create_job("fresh", "fresh", _spec("us-central2-b"), at=gone + 60)
    nxt = snapshot(store, "next", now=gone + 60, current=None)
    away = snapshot(store, "elsewhere", now=gone + 60, current=None)
    # another zone learns nothing from it: the bare priors, every spot size worth asking for
    assert away.availability.counts == {} and away.hazard.counts == {} and away.spot_chips_available == 16
    # the same zone: the refusal a minute ago still holds, so only v4-16 spot is worth asking for ...
    assert nxt.spot_chips_available == 8
    # ... the outages and short lives it saw are the new job's estimates ...
    zone = "us-central2-b"
    assert nxt.availability.fraction(zone, 16) < away.availability.fraction("europe-west4-a", 16)
    assert nxt.availability.outage_h(zone, 16)[0] > away.availability.outage_h("europe-west4-a", 16)[0]
    spot32 = next(o for o in nxt.options if o.name == "v4-32" and o.tier == SPOT)
    assert nxt.hazard.per_slice_hour(spot32) > away.hazard.per_slice_hour(
        next(o for o in away.options if o.name == "v4-32" and o.tier == SPOT))
    # ... and once the refusal is old, v4-32 spot is worth asking for again: old enough for a
    # refusal after two reclaims of the size with no slice of it up since (it holds 4x as long)
    held_s = 4 * REFUSAL_HOLDS_S
    assert snapshot(store, "fresh", now=gone + held_s - 60, current=None).spot_chips_available == 8
    later = snapshot(store, "fresh", now=gone + held_s + 120, current=None)
    assert later.spot_chips_available == 16
    assert later.availability.counts == nxt.availability.counts or later.availability.counts


def test_pooled_records_are_the_zones_and_not_too_old():
    def r(at, zone):
        return SliceRecord(at, f"s{at}", "READY", SPOT, 16, 4, zone)

    records = [r(-POOL_HORIZON_S - 1, "a"), r(-10, "a"), r(-10, "b"), r(5, "a")]
    assert [x.at_s for x in pooled(records, zone="a", now_s=0.0)] == [-10]


def test_pooled_estimates_are_the_sum_of_what_each_job_saw():
    first = [SliceRecord(0, "a", "READY", SPOT, 16, 4), SliceRecord(3600, "a", "GONE", SPOT, 16, 4)]
    second = [SliceRecord(7200, "b", "WAITING", SPOT, 16, 4), SliceRecord(9000, "b", "RELEASED", SPOT, 16, 4)]
    availability, hazard = estimates(read_history(first + second, 10_000), sizes=[8, 16])
    counts = availability.counts[("default", 16)]
    assert counts.observed_h == pytest.approx(1.5) and counts.available_h == pytest.approx(1.0)
    assert hazard.counts[(SPOT, "default")].preemptions == 1
    assert hazard.counts[(SPOT, "default")].host_hours == pytest.approx(4.0)


def test_the_simulators_pooled_mode_starts_from_the_jobs_before():
    """knowledge "pooled": the jobs replayed just before this one on the same trace saw spot go;
    this job starts knowing what they learned; a refusal a minute before it starts still holds."""
    spot = Option("v4-32", 16, 4, SPOT, 14.72, 270_000.0)
    od = Option("v4-32", 16, 4, ON_DEMAND, 51.52, 270_000.0)
    job = SimJob(270_000.0 * 2 * HOUR, 3 * HOUR, (spot, od))
    counts = (1,) * 12 + (0,) * 60 + (1,) * 200  # spot for an hour, then none for 5 h, then back
    trace = SpotTrace("gone", 300.0, counts, 1)
    start = 3 * HOUR  # one deadline after the trace's start: the job before ran from 0

    first_look = {}

    class Looking(CostPolicy):
        def decide(self, snap):
            if snap.now_s == 0:  # the last run's first look (pooled mode replays the job before first)
                first_look[self.name] = snap
            return super().decide(snap)

    own = simulate(Looking(name="own"), job, trace, start_s=start, knowledge="own")
    pool = simulate(Looking(name="pooled"), job, trace, start_s=start, knowledge="pooled")
    assert own.deadline_met and pool.deadline_met
    assert first_look["own"].availability.counts == {} and first_look["own"].hazard.counts == {}
    learned = first_look["pooled"].availability
    seen = learned.counts[("default", 16)]  # the job before saw spot up, then waited for it
    assert seen.observed_h > 1.0 and 0 < seen.available_h < seen.observed_h
    assert first_look["pooled"].hazard.counts[(SPOT, "default")].preemptions == 1  # and its reclaim
    assert all(r.at_s >= 0 for r in pool.records)  # the earlier jobs' records are memory, not this run's
    # A refusal a minute before the job starts still holds: it does not queue for that size.
    refused = [SliceRecord(-400, "x", "REQUESTED", SPOT, 16, 4), SliceRecord(-400, "x", "WAITING", SPOT, 16, 4),
               SliceRecord(-60, "x", "RELEASED", SPOT, 16, 4)]
    told = simulate(CostPolicy(), job, trace, start_s=start, knowledge="own", memory=refused)
    assert own.decisions[0].option == spot.label and told.decisions[0].option != spot.label
    assert told.refusals < own.refusals
