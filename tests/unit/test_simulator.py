"""The trace simulator, the baselines and the hindsight lower bound (fast: small jobs, short traces)."""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest

from policies.cost.policy import CostPolicy
from policies.cost.restart_cost import RestartCost
from policies.cost.slice_options import ON_DEMAND, SPOT, Option
from policies.evaluation.baselines import FixedPolicy, GreedyPolicy
from policies.evaluation.hindsight import IDLE, _DualProgramme, hindsight_optimum
from policies.evaluation.simulator import SimJob, quantized_restart, simulate, step_seconds
from policies.evaluation.traces import (
    FOUR_NODE_MAPPING,
    ONE_NODE_MAPPING,
    TRACE_ROOT,
    SpotTrace,
    bundled_traces,
    constant_trace,
    markov_trace,
)

# v4 sizes with the benchmark's scaling-model speeds and catalog prices.
SPEED = {8: 143_453.0, 16: 269_691.0, 32: 507_019.0}
HOSTS = {8: 2, 16: 4, 32: 8}


def option(chips: int, tier: str) -> Option:
    per_chip = 0.92 if tier == SPOT else 3.22
    return Option(f"v4-{2 * chips}", chips, HOSTS[chips], tier, per_chip * chips, SPEED[chips])


SPOT32, OD32 = option(16, SPOT), option(16, ON_DEMAND)
ALL = tuple(option(c, t) for c in (8, 16, 32) for t in (SPOT, ON_DEMAND))


def small_job(ondemand_hours: float = 3.0, slack: float = 1.75, options=ALL) -> SimJob:
    tokens = SPEED[16] * 3600 * ondemand_hours
    return SimJob(tokens, slack * ondemand_hours * 3600, options)


def trace_of(counts, gap_s: float = 300.0, nodes: int = 1) -> SpotTrace:
    return SpotTrace("test", gap_s, tuple(counts), nodes)


SYNTHETIC = [markov_trace(mean_up_h=up, mean_down_h=down, hours=48, seed=seed)
             for up, down, seed in [(4, 2, 0), (1, 1, 1), (0.5, 3, 2), (8, 0.5, 3)]]


def test_bundled_traces_load_with_attribution():
    traces = bundled_traces()
    assert len(traces) == 24
    assert all(t.gap_s > 0 and len(t.counts) > 1000 for t in traces)
    assert {t.nodes for t in traces} == {1, 4}
    readme = (TRACE_ROOT / "README.md").read_text()
    assert "Can't Be Late" in readme and "skypilot-org/spot-traces" in readme


def test_capacity_mapping_and_wraparound():
    assert [FOUR_NODE_MAPPING.chips(n) for n in range(5)] == [0, 8, 16, 16, 32]
    assert [ONE_NODE_MAPPING.chips(n) for n in range(2)] == [0, 16]
    trace = trace_of([0, 1, 2, 4], gap_s=100, nodes=4)
    assert list(trace.capacity_chips(0, 50, 10)) == [0, 0, 8, 8, 16, 16, 32, 32, 0, 0]  # wraps after 400 s


def test_step_splits_the_tick_evenly():
    assert step_seconds(trace_of([1], gap_s=600)) == 60
    assert step_seconds(trace_of([1], gap_s=195)) == 48.75
    assert step_seconds(trace_of([1], gap_s=32)) == 32


def test_no_preemptions_costs_exactly_spot_price_times_time():
    job = small_job()
    trace = constant_trace(1, gap_s=300, ticks=200)
    run = simulate(FixedPolicy(SPOT32), job, trace)
    restart = quantized_restart(RestartCost(), step_seconds(trace))
    train_s = restart.train_s(job.total_tokens, SPOT32.tokens_per_s)
    assert train_s == job.total_tokens / SPOT32.tokens_per_s + 17 * restart.save_s  # 3 h: a save every 10 min
    assert run.preemptions == 0 and run.tokens_lost == 0
    assert run.finish_s == pytest.approx(restart.overhead_s + train_s)
    billed_s = restart.startup_s + train_s  # provisioning is not billed
    assert run.cost_usd == pytest.approx(SPOT32.usd_per_hour * billed_s / 3600, rel=1e-12)
    assert run.billed_s == {SPOT32.label: pytest.approx(billed_s)}


@pytest.mark.parametrize("trace", SYNTHETIC, ids=lambda t: t.name)
@pytest.mark.parametrize("make_policy", [lambda: CostPolicy(), lambda: FixedPolicy(SPOT32),
                                         lambda: GreedyPolicy(SPOT32, OD32)], ids=["policy", "spot", "greedy"])
def test_work_is_conserved(trace, make_policy):
    job = small_job()
    run = simulate(make_policy(), job, trace)
    assert run.finish_s is not None
    assert run.tokens_trained == pytest.approx(job.total_tokens + run.tokens_lost, rel=1e-9)
    # nothing is trained for free: at least the cheapest price per token was paid
    assert run.cost_usd >= job.total_tokens * min(o.usd_per_token for o in ALL)


def test_preemption_loses_the_work_since_the_last_checkpoint():
    # spot for 35 minutes, gone for an hour, then back: 6 min of overhead, 29 min of
    # running with checkpoints after 10 and 20 min of training (each pausing it for
    # save_s), so the last 9 min less two saves are lost and trained again.
    trace = trace_of([1] * 7 + [0] * 12 + [1] * 200, gap_s=300)
    job = small_job(ondemand_hours=1, slack=10)
    run = simulate(FixedPolicy(SPOT32), job, trace)
    restart = quantized_restart(RestartCost(), step_seconds(trace))
    trained_s = 35 * 60 - restart.overhead_s - 2 * restart.save_s
    lost_s = trained_s - 2 * restart.checkpoint_interval_s
    assert run.preemptions == 1 and run.slices_started == 2
    assert run.tokens_lost == pytest.approx(SPOT32.tokens_per_s * lost_s)
    second_start = (35 + 60) * 60
    left_s = restart.train_s(job.total_tokens - SPOT32.tokens_per_s * (trained_s - lost_s), SPOT32.tokens_per_s)
    assert run.finish_s == pytest.approx(second_start + restart.overhead_s + left_s)


def test_the_decisions_checkpoint_interval_is_used():
    # The same preemption as above, under a policy that checkpoints every 2 minutes:
    # less work is lost, and each save pauses training for save_s.
    @dataclasses.dataclass(frozen=True)
    class Often:
        name: str = "often"

        def decide(self, snap):
            d = FixedPolicy(SPOT32).decide(snap)
            return dataclasses.replace(d, checkpoint_interval_s=120.0)

    trace = trace_of([1] * 7 + [0] * 12 + [1] * 200, gap_s=300)
    job = small_job(ondemand_hours=1, slack=10)
    restart = quantized_restart(RestartCost(), step_seconds(trace))
    run = simulate(Often(), job, trace)
    slice_s = 35 * 60 - restart.overhead_s  # 29 min: trains 120 s, saves 5 s, ...
    saves = int(slice_s // (120 + restart.save_s))
    trained_s = slice_s - saves * restart.save_s
    assert run.tokens_lost == pytest.approx(SPOT32.tokens_per_s * (trained_s - saves * 120))
    assert run.tokens_lost < simulate(FixedPolicy(SPOT32), job, trace).tokens_lost / 4  # 115 s against 530 s


def test_ondemand_baseline_is_deterministic():
    job = small_job()
    run = simulate(FixedPolicy(OD32), job, SYNTHETIC[0])
    restart = quantized_restart(RestartCost(), step_seconds(SYNTHETIC[0]))
    train_s = restart.train_s(job.total_tokens, OD32.tokens_per_s)
    assert run.cost_usd == pytest.approx(OD32.usd_per_hour * (restart.startup_s + train_s) / 3600)
    assert run.deadline_met


def test_greedy_switches_to_ondemand_when_slack_runs_out():
    trace = trace_of([0] * 500)  # spot never comes
    job = small_job()
    run = simulate(GreedyPolicy(SPOT32, OD32), job, trace)
    assert run.deadline_met and set(run.billed_s) == {OD32.label}
    assert run.decisions[0].option == OD32.label and run.decisions[0].at_s > 0


@pytest.mark.parametrize("trace", SYNTHETIC + [constant_trace(1, gap_s=300, ticks=100)], ids=lambda t: t.name)
def test_optimum_is_never_dearer_than_any_run_that_meets_the_deadline(trace):
    job = small_job()
    best = hindsight_optimum(job, trace)
    assert best.feasible and best.lower_bound_usd <= best.schedule_cost_usd + 1e-9
    assert best.schedule_finish_s <= job.deadline_s + step_seconds(trace)
    policies = [CostPolicy(), FixedPolicy(OD32), FixedPolicy(SPOT32), GreedyPolicy(SPOT32, OD32)]
    policies += [FixedPolicy(o) for o in ALL]
    for policy in policies:
        run = simulate(policy, job, trace)
        if run.deadline_met:
            assert best.lower_bound_usd <= run.cost_usd + 1e-9, policy


def test_optimum_on_a_bundled_trace_window():
    trace = next(t for t in bundled_traces() if "4-node" in t.name)
    job = small_job()
    best = hindsight_optimum(job, trace, start_s=86_400)
    for policy in (CostPolicy(), GreedyPolicy(SPOT32, OD32), FixedPolicy(OD32)):
        run = simulate(policy, job, trace, start_s=86_400)
        assert not run.deadline_met or best.lower_bound_usd <= run.cost_usd
    assert best.schedule_cost_usd <= 1.05 * best.lower_bound_usd  # the bracket is tight


def test_infeasible_deadline_is_reported():
    job = small_job(slack=0.5)  # not even on-demand v4-64 can make it
    assert not hindsight_optimum(job, SYNTHETIC[0]).feasible


def _exact_optimum(dp: _DualProgramme, units_per_step: list[int], target_units: int) -> float:
    """Brute force over (state, progress in integer units) for a tiny instance."""
    k = dp.k
    frontier = {(IDLE, 0): 0.0}
    best = math.inf
    for _t, usable in enumerate(dp.usable):
        moved: dict[tuple[int, int], float] = {}
        for (state, done), cost in frontier.items():
            choices = {state, IDLE} | {c * (k + 1) + k for c in range(len(usable))}
            for s in choices:
                if s != IDLE and not usable[s // (k + 1)]:
                    continue
                if s == IDLE:
                    nxt, step_cost, gained = IDLE, 0.0, 0
                else:
                    c, j = divmod(s, k + 1)
                    nxt = s if j == 0 else s - 1
                    step_cost = dp.price[c] if (j == 0 or j <= dp.startup) else 0.0
                    gained = units_per_step[c] if j == 0 else 0
                total = min(done + gained, target_units)
                if total >= target_units:
                    best = min(best, cost + step_cost)
                    continue
                key = (nxt, total)
                if cost + step_cost < moved.get(key, math.inf):
                    moved[key] = cost + step_cost
        frontier = moved
    return best


@pytest.mark.parametrize("seed", range(4))
def test_lower_bound_brackets_the_exact_optimum_on_tiny_instances(seed):
    # Speeds of 1 and 2 units per step make the exact problem small enough to enumerate.
    rng = np.random.default_rng(seed)
    unit, dt = 1e6, 60.0
    options = (Option("small", 8, 2, SPOT, 7.36, unit / dt), Option("small", 8, 2, ON_DEMAND, 25.76, unit / dt),
               Option("big", 16, 4, SPOT, 14.72, 2 * unit / dt), Option("big", 16, 4, ON_DEMAND, 51.52, 2 * unit / dt))
    counts = tuple(int(c) for c in rng.choice([0, 1, 2], size=40, p=[0.4, 0.3, 0.3]))
    trace = SpotTrace("tiny", dt, counts, 4)
    restart = RestartCost(provisioning_s=60, startup_s=60, checkpoint_interval_s=600)
    job = SimJob(30 * unit, 40 * dt, options)
    best = hindsight_optimum(job, trace, restart=restart)
    # The bound relaxes the simulator: provisioning takes no time (a slice trains while the next one
    # provisions), so the exact optimum to bracket is the one without it.
    dp = _DualProgramme(options, trace.capacity_chips(0, dt, 40), dt, 0, 1)
    exact = _exact_optimum(dp, [1, 1, 2, 2], 30)
    assert best.lower_bound_usd <= exact + 1e-9 and exact <= best.schedule_cost_usd + 1e-9
    for policy in [CostPolicy(), *(FixedPolicy(o) for o in options)]:
        run = simulate(policy, job, trace, restart=restart)
        assert not run.deadline_met or exact <= run.cost_usd + 1e-9


def test_dp_schedules_are_consistent_paths():
    """Every schedule the optimum builds moves between states only as the model allows."""
    trace = SYNTHETIC[1]
    job = small_job()
    dt = step_seconds(trace)
    dp = _DualProgramme(job.options, trace.capacity_chips(0, dt, 400), dt, 2, 4)
    per_token = min(o.usd_per_token for o in job.options)
    for mu, other in itertools.product([per_token * 1.1, per_token * 4], [per_token * 2]):
        a, b = dp.path(mu), dp.path(other)
        for held in (a, b, dp.splice_to_target(a, b, job.total_tokens), dp.fill(a, 1, job.total_tokens)):
            _assert_consistent(dp, held)


def _assert_consistent(dp: _DualProgramme, held: np.ndarray) -> None:
    k, previous = dp.k, IDLE
    for t, state in enumerate(held):
        if state != IDLE:
            c, j = divmod(int(state), k + 1)
            assert dp.usable[t, c], f"step {t}: option {c} not usable"
            if j < k:  # not a fresh request: must continue the previous step's slice
                assert previous != IDLE and previous // (k + 1) == c
                assert previous % (k + 1) in ((j + 1,) if j > 0 else (0, 1))
        previous = state


def test_knowledge_of_its_own_slices_only_queues_and_learns_refusals():
    """With knowledge "own" the policy is not shown the zone's capacity: it assumes spot is
    there until a request waits out the queue's timeout, then sees that size refused."""
    @dataclasses.dataclass
    class AlwaysSpot:
        name: str = "always spot"
        seen: list = dataclasses.field(default_factory=list)

        def decide(self, snap):
            self.seen.append((snap.now_s, snap.spot_chips_available))
            return FixedPolicy(SPOT32).decide(dataclasses.replace(snap, spot_chips_available=SPOT32.chips))

    trace = trace_of([0] * 12 + [1] * 200, gap_s=300)  # no spot for the first hour
    job = small_job(ondemand_hours=1, slack=10, options=(SPOT32, OD32))
    knows, learns = AlwaysSpot(), AlwaysSpot()
    fed = simulate(knows, job, trace)
    own = simulate(learns, job, trace, knowledge="own", queue_timeout_s=900.0)
    assert knows.seen[0] == (0.0, 0)  # a capacity feed shows none at once
    # Its own slices show nothing at first: spot is assumed there, and the request queues; from
    # then on the waiting request says that size is missing, until it is filled and READY.
    assert learns.seen[:3] == [(0.0, 16), (300.0, 0), (600.0, 0)]
    assert (3720.0, 16) in learns.seen  # READY after 2 min of provisioning: the policy is asked, and switches
    assert own.refusals == 0
    states = [(r.at_s, r.state) for r in own.records if r.name == "s1"]
    assert states[:4] == [(0.0, "REQUESTED"), (0.0, "WAITING"), (3600.0, "PROVISIONING"), (3720.0, "READY")]
    # Queued time is not billed; the slice starts when capacity comes, as with the feed.
    assert own.cost_usd == pytest.approx(fed.cost_usd) and own.finish_s == pytest.approx(fed.finish_s)
    assert own.slices_started == fed.slices_started == 1
    with pytest.raises(ValueError, match="knowledge"):
        simulate(knows, job, trace, knowledge="oracle")


def test_a_spot_request_queued_beside_the_running_slice_keeps_the_job_training():
    """Make-before-break: the on-demand slice trains on while the spot request waits in the
    queue (it waits while the policy wants it), and the job switches when the spot slice is
    READY; release_first=True (the older way) gives the on-demand slice up first and idles
    while the request waits."""
    @dataclasses.dataclass(frozen=True)
    class OnDemandThenSpot:
        name: str = "on-demand, then spot"

        def decide(self, snap):
            target = OD32 if snap.now_s < 300 else SPOT32
            return FixedPolicy(target).decide(dataclasses.replace(snap, spot_chips_available=SPOT32.chips))

    trace = trace_of([0] * 12 + [1] * 200, gap_s=300)  # spot comes after an hour
    job = small_job(ondemand_hours=2, slack=10, options=(SPOT32, OD32))
    first = simulate(OnDemandThenSpot(), job, trace, knowledge="own", queue_timeout_s=900.0, release_first=True)
    beside = simulate(OnDemandThenSpot(), job, trace, knowledge="own", queue_timeout_s=900.0)
    assert first.billed_s[OD32.label] < 600 < 3000 < beside.billed_s[OD32.label]
    assert beside.finish_s < first.finish_s
    restart = quantized_restart(RestartCost(), step_seconds(trace))
    ready = 3600.0 + restart.provisioning_s  # capacity at 60 min, then provisioning
    assert [(d.option, d.move) for d in beside.decisions] == [
        (OD32.label, f"request {OD32.label}"), (OD32.label, f"switch {OD32.label}"),
        (SPOT32.label, f"request beside {SPOT32.label}"), (SPOT32.label, f"switch {SPOT32.label}")]
    assert beside.decisions[3].at_s == pytest.approx(ready)
    # the old slice is released only when the new one is READY, and trained until then
    spot_ready = next(r.at_s for r in beside.records if r.name == "s2" and r.state == "READY")
    od_released = next(r.at_s for r in beside.records if r.name == "s1" and r.state == "RELEASED")
    assert spot_ready == od_released == pytest.approx(ready)
    assert beside.billed_s[OD32.label] == pytest.approx(ready - restart.provisioning_s)
    assert beside.tokens_lost == 0 and beside.slices_started == 2 and beside.refusals == 0
