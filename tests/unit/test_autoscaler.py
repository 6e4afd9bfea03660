"""The running job's side of the cost policy, over a job history written through the real store."""

from __future__ import annotations

import pytest

from orchestrator.control.autoscaler import (
    Choice,
    decide_for,
    snapshot,
    spot_availability,
    spot_chips_now,
    step_seconds,
    with_checkpoint_interval,
)
from orchestrator.domain.spec import JobSpec
from orchestrator.state.events import StateChange
from orchestrator.state.states import JobState
from orchestrator.state.store import Store
from policies.cost.restart_cost import DEFAULT_SAVE_S, RestartCost
from policies.cost.spot_estimates import REFUSAL_HOLDS_S

T0 = 1_700_000_000.0
STEP_S = 2.0
INTERVAL_STEPS = 300  # the spec's interval: 600 s at 2 s a step


def _job(store: Store, preemptions: int, *, saves: list[float], max_slices: int = 1,
         global_batch_size: int = 16) -> str:
    spec = JobSpec.from_dict({
        "name": "auto", "accelerator": "v4-16", "tier": "spot",
        "workload": {"type": "lm", "steps": 20_000, "global_batch_size": global_batch_size, "seq_len": 32,
                     "model": {"d_model": 64, "n_layers": 2, "n_heads": 4, "d_ff": 128, "vocab_size": 256}},
        "checkpoint": {"interval_steps": INTERVAL_STEPS, "directory": "/tmp/ckpt-auto"},
        "autoscaling": {"accelerators": ["v4-16", "v4-32"], "tiers": ["spot", "on-demand"], "max_slices": max_slices},
        "deadline": "P3D",
    })
    store.create_job("auto", "auto", spec.model_dump(mode="json"), at=T0)
    store.transition("auto", JobState.PROVISIONING, "requesting v4-16 (spot)", at=T0)
    store.import_event("auto", "slice", "slice s1 READY", {"name": "s1", "accelerator": "v4-16", "chips": 8,
                                                         "tier": "spot", "state": "READY"}, at=T0 + 60)
    store.transition("auto", JobState.STARTING, "ready", data=StateChange(provision_s=60.0, slice="s1"), at=T0 + 60)
    store.import_event("auto", "launched", "2 workers", {"slice": "s1", "nodes": ["a", "b"], "generation": 1},
                    at=T0 + 61)
    store.transition("auto", JobState.RUNNING, "joined", data=StateChange(init_s=5.0, generation=1), at=T0 + 70)
    store.import_event("auto", "restore", "fresh", {"restore_s": 10.0, "compile_s": 20.0, "restored_step": None},
                    at=T0 + 100)
    store.record_steps("auto", 1, [(k, 3.0, 1000.0, STEP_S) for k in range(10)], at=T0 + 120)
    for i, blocking in enumerate(saves):
        store.import_event("auto", "checkpoint", "saved", {"step": 5 + i, "blocking_s": blocking}, at=T0 + 121 + i)
    for i in range(preemptions):  # spot slices reclaimed (no notice): each a preemption
        lost_slice(store, f"p{i}", "spot", at=T0 + 130 + i)
    return "auto"


def lost_slice(store: Store, name: str, tier: str, *, at: float, job_id: str = "auto") -> None:
    """A v4-16 slice that came up and was lost without being released: a reclaim on spot, a
    host loss on on-demand."""
    for state in ("REQUESTED", "READY", "GONE"):
        store.import_event(job_id, "slice", f"slice {name} {state}", {"name": name, "accelerator": "v4-16",
                                                                     "chips": 8, "tier": tier, "state": state}, at=at)


def test_restart_cost_and_save_time_come_from_the_job(tmp_path):
    store = Store(tmp_path / "db.sqlite")
    job_id = _job(store, 0, saves=[0.5, 0.7, 9.0])
    assert step_seconds(store.steps(job_id)) == STEP_S
    snap = snapshot(store, job_id, now=T0 + 200, current=("v4-16", "spot"), spot_chips_available=8)
    assert snap.restart.provisioning_s == 60.0
    assert snap.restart.startup_s == pytest.approx(35.0)  # init 5 + restore 10 + compile 20
    assert snap.restart.save_s == 0.7  # the median of what the saves blocked
    assert snap.restart.checkpoint_interval_s == INTERVAL_STEPS * STEP_S
    # Its spot v4-16 (8 chips) has been up since T0 + 60: the policy sees that capacity.
    assert snap.availability.fraction("default", 8) > snap.availability.prior_fraction
    assert snap.availability.counts[("default", 8)].observed_h == pytest.approx(140 / 3600)


def test_checkpoint_interval_shrinks_with_the_hazard_and_never_exceeds_the_spec(tmp_path):
    calm, stormy = Store(tmp_path / "calm.sqlite"), Store(tmp_path / "stormy.sqlite")
    every = {}
    for name, store, preemptions in (("calm", calm, 0), ("stormy", stormy, 40)):
        job_id = _job(store, preemptions, saves=[DEFAULT_SAVE_S] * 3)
        choice = decide_for(store, job_id, now=T0 + 200, current=("v4-16", "spot"), spot_chips_available=16)
        assert choice is not None and choice.checkpoint_interval_steps is not None
        assert 1 <= choice.checkpoint_interval_steps <= INTERVAL_STEPS
        every[name] = choice.checkpoint_interval_steps
        if choice.tier == "spot":  # the steps are the policy's seconds at the measured step time
            assert choice.checkpoint_interval_steps == round(choice.decision.checkpoint_interval_s / STEP_S)
    assert every["stormy"] < every["calm"]
    # Lost on-demand hosts are no spot preemptions: the hazard is the calm job's.
    hosts_lost = Store(tmp_path / "hosts.sqlite")
    _job(hosts_lost, 0, saves=[DEFAULT_SAVE_S] * 3)
    for i in range(40):
        lost_slice(hosts_lost, f"d{i}", "on-demand", at=T0 + 130 + i)
    snap = snapshot(hosts_lost, "auto", now=T0 + 200, current=("v4-16", "spot"), spot_chips_available=16)
    calm_snap = snapshot(calm, "auto", now=T0 + 200, current=("v4-16", "spot"), spot_chips_available=16)
    assert snap.hazard == calm_snap.hazard
    assert decide_for(hosts_lost, "auto", now=T0 + 200, current=("v4-16", "spot"),
                      spot_chips_available=16).checkpoint_interval_steps == every["calm"]
    # The launch uses the policy's interval; the stored spec keeps the user's.
    spec = stormy.job("auto").spec
    launched = with_checkpoint_interval(spec, Choice("v4-16", "spot", choice.decision, every["stormy"]))
    assert launched.checkpoint.interval_steps == every["stormy"] and spec.checkpoint.interval_steps == INTERVAL_STEPS
    assert launched.checkpoint.directory == spec.checkpoint.directory
    assert with_checkpoint_interval(spec, Choice("v4-16", "spot", choice.decision, None)) is spec


def test_young_daly_interval():
    r = RestartCost(checkpoint_interval_s=3600, save_s=10)
    assert r.interval_s(0.0) == 3600  # never preempted: the job's own interval
    assert r.interval_s(2.0) == pytest.approx((2 * 10 * 1800) ** 0.5)  # sqrt(2 x save x mean time between)
    assert r.interval_s(1e4) == 60  # never below a minute
    # the chosen interval is the cheapest: time lost to saves and lost work is least there
    best = r.lost_fraction(2.0)
    for other in (60, 120, 400, 1200):
        lost = 2.0 / 3600 * (r.overhead_s + other / 2) + r.save_s / other
        assert best <= lost + 1e-12
    assert r.train_s(3600 * 100, 100, 0.0) == 3600  # one interval of training: no save on the way
    assert r.train_s(3600 * 100 * 2.5, 100, 0.0) == 2.5 * 3600 + 2 * 10


def test_spot_capacity_is_learned_from_the_jobs_own_slices(tmp_path):
    store = Store(tmp_path / "db.sqlite")
    store.create_job("j", "j", {}, at=T0)

    def slice_event(at, name, chips, state, tier="spot"):
        store.import_event("j", "slice", f"{name} {state}",
                           {"name": name, "chips": chips, "tier": tier, "state": state}, at=at)

    hour = 3600.0
    slice_event(T0, "a", 16, "REQUESTED")
    slice_event(T0, "a", 16, "WAITING")  # 3 h without a 16-chip spot slice
    slice_event(T0 + 3 * hour, "a", 16, "READY")  # then 1 h up
    slice_event(T0 + 4 * hour, "a", 16, "PREEMPTING")
    slice_event(T0 + 4 * hour + 30, "a", 16, "GONE")
    slice_event(T0 + 5 * hour, "b", 8, "READY", tier="on-demand")  # on-demand says nothing of spot
    seen = spot_availability(store.events("j"), now=T0 + 6 * hour, sizes=[8, 16, 32])
    prior = seen.prior_fraction
    # 16 chips: 1 h up of 4 h seen; 32 chips: never up while 16 waited; 8 chips: up for that hour
    assert seen.fraction("default", 16) < prior and seen.fraction("default", 32) < seen.fraction("default", 16)
    assert seen.fraction("default", 8) > prior
    up_h, _ = seen.uptime_h("default", 16)
    assert up_h < seen.prior_uptime_h  # one period of 1 h seen, against the prior's 4 h
    assert spot_availability([], now=T0, sizes=[8, 16, 32]).fraction("default", 16) == prior


def test_spot_capacity_the_zone_refused_lately_is_not_counted_on(tmp_path):
    store = Store(tmp_path / "db.sqlite")
    job_id = _job(store, 0, saves=[DEFAULT_SAVE_S] * 3)  # its v4-16 spot slice (8 chips) is up since T0 + 60

    def refused(at, name, chips):  # a spot slice that waited in the queue for 5 min, then was let go
        for dt, state in ((0, "REQUESTED"), (1, "WAITING"), (300, "RELEASED")):
            store.import_event(job_id, "slice", f"{name} {state}",
                               {"name": name, "accelerator": "v4-32", "chips": chips, "tier": "spot", "state": state},
                               at=at + dt)

    refused(T0 + 1000, "big", 16)
    gone = T0 + 1300  # when the refused slice was let go

    def now_chips(now):
        return snapshot(store, job_id, now=now, current=("v4-16", "spot"), spot_chips_available=16).spot_chips_available

    assert now_chips(T0 + 900) == 16  # before the refusal: all the provider allows
    assert now_chips(gone + 60) == 8  # v4-32 spot was refused a minute ago; v4-16 spot is up
    assert now_chips(gone + REFUSAL_HOLDS_S + 1) == 16  # long enough ago: worth asking again
    # Nothing of any allowed size left: a refusal of the smallest one, with no spot slice up since.
    events = [e for e in store.events(job_id) if not (e.kind == "slice" and e.data["name"] == "s1")]
    assert spot_chips_now(events, now=gone + 60, largest=16, sizes=[8, 16]) == 8  # 8 chips were not refused
    refused(T0 + 1100, "small", 8)
    events = [e for e in store.events(job_id) if not (e.kind == "slice" and e.data["name"] == "s1")]
    assert spot_chips_now(events, now=gone + 200, largest=16, sizes=[8, 16]) == 0
    # A spot slice up since a refusal says its size can be had, whatever was refused before.
    assert spot_chips_now(store.events(job_id), now=gone + 200, largest=16, sizes=[8, 16]) == 8


def test_slice_counts_are_options_up_to_max_slices_and_a_count_the_job_ran_on_is_priced_as_measured(tmp_path):
    """`autoscaling.max_slices` 2: the policy also weighs 2 x each type (within 32 chips, the batch split
    over them, a mesh for each slice's share); the job's 10 steps on one v4-16 price one slice, and once
    it ran on 2 slices (a generation launched on both, 3 steps measured at 4 s), 2 x v4-16 is priced at
    that measured speed, not the model's."""
    store = Store(tmp_path / "db.sqlite")
    job_id = _job(store, 0, saves=[], max_slices=2)
    snap = snapshot(store, job_id, now=T0 + 200, current=("v4-16", "spot", 1), spot_chips_available=16)
    labels = sorted(o.label for o in snap.options)
    # Not 2 x v4-32: each slice's 8 rows of the 16 have no mesh on its 16 devices.
    assert labels == sorted(["v4-16 spot", "v4-16 on-demand", "v4-32 spot", "v4-32 on-demand",
                             "2xv4-16 spot", "2xv4-16 on-demand"])
    one = next(o for o in snap.options if o.label == "v4-16 spot")
    two = next(o for o in snap.options if o.label == "2xv4-16 spot")
    assert snap.current == one
    tokens_per_step = 16 * 32
    assert one.tokens_per_s == pytest.approx(tokens_per_step / STEP_S)
    assert one.tokens_per_s < two.tokens_per_s <= 2 * one.tokens_per_s  # the scaling model: DCN costs a little

    store.import_event(job_id, "launched", "4 workers", {"slice": "s1", "nodes": ["a", "b", "c", "d"],
                                                        "generation": 2, "slices": 2}, at=T0 + 300)
    store.record_steps(job_id, 2, [(k, 3.0, 1000.0, 4.0) for k in range(10, 13)], at=T0 + 320)
    snap = snapshot(store, job_id, now=T0 + 400, current=("v4-16", "spot", 2), spot_chips_available=16)
    two = next(o for o in snap.options if o.label == "2xv4-16 spot")
    assert snap.current == two and two.count == 2
    assert two.tokens_per_s == pytest.approx(tokens_per_step / 4.0)  # as measured: slower than one slice here
    assert next(o for o in snap.options if o.label == "v4-16 spot").tokens_per_s == pytest.approx(
        tokens_per_step / STEP_S)  # one slice keeps its own measurement


def test_counts_the_batch_does_not_split_over_are_left_out(tmp_path):
    store = Store(tmp_path / "db.sqlite")
    job_id = _job(store, 0, saves=[], max_slices=4, global_batch_size=32)
    counts = {o.count for o in snapshot(store, job_id, now=T0 + 200, current=None, spot_chips_available=16).options}
    assert counts == {1, 2, 4}  # 32 rows split over 2 or 4 slices, not over 3
