"""The cost-aware policy (pure decisions on snapshots) and the planning glue around it."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from orchestrator.domain.options import job_options
from orchestrator.user.planning import plan_job, plan_text, render_plan
from policies.cost.fluid_plan import fluid_plan, plan_inputs
from policies.cost.moves import next_move
from policies.cost.policy import CostPolicy, decide
from policies.cost.restart_cost import RestartCost
from policies.cost.slice_options import ON_DEMAND, RESERVED, SPOT, Option, ScalingModel, estimate_tokens_per_s
from policies.cost.snapshot import Snapshot
from policies.cost.spot_estimates import SpotAvailability, SpotHazard, spot_chips_known
from policies.evaluation.simulator import SimJob, simulate
from policies.evaluation.traces import SpotTrace, bundled_traces, markov_trace

OPTIONS = job_options(["v4-16", "v4-32", "v4-64"], ["spot", "on-demand"])
BY_LABEL = {o.label: o for o in OPTIONS}
SPOT16, SPOT32, SPOT64 = (BY_LABEL[f"v4-{n} spot"] for n in (16, 32, 64))
OD16, OD32, OD64 = (BY_LABEL[f"v4-{n} on-demand"] for n in (16, 32, 64))
RESTART = RestartCost()
HOUR = 3600.0


def snapshot(*, hours_left: float, tokens_left: float, capacity: int = 32, current: Option | None = None,
             options=OPTIONS, **extra) -> Snapshot:
    total = 20e9
    return Snapshot(now_s=0.0, deadline_s=hours_left * HOUR, total_tokens=total, tokens_done=total - tokens_left,
                    tokens_committed=total - tokens_left, options=tuple(options), spot_chips_available=capacity,
                    current=current, **extra)


def random_snapshots(n: int, seed: int = 0, options=OPTIONS):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        current = options[rng.integers(len(options))] if rng.random() < 0.6 else None
        capacity = int(rng.choice([0, 8, 16, 32]))
        if current is not None and current.preemptible and current.chips > capacity:
            current = None  # the simulator never shows a preempted slice as held
        yield snapshot(hours_left=float(rng.uniform(0.5, 60)), tokens_left=float(rng.uniform(0.1e9, 20e9)),
                       capacity=capacity, current=current, options=options,
                       current_ready_in_s=float(rng.choice([0.0, 200.0])) if current else 0.0)


def test_decisions_stay_inside_the_allowed_range_and_capacity():
    for snap in random_snapshots(300):
        d = decide(snap)
        assert d.option is None or d.option in snap.options
        if d.option is not None:
            assert 8 <= d.option.chips <= 32
            assert not d.option.preemptible or d.option.chips <= snap.spot_chips_available
        assert d.reason and math.isfinite(d.expected_cost_usd) and d.expected_cost_usd >= 0
        assert d.resize == (snap.current is not None and d.option != snap.current)


def test_a_cheaper_equal_option_is_never_passed_over():
    # A reservation on the same v4-32 at a lower price: same speed, never preempted.
    reserved = dataclasses.replace(OD32, tier=RESERVED, usd_per_hour=OD32.usd_per_hour * 0.7)
    options = (*OPTIONS, reserved)
    for snap in random_snapshots(200, seed=1, options=options):
        assert decide(snap).option != OD32
    # And a spot slice in a second zone that is cheaper but otherwise the same.
    cheap = dataclasses.replace(SPOT32, usd_per_hour=SPOT32.usd_per_hour * 0.8, name="v4-32b")
    for snap in random_snapshots(200, seed=2, options=(*OPTIONS, cheap)):
        assert decide(snap).option != SPOT32


def test_same_snapshot_same_decision():
    for snap in random_snapshots(20, seed=3):
        assert decide(snap) == decide(snap)


def test_loose_deadline_with_spot_available_runs_the_cheapest_spot_slice():
    d = decide(snapshot(hours_left=200, tokens_left=5e9, capacity=32))
    assert d.option == SPOT16  # cheapest per token; the deadline needs no speed


def test_loose_deadline_without_spot_waits():
    d = decide(snapshot(hours_left=200, tokens_left=5e9, capacity=0))
    assert d.option is None and d.reason.startswith("wait")


def test_tight_deadline_runs_faster():
    # 20B tokens in 24 h: a v4-16 (39 h) is far too slow, so the job moves to a bigger slice.
    d = decide(snapshot(hours_left=24, tokens_left=20e9, capacity=32, current=SPOT16))
    assert d.option is not None and d.option.chips > 8 and d.resize


def test_safety_net_switches_to_ondemand_when_slack_is_gone():
    left = OD64.tokens_per_s * 10 * HOUR  # 10 h of v4-64 work
    d = decide(snapshot(hours_left=10 + (RESTART.overhead_s + 300) / HOUR, tokens_left=left, capacity=32))
    assert d.option == OD64 and "safety net" in d.reason
    # 5 min of work left on an on-demand v4-32, 12 min to go: a restart on v4-64 would
    # not leave the margin, but the slice the job holds still finishes, so it stays
    d = decide(snapshot(hours_left=0.2, tokens_left=OD32.tokens_per_s * 300, capacity=32, current=OD32))
    assert d.option == OD32 and not d.resize and "safety net" in d.reason


def test_no_choice_that_finishes_late_however_little():
    # 20 min left, no spot, no slice held. On-demand v4-16 is the cheapest per token but
    # would finish 2 s after the deadline (restart, training, and the saves on the way);
    # the policy must pay for a faster slice instead (this once missed a deadline by 1.6 s).
    train_s = 20 * 60 - RESTART.overhead_s + 2.0
    tokens = OD16.tokens_per_s * (train_s - RESTART.save_s * 1)  # one save after 600 s of training
    assert RESTART.train_s(tokens, OD16.tokens_per_s) == pytest.approx(train_s)
    snap = snapshot(hours_left=20 / 60, tokens_left=tokens, capacity=0, decision_interval_s=60.0)
    d = decide(snap, safety_margin_s=0.0)  # no margin: only the finishing check stands in the way
    assert d.option is not None and d.option != OD16 and not d.option.preemptible


def test_plan_mixes_a_cheap_slow_on_demand_size_with_a_fast_one():
    # 10 h of v4-16 on-demand work in 8 h: v4-16 alone is too slow, v4-32 alone overpays.
    tokens = OD16.tokens_per_s * 10 * HOUR
    view = plan_inputs(snapshot(hours_left=8, tokens_left=tokens, capacity=0, options=(OD16, OD32)))
    plan = fluid_plan(view, 8 * HOUR, tokens)
    assert plan.feasible and plan.on_demand == OD16 and plan.on_demand_second == OD32
    on_16 = tokens - plan.on_demand_second_tokens
    # the time left after the first restart, less the saves, less the second restart
    window_s = ((8 * HOUR - RESTART.overhead_s) * (1 - RESTART.save_s / RESTART.checkpoint_interval_s)
                - RESTART.overhead_s)
    assert on_16 / OD16.tokens_per_s + plan.on_demand_second_tokens / OD32.tokens_per_s == pytest.approx(window_s)
    all_32 = tokens * OD32.usd_per_token + OD32.usd_per_hour * RESTART.startup_s / HOUR
    assert plan.cost_usd < all_32
    assert "on-demand v4-16 for" in plan.describe() and "on-demand v4-32 for" in plan.describe()


def test_policy_checkpoints_more_often_where_preemptions_are_frequent():
    stormy = SpotHazard().observe(SPOT, "default", host_hours=10, preemptions=40)
    calm = decide(snapshot(hours_left=200, tokens_left=5e9, capacity=32))
    busy = decide(snapshot(hours_left=200, tokens_left=5e9, capacity=32, hazard=stormy))
    assert calm.option.preemptible and busy.option.preemptible
    assert busy.checkpoint_interval_s < calm.checkpoint_interval_s <= RESTART.checkpoint_interval_s
    on_demand = decide(snapshot(hours_left=2, tokens_left=OD64.tokens_per_s * 1.5 * HOUR, capacity=0))
    assert not on_demand.option.preemptible and on_demand.checkpoint_interval_s == RESTART.checkpoint_interval_s


def test_bigger_spot_slice_becoming_available_can_trigger_a_resize():
    # Far behind schedule on spot v4-16 with a v4-64 on offer: move up.
    left = 16e9
    d = decide(snapshot(hours_left=14, tokens_left=left, capacity=32, current=SPOT16))
    assert d.resize and d.option is not None and d.option.chips > SPOT16.chips



def test_one_slice_at_a_time_a_waiting_request_is_traded_for_a_size_the_zone_can_give():
    # On on-demand v4-16, a request for spot v4-64 waits: the zone has not the chips now, so
    # only v4-32 spot may perhaps be had. One slice at a time a request is all or nothing, so
    # the waiting one is not kept (policy rule 3): the policy tries v4-32 spot, its plan still
    # waiting for v4-64 (kept with slice counts, where the plan gets part of a size as added
    # slices: `test_the_product_lets_few_requests_go_unfilled_on_a_trace_with_long_outages`).
    snap = snapshot(hours_left=10, tokens_left=14e9, capacity=16, current=OD16)
    for now_s in (0.0, 300.0):
        d = decide(dataclasses.replace(snap, now_s=now_s, waiting=SPOT64))
        assert d.option == SPOT32 and d.wait_for == SPOT64, (now_s, d.reason)
        move = next_move(d.option, held=OD16, waiting=SPOT64, wait_for=d.wait_for)
        assert move.release_waiting and move.request == SPOT32


def test_a_size_refused_again_and_again_is_asked_for_less_often():
    sizes, hold = [8, 16, 32], 600.0
    refusals = [(0.0, 32, False), (5000.0, 32, False), (10000.0, 32, False)]

    def known(now, seen=refusals):  # (what the records say as of `now`)
        return spot_chips_known(sizes, largest=32, seen=[x for x in seen if x[0] <= now], now=now, hold_s=hold,
                                max_hold_s=4 * hold)

    assert known(650.0) == 32  # one refusal holds `hold_s`
    assert known(5000.0 + 2 * hold - 60) == 16 and known(5000.0 + 2 * hold + 60) == 32  # the second twice that
    assert known(10000.0 + 4 * hold - 60) == 16 and known(10000.0 + 4 * hold + 60) == 32  # the third 4x (the most)
    # a slice of the size up in between: the count starts again
    assert known(10000.0 + hold + 60, [*refusals[:2], (7000.0, 32, True), refusals[2]]) == 32
    # a refusal of a smaller size says the larger one was missing too: it counts for both
    assert known(5000.0 + 2 * hold - 60, [(0.0, 16, False), (5000.0, 32, False)]) == 16
    # however long the record, a refusal holds at most `max_hold_s`
    assert known(2000.0 + 4 * hold + 60, [(float(t), 32, False) for t in range(2000)]) == 32


def test_the_product_lets_few_requests_go_unfilled_on_a_trace_with_long_outages():
    """The benchmark's job (`benchmarks/cost.py`) on the trace where the product let most
    requests go unfilled: 26 in this window when it traded waiting requests and probed the
    missing sizes every 10 minutes; at most half that now (10 when written)."""
    from benchmarks.cost import benchmark_job

    trace = next(t for t in bundled_traces() if t.name.endswith("aws-10-26-2022/us-west-2a_v100_8"))
    run = simulate(CostPolicy(name="product"), benchmark_job(), trace, knowledge="pooled")
    assert run.deadline_met and run.refusals <= 13, run.refusals


def test_budget_is_flagged():
    d = decide(snapshot(hours_left=40, tokens_left=20e9, capacity=16, budget_usd=50.0))
    assert not d.within_budget and "over budget" in d.reason


@pytest.mark.parametrize("seed", range(6))
def test_deadline_is_met_whenever_ondemand_could_meet_it(seed):
    """Adversarial and random capacity; deadlines from barely feasible on v4-64 to loose."""
    rng = np.random.default_rng(seed)
    tokens = float(rng.uniform(2e9, 12e9))
    fastest_h = (RESTART.overhead_s + 600) / HOUR + tokens / OD64.tokens_per_s / HOUR
    deadline_h = fastest_h * float(rng.uniform(1.0, 3.0))
    if seed % 2:  # spot that comes and goes in short bursts, the worst case for restarts
        counts = tuple(int(c) for c in (rng.random(2000) < 0.5))
        trace = SpotTrace("bursty", 120.0, counts, 1)
    else:
        trace = markov_trace(mean_up_h=float(rng.uniform(0.3, 6)), mean_down_h=float(rng.uniform(0.3, 6)),
                             hours=3 * deadline_h + 10, seed=seed)
    run = simulate(CostPolicy(), SimJob(tokens, deadline_h * HOUR, OPTIONS), trace)
    assert run.deadline_met, (deadline_h, run.hours)


def test_hazard_update_moves_the_estimate_the_right_way():
    prior = SpotHazard()
    base = prior.per_host_hour(SPOT, "z")
    after_preemption = prior.observe(SPOT, "z", host_hours=1.0, preemptions=1)
    quiet = prior.observe(SPOT, "z", host_hours=100.0)
    assert after_preemption.per_host_hour(SPOT, "z") > base > quiet.per_host_hour(SPOT, "z")
    assert prior.per_host_hour(SPOT, "other") == base  # zones are separate
    assert prior.per_host_hour(ON_DEMAND, "z") == 0.0
    lots = prior.observe(SPOT, "z", host_hours=10_000.0, preemptions=500)
    assert lots.per_host_hour(SPOT, "z") == pytest.approx(0.05, rel=0.01)  # evidence outweighs the prior
    in_z = dataclasses.replace(SPOT32, zone="z")
    assert lots.per_slice_hour(in_z) == pytest.approx(4 * lots.per_host_hour(SPOT, "z"))  # 4 hosts


def test_availability_estimate_learns_fraction_and_period_lengths():
    est = SpotAvailability()
    for _ in range(50):  # 1 h up, 3 h down, fifty times
        est = est.observe("z", [16], 16, HOUR).observe("z", [16], 0, 3 * HOUR)
    assert est.fraction("z", 16) == pytest.approx(0.25, abs=0.02)
    assert est.uptime_h("z", 16)[0] == pytest.approx(1.0, rel=0.1)
    assert est.outage_h("z", 16)[0] == pytest.approx(3.0, rel=0.05)
    assert est.outage_h("z", 16)[1] < 0.5  # regular periods: little variance
    assert est.fraction("z", 32) == SpotAvailability().fraction("z", 32)  # unseen size keeps its prior


def test_throughput_comes_from_measurements_once_seen():
    model = ScalingModel(7.2e9, 275e12)
    assert model.tokens_per_s(16, 4) > model.tokens_per_s(8, 2)
    assert model.tokens_per_s(16, 4) < 2 * model.tokens_per_s(8, 2)  # scaling costs something
    measured = {(16, 4): 0.8 * model.tokens_per_s(16, 4)}
    assert estimate_tokens_per_s(model, 16, 4, measured) == measured[(16, 4)]
    assert estimate_tokens_per_s(model, 32, 8, measured) == pytest.approx(0.8 * model.tokens_per_s(32, 8))


def test_job_options_come_from_the_catalog():
    assert SPOT32.usd_per_hour == pytest.approx(16 * 0.92)
    assert OD32.usd_per_hour == pytest.approx(16 * 3.22)
    assert (SPOT16.chips, SPOT16.hosts, SPOT64.chips, SPOT64.hosts) == (8, 2, 32, 8)
    measured = job_options(["v4-32"], ["spot"], measured_tokens_per_s={"v4-32": 1e5})
    assert measured[0].tokens_per_s == 1e5


def test_plan_job_and_render_plan():
    plan = plan_job(tpu_types=["v4-16", "v4-32"], tiers=["spot", "on-demand"], total_tokens=2e9,
                    deadline_hours=6, budget_usd=100, windows=3)
    assert [o.label for o in plan.options] == ["v4-16 spot", "v4-16 on-demand", "v4-32 spot", "v4-32 on-demand"]
    on_demand = next(o for o in plan.options if o.label == "v4-32 on-demand")
    assert on_demand.deadline_miss_risk == 0 and on_demand.expected_hours < 6
    assert plan.policy.deadline_miss_risk == 0
    assert plan.policy.expected_cost_usd < on_demand.expected_cost_usd
    assert plan.policy_moves and plan.policy_moves[0].reason
    text = plan_text(plan)
    assert "v4-32 on-demand" in text and "cost policy" in text and "miss risk" in text
    assert render_plan(plan).row_count == 5


def test_plan_shows_no_cost_or_budget_verdict_for_an_option_that_never_finishes(tmp_path):
    # A zone whose spot capacity never reaches 32 chips: v4-64 spot never starts.
    trace = tmp_path / "trace.json"
    trace.write_text('{"metadata": {"gap_seconds": 600}, "data": [1, 1, 0, 1, 1, 1, 0, 0, 1, 1]}')
    plan = plan_job(tpu_types=["v4-32", "v4-64"], tiers=["spot", "on-demand"], total_tokens=2e9,
                    deadline_hours=6, budget_usd=1e6, trace_path=trace, windows=2)
    never = next(o for o in plan.options if o.label == "v4-64 spot")
    assert never.expected_hours is None and never.deadline_miss_risk == 1 and never.within_budget is None
    row = next(line for line in plan_text(plan).splitlines() if "v4-64 spot" in line)
    assert "unfinished" in row and "$" not in row and "ok" not in row
    assert next(o for o in plan.options if o.label == "v4-32 on-demand").within_budget is True


def test_a_grow_chosen_when_requested_is_still_chosen_once_its_slices_are_ready():
    # A job that cannot make its deadline on one on-demand v4-16 asks for a second beside it. The
    # added slice provisions while the first trains on; once it is READY the same choice must
    # still stand, or the request was made for nothing (the controller let it go at READY when the
    # choice at the request counted only the grow's pause, not the provisioning before it).
    singles = job_options(["v4-16"], ["spot", "on-demand"])
    od1 = next(o for o in singles if not o.preemptible)

    def two(o: Option) -> Option:
        return dataclasses.replace(o, count=2, tokens_per_s=o.tokens_per_s * 1.9, usd_per_hour=o.usd_per_hour * 2)

    od2, options = two(od1), (*singles, *(two(o) for o in singles))
    provisioning = RESTART.provisioning_s
    grows = 0
    for i in range(1, 60):
        work = od1.tokens_per_s * i * 36.0  # i hundredths of an hour of work on one slice
        hours = i * 0.007
        asked = decide(snapshot(hours_left=hours, tokens_left=work, capacity=0, current=od1, options=options))
        if asked.option != od2:
            continue
        grows += 1
        later = dict(hours_left=hours - provisioning / HOUR, tokens_left=work - od1.tokens_per_s * provisioning)
        ready = decide(snapshot(**later, capacity=0, current=od1, options=options, ready=od2))
        assert ready.option == od2, (i, asked.reason, ready.reason)
    assert grows >= 10  # the grow is chosen over a range of work, not at one edge only
