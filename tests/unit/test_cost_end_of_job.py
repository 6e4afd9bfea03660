"""The cost policy near its safety net (issue 38, rules 6-8 of `policies.cost.policy`): no spot
asked for that the net would call back before it pays, no on-demand slice given up to wait for
spot the net would not wait for, and no on-demand count traded for one no faster and no cheaper."""

from __future__ import annotations

import pytest

from benchmarks.cost import benchmark_job
from orchestrator.domain.options import job_options
from policies.cost.policy import (
    _dominated_on_demand_move,
    _spot_pays_before_net,
    _wait_pays_before_net,
    decide,
)
from policies.cost.restart_cost import RestartCost
from policies.cost.snapshot import Snapshot, slice_hazard_per_hour
from policies.cost.spot_estimates import SpotAvailability

OPTIONS = job_options(["v4-16", "v4-32", "v4-64"], ["spot", "on-demand"])
BY_LABEL = {o.label: o for o in OPTIONS}
SPOT16, SPOT32 = BY_LABEL["v4-16 spot"], BY_LABEL["v4-32 spot"]
OD16, OD32, OD64 = (BY_LABEL[f"v4-{n} on-demand"] for n in (16, 32, 64))
COUNTED = {o.label: o for o in benchmark_job().options}  # 1-4 x v4-16, 1-2 x v4-32, v4-64; both tiers
RESTART = RestartCost()
HOUR = 3600.0
TOTAL = 20e9
INTERVAL_S = 60.0  # the snapshot's decision interval


def snapshot(*, slack_s: float, current=None, capacity: int = 32, work_h: float = 1.0, options=OPTIONS,
             **extra) -> Snapshot:
    """A snapshot whose safety-net slack (`policies.cost.policy.decide`) is `slack_s`: `work_h` hours of
    on-demand v4-64 work committed and left, and just enough time for it, the restart and the margin."""
    left = OD64.tokens_per_s * work_h * HOUR
    fallback_s = INTERVAL_S + RESTART.overhead_s + RESTART.train_s(left, OD64.tokens_per_s)
    return Snapshot(now_s=0.0, deadline_s=fallback_s + 600.0 + slack_s, total_tokens=TOTAL,
                    tokens_done=TOTAL - left, tokens_committed=TOTAL - left, options=tuple(options),
                    spot_chips_available=capacity, current=current, decision_interval_s=INTERVAL_S, **extra)


def needs_s(snap: Snapshot, o) -> float:
    """What rule 6 asks a spot run to outlast: two startups and a reclaim's lost work."""
    return 2 * RESTART.startup_s + RESTART.lost_per_preemption_s(RESTART.interval_s(slice_hazard_per_hour(o, snap)))


@pytest.mark.parametrize(("current", "target", "slack_over_threshold", "pays"), [
    (OD64, SPOT32, -30.0, False),  # just short: the net would call the job back before the move pays
    (OD64, SPOT32, +30.0, True),
    (OD64, SPOT16, -30.0, False),  # a slower spot size loses slack faster: a higher threshold
    (OD64, SPOT16, +30.0, True),
    (None, SPOT32, -30.0, False),  # from no slice the whole overhead comes off the slack
    (None, SPOT32, +30.0, True),
    (SPOT32, SPOT32, -1e4, True),  # keeping the running spot slice is left to the values
    (OD64, OD32, -1e4, True),  # on-demand is never out of reach
])
def test_spot_is_asked_for_only_while_it_can_pay_before_the_safety_net(current, target, slack_over_threshold, pays):
    base = snapshot(slack_s=0.0, current=current)
    start_s = RESTART.overhead_s if current is None else RESTART.startup_s
    falls = 1 - target.tokens_per_s / OD64.tokens_per_s
    threshold = start_s + falls * needs_s(base, target) if target.preemptible else 0.0
    slack_s = threshold + slack_over_threshold
    assert _spot_pays_before_net(snapshot(slack_s=slack_s, current=current), target, slack_s, OD64) is pays


@pytest.mark.parametrize(("current", "slack_h", "outage_h", "pays"), [
    (OD16, 1.0, 2.0, False),  # spot expected back after the net fires: keep the slice
    (OD16, 3.0, 2.0, True),
    (OD16, 1.0, 0.5, True),  # short outages: waiting may pay
    (None, 0.1, 2.0, True),  # holding nothing already: left to the values
])
def test_a_running_slice_is_given_up_to_wait_only_if_spot_is_expected_back_before_the_net(
        current, slack_h, outage_h, pays):
    availability = SpotAvailability(prior_outage_h=outage_h)
    snap = snapshot(slack_s=slack_h * HOUR, current=current, capacity=0, availability=availability)
    if current is not None:  # the smallest spot size's expected outage plus the start on it
        assert (slack_h * HOUR > outage_h * HOUR + RESTART.overhead_s) is pays
    assert _wait_pays_before_net(snap, slack_h * HOUR) is pays


def test_no_wait_is_chosen_from_on_demand_when_the_outage_outlasts_the_slack():
    # On on-demand v4-16, no spot now, outages of 2 h, an hour and a half of slack: without rule 7 the
    # policy released the slice to wait (a wait that could only end on the safety net, a restart later).
    snap = snapshot(slack_s=1.5 * HOUR, current=OD16, capacity=0,
                    availability=SpotAvailability(prior_outage_h=2.0), work_h=0.5)
    assert decide(snap).option == OD16


@pytest.mark.parametrize(("current", "target", "dominated"), [
    ("4xv4-16 on-demand", "2xv4-16 on-demand", True),  # slower, the same a token: only a startup lost
    ("3xv4-16 on-demand", "2xv4-16 on-demand", True),
    ("4xv4-16 on-demand", "v4-32 on-demand", True),  # slower and dearer a token
    ("2xv4-16 on-demand", "4xv4-16 on-demand", False),  # faster: the deadline may need it
    ("v4-32 on-demand", "2xv4-16 on-demand", False),  # as fast and cheaper a token
    ("4xv4-16 on-demand", "4xv4-16 on-demand", False),  # keeping it
    ("4xv4-16 on-demand", "2xv4-16 spot", False),  # spot is for rules 5 and 6
    ("4xv4-16 spot", "2xv4-16 on-demand", False),  # from spot, any on-demand
])
def test_an_on_demand_move_that_is_no_faster_and_no_cheaper_is_never_a_candidate(current, target, dominated):
    c, d = COUNTED[current], COUNTED[target]
    snap = Snapshot(now_s=0.0, deadline_s=30 * HOUR, total_tokens=TOTAL, tokens_done=0.0, tokens_committed=0.0,
                    options=tuple(COUNTED.values()), spot_chips_available=0, current=c)
    assert _dominated_on_demand_move(snap, d) is dominated
