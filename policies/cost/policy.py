"""Cost-aware slice choice: which slice size and tier a job runs on next, and when to resize.

The model. A job must train `total_tokens` before `deadline_s`. Each `Option` (a slice
type x tier x zone) trains at `tokens_per_s` and bills `usd_per_hour` while the slice
is starting or running. Changing slice (a restart) costs `RestartCost.provisioning_s`
(not billed) plus `startup_s` (billed: init, restore, compile); a preemption also loses
the work since the last checkpoint, half a checkpoint interval on average. On-demand
slices are always obtainable and never preempted. A spot slice can be had only while
the zone's spot capacity allows it (`Snapshot.spot_chips_available`), and is preempted
at a rate `SpotHazard` (per host-hour: a multi-host slice dies when any host dies, so a
slice's hazard is hosts x the host hazard; a Gamma-Poisson estimate, prior updated by
observed preemptions). `SpotAvailability` estimates, from the capacity seen so far,
the fraction of time each spot size can be had and how long outages last.

The parts, one module each: `policies.cost.slice_options` (what the job can run on, its
price and speed), `policies.cost.restart_cost` (restarts and the checkpoint interval),
`policies.cost.spot_estimates` (the hazard and availability learned), `policies.cost.snapshot`
(the decision's input and output records), `policies.cost.fluid_plan` (the expected cost of
finishing from some moment), and this module, the decision itself.

The objective is the least expected cost to finish (equivalently, expected cost per
token) subject to meeting the deadline. The decision rule, in `decide`:

1. Safety net (hard). Holding no on-demand slice is allowed only while, if the spot
   slice vanished before the next decision, the fastest on-demand slice could still
   finish the committed remainder before the deadline with `safety_margin_s` to spare.
   When that fails, the job runs the on-demand option that finishes in time at the
   least cost (staying on its current one when that still finishes). This is Can't Be
   Late's safety net, generalised to several sizes; it makes the deadline met whenever
   on-demand could still meet it when the job arrived.
2. Otherwise every action available now (run an obtainable spot size, run an
   on-demand size, or hold nothing and wait for spot) is priced as: its expected spend
   and progress over `lookahead_s` (restart, preemption and lost work included), plus
   the expected cost of finishing from there under a fluid plan (`fluid_plan`): spot of
   one size whenever it can be had, at its hazard-discounted speed and price per
   token, and the cheapest on-demand mix (one size, or a cheap slow one and a fast
   one) that fills the shortfall in the remaining outage time. Future spot time is
   uncertain, so the plan is priced in five scenarios
   of it (mean +- standard deviations from the learned up/down period lengths) and
   averaged: a plan's cost is convex in spot time, so the average prices the risk of a
   long outage. The cheapest action wins; leaving the current slice must also pay the
   startup of coming back to it (hysteresis), and near-ties keep the current slice,
   then spend nothing.
3. A queued request the plan still wants is kept, not released and asked for again. The
   job holds one request beside its slice (`Snapshot.waiting`). When the winner would
   release a waiting spot request while its own plan still waits for that size (or one
   the request fills no later than), the best action that keeps the request wins
   instead: always when the winner trades it for a request of another spot size (a
   chance that the zone has that size is all the trade buys), and otherwise (a move to
   on-demand, which takes the job's one request) unless the winner saves more than
   `KEEP_MARGIN` of the expected cost to finish. Each request let go unfilled is a
   queued resource created and deleted for nothing, and asked for again a few minutes
   later. Only where the options have slice counts: there a plan that waits for a size
   gets part of it as added slices beside the job meanwhile. One slice at a time, a
   request is all or nothing, and keeping one for a size the zone cannot give, rather
   than trading it for a smaller one it can, forgoes spot capacity (measured on the
   bundled traces: 1.182x the single-slice optimum with the rule, 1.118x without).

4. Spot sized to what is there (issue 38). A start on spot takes every slice of its type that
   fits now when the larger count costs no more a token (`_every_slice_that_fits`: with the
   all-reduce hidden, N slices cost what one does a token and finish N times sooner) and the
   added slices' expected stretch, learned per zone and size, outlasts the relaunch their loss
   costs the group. A running spot group the policy keeps grows the same way, to a count the
   zone has been seen to give (`_grow_to_what_fits`).
5. No chasing of short bursts (issue 38). Leaving a running slice for a spot one is a
   candidate only while the spot size's expected stretch outlasts the two startups of going
   there and coming back, and the work a reclaim loses (`_stretch_pays`). Adding slices to the
   running ones is a candidate only while the added slices' expected stretch, times their count,
   outlasts the two relaunches of the group (when they join, and when they are taken back).

Neither rule has a constant of its own: both compare a learned stretch with restart figures.

What this does that Can't Be Late's rules do not: it chooses the slice size (small spot
slices are cheaper per token, large ones use scarce spot windows when the deadline is
tight), it starts on-demand when the risk that waiting forces a larger, dearer
on-demand slice later outweighs the chance that spot returns (instead of tracking a
uniform-progress line), it goes back to spot whenever the safety net allows, and it
checkpoints each slice as often as its preemption rate makes worth the save (Young and
Daly's interval: every few minutes where spot lasts minutes, the job's own interval on
on-demand), counting the saves in every time and cost it estimates. Like
Parcae it plans on predicted availability ("liveput": speed x expected uptime), but it
prices each move in dollars, and it learns the zone's uptime and outage distribution
(so a zone whose spot lasts minutes is not worth a restart).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from policies.cost.fluid_plan import Plan, PlanInputs, expected_plan_cost, plan_inputs
from policies.cost.moves import fills_no_later, next_move
from policies.cost.slice_options import Option
from policies.cost.snapshot import Decision, Snapshot, slice_hazard_per_hour

SAFETY_MARGIN_S = 600.0  # spare time the safety net keeps, against slow provisioning
LOOKAHEAD_S = 3600.0  # long enough to amortise a restart, short against a day-long job
KEEP_MARGIN = 0.05  # a waiting request the plan wants is given up only to save more than this share of the cost


@dataclass(frozen=True)
class ActionValue:
    option: Option | None
    cost_usd: float  # expected spend to completion if the job takes this action now
    plan: Plan  # the fluid plan after the lookahead
    elapsed_s: float  # expected time the action covers before the plan takes over (less if it finishes or is preempted)


def value_of(action: Option | None, snap: Snapshot, view: PlanInputs, lookahead_s: float) -> ActionValue:
    """Expected cost to finish if the job runs `action` for the lookahead, then follows the plan."""
    horizon_s = snap.deadline_s - snap.now_s
    remaining = snap.total_tokens - snap.tokens_done
    if action is None:
        cost, plan = expected_plan_cost(view, horizon_s - lookahead_s, remaining, None)
        return ActionValue(None, cost, plan, lookahead_s)
    r = snap.restart
    overhead_s = snap.overhead_s(action)
    billed_usd = snap.billed_move_usd(action)  # startup is the billed tail of a restart
    run_s = max(lookahead_s - overhead_s, 0.0)
    outlook = next((s for s in view.spot if s.option == action), None)
    hazard = outlook.hazard_per_hour if outlook else 0.0
    shrink_share = (outlook.shrink_per_hour / 3600 * r.shrink_loss_s(action.count)) if outlook else 0.0
    interval, per_s = r.interval_s(hazard), hazard / 3600
    if per_s > 0:  # expected running time before a preemption, and work lost at one
        alive_s = (1 - math.exp(-per_s * run_s)) / per_s
        lost_s = (1 - math.exp(-per_s * run_s)) * r.lost_per_preemption_s(interval)
    else:
        alive_s, lost_s = run_s, 0.0
    tokens = max(action.tokens_per_s * (alive_s * (1 - r.save_s / interval - shrink_share) - lost_s), 0.0)
    usd_per_s = action.usd_per_hour / 3600
    if tokens >= remaining:  # finishes inside the lookahead
        used_s = r.train_s(remaining, action.tokens_per_s, hazard)
        late = overhead_s + used_s > horizon_s  # a miss, however small: as if no token were in time
        penalty = remaining * view.penalty_per_token if late else 0.0
        done = Plan(None, None, 0.0, 0.0, 0.0, 0.0, not late)
        return ActionValue(action, billed_usd + usd_per_s * used_s + penalty, done, overhead_s + used_s)
    # A preempted slice hands over to the plan when it dies, not at the end of the lookahead.
    elapsed_s = overhead_s + alive_s
    cost, plan = expected_plan_cost(view, horizon_s - elapsed_s, remaining - tokens, action)
    return ActionValue(action, billed_usd + usd_per_s * alive_s + cost, plan, elapsed_s)


@dataclass(frozen=True)
class CostPolicy:
    """The cost-aware policy; the fields are its only tunables (see the module docstring)."""

    safety_margin_s: float = SAFETY_MARGIN_S
    lookahead_s: float = LOOKAHEAD_S
    name: str = "policy"

    def decide(self, snap: Snapshot) -> Decision:
        return decide(snap, safety_margin_s=self.safety_margin_s, lookahead_s=self.lookahead_s)


def decide(snap: Snapshot, *, safety_margin_s: float = SAFETY_MARGIN_S, lookahead_s: float = LOOKAHEAD_S) -> Decision:
    """The next slice for the job in `snap` (None: wait for spot), with its reason and expected cost."""
    horizon_s = snap.deadline_s - snap.now_s
    live_left = snap.total_tokens - snap.tokens_done
    committed_left = snap.total_tokens - snap.tokens_committed
    on_demand = [o for o in snap.options if not o.preemptible]
    spot_now = [o for o in snap.options if o.preemptible and o.chips <= snap.spot_chips_available]

    def od_finish_s(d: Option) -> float:  # from now, if the job moves to (or stays on) d
        # A grow trains on the running slices while the added ones provision: counting only its pause
        # overstated it at the request and turned the choice around once the slices were READY.
        lead_s = snap.trains_on_while_provisioning_s(d)
        left = live_left - (lead_s * snap.current.tokens_per_s if lead_s and snap.current else 0.0)
        return lead_s + snap.overhead_s(d) + snap.restart.train_s(max(left, 0.0), d.tokens_per_s)

    if on_demand:
        fastest = max(on_demand, key=lambda o: o.tokens_per_s)
        fallback_s = (snap.decision_interval_s + snap.restart.overhead_s
                      + snap.restart.train_s(committed_left, fastest.tokens_per_s))
        slack_s = horizon_s - fallback_s - safety_margin_s
        if slack_s < 0:
            return _safety_net(snap, on_demand, od_finish_s, horizon_s, slack_s)

    spot_now = [o for o in spot_now if _stretch_pays(snap, o)]
    candidates = [None, *spot_now, *on_demand]
    view = plan_inputs(snap)
    values = [value_of(a, snap, view, lookahead_s) for a in candidates]
    # Hysteresis: leaving the current slice must also pay for the startup of coming back
    # to it, or the policy chatters between two sizes at the edge of a plan.
    come_back = snap.current.usd_per_hour * snap.restart.startup_s / 3600 if snap.current else 0.0

    def score(v: ActionValue) -> float:
        return v.cost_usd + (come_back if v.option != snap.current else 0.0)

    best_score = min(score(v) for v in values)
    tolerance = max(0.01, 1e-6 * abs(best_score))

    def preference(v: ActionValue) -> tuple[bool, bool, float, int]:
        # Among near-equal actions: keep the current slice, then spend nothing, then the
        # cheaper per token, then the smaller slice.
        o = v.option
        return (o != snap.current, o is not None, o.usd_per_token if o else 0.0, o.chips if o else 0)

    chosen = min((v for v in values if score(v) <= best_score + tolerance), key=preference)
    if _gives_up_wanted_request(snap, chosen):
        # Keep the waiting request unless giving it up gains materially; a trade for a request
        # of another spot size never does (a chance that the zone has that size is all it buys).
        gain = math.inf if chosen.option is not None and chosen.option.preemptible else KEEP_MARGIN * abs(best_score)
        keeping = [v for v in values if score(v) <= score(chosen) + gain and not _releases_waiting(snap, v)]
        if keeping:
            least = min(score(v) for v in keeping)
            chosen = min((v for v in keeping if score(v) <= least + tolerance), key=preference)
    wider = _every_slice_that_fits(snap, chosen, values)
    if wider is not None:
        chosen = wider
    decision = _decision(snap, chosen.option, _reason(snap, chosen), chosen.cost_usd,
                         snap.now_s + chosen.elapsed_s + chosen.plan.finish_after_s)
    return replace(decision, wait_for=_wait_for(snap, chosen))


def _stretch_pays(snap: Snapshot, o: Option) -> bool:
    """Rule 5 (issue 38): leaving a running slice for spot pays only if the spot stretch is expected
    to outlast what the move costs: the startup on the spot slice and, when the stretch ends, the
    startup back on another, plus the work a reclaim loses. The expected stretch is the mean up
    period learned for the size in the zone (one slice's size: the job trains while one is left).
    Starting spot from no slice, or keeping the running one, is left to the values.

    Adding slices to the running ones (a grow) pays only if the added slices train, over the
    expected stretch of the larger size, more than the two relaunches it costs: the whole larger
    group's when they join, and the survivors' when the zone takes them back (`RestartCost.
    reshape_s` each, as `sim_slices` and the controller pay them)."""
    c = snap.current
    if c is None or o == c:
        return True
    r = snap.restart
    if snap.is_grow(o):
        grow_stretch_s = 3600 * snap.availability.uptime_h(o.zone, o.chips)[0]
        return (o.count - c.count) * grow_stretch_s > (o.count + c.count) * r.reshape_s
    stretch_s = 3600 * snap.availability.uptime_h(o.zone, o.slice_chips)[0]
    hazard = slice_hazard_per_hour(o, snap)
    return stretch_s > 2 * r.startup_s + r.lost_per_preemption_s(r.interval_s(hazard))


def _every_slice_that_fits(snap: Snapshot, chosen: ActionValue, values: list[ActionValue]) -> ActionValue | None:
    """Rule 4 (issue 38): a start on spot takes every slice of its type that fits, when the larger
    count costs no more a token and its expected value pays the start. Where several slices train
    at the speed of one times their count (the all-reduce hidden), N slices cost what one does a
    token and finish N times sooner, which leaves more of the job for later spot; the fluid plan
    prices them near-equal, and the tie went to the smaller slice. On a start the job pays the
    startup whatever the count; a running group kept is grown by `_grow_to_what_fits`.

    Whether the stretch pays: when the zone takes the added slices back, the group relaunches on
    the survivors (`RestartCost.reshape_s` of the whole group's time); the added slices pay for it
    if, over the expected stretch of their size (learned per zone and size, `SpotAvailability.
    uptime_h`), they train more than that relaunch loses."""
    o = chosen.option
    if o is None or not o.preemptible or snap.is_grow(o):
        return None
    if o == snap.current:
        return _grow_to_what_fits(snap, o, values)

    def pays(v: Option) -> bool:
        stretch_s = 3600 * snap.availability.uptime_h(v.zone, v.chips)[0]
        return (v.count - o.count) * stretch_s > v.count * snap.restart.reshape_s

    return _widest(values, o, lambda v: v.preemptible and v.count > o.count and (v.name, v.zone) == (o.name, o.zone)
                   and pays(v))


def _grow_to_what_fits(snap: Snapshot, held: Option, values: list[ActionValue]) -> ActionValue | None:
    """Rule 4 on a running spot group: when the policy keeps it, it adds every slice of its type that
    fits, where the larger count costs no more a token, the added slices' stretch pays the two
    relaunches (`_stretch_pays`, which `values` already passed), and the zone has been seen to give
    that many chips (`SpotAvailability.seen_up`, pooled over the zone's jobs). The values alone priced
    the relaunch of a grow against a fluid plan that counted on spot later at the learned fraction, and
    kept one v4-16 for 7 hours while the zone had two (the deadline far off, the learned fraction 0.91
    where the trace then gave half of it). A size the zone was never seen to give is asked for only by
    a start or by the values: growing to it on every look made a request that waited unfilled (6.2
    a job at 4 start times against 4.3, when the bundled 1-node zones never gave more than two)."""
    return _widest(values, held, lambda v: snap.is_grow(v) and snap.availability.seen_up(v.zone, v.chips))


def _widest(values: list[ActionValue], than: Option, ok: Callable[[Option], bool]) -> ActionValue | None:
    """The value of the most slices among the options `ok` takes that cost no more a token than `than`."""
    wider = [v for v in values if v.option is not None and ok(v.option)
             and v.option.usd_per_token <= than.usd_per_token * (1 + 1e-9)]
    return max(wider, key=lambda v: v.option.count if v.option else 0, default=None)


def _wait_for(snap: Snapshot, v: ActionValue) -> Option | None:
    """The spot size the plan after `v` waits for that the zone cannot give now (keep it requested)."""
    spot = v.plan.spot
    return spot if spot is not None and v.plan.spot_tokens > 0 and spot.chips > snap.spot_chips_available else None


def _releases_waiting(snap: Snapshot, v: ActionValue) -> bool:
    """Whether taking `v` gives up the request waiting beside the current slice."""
    return next_move(v.option, held=snap.current, waiting=snap.waiting, wait_for=_wait_for(snap, v)).release_waiting


def _gives_up_wanted_request(snap: Snapshot, v: ActionValue) -> bool:
    """Whether `v` releases the spot request waiting beside the current slice while its own
    plan still waits for that size (or one the request fills no later than)."""
    w, spot = snap.waiting, v.plan.spot
    if w is None or not w.preemptible or spot is None or v.plan.spot_tokens <= 0:
        return False
    if not any(o.count > 1 for o in snap.options):  # one slice at a time: a request is all or nothing (rule 3)
        return False
    return fills_no_later(w, spot, held=snap.current) and _releases_waiting(snap, v)


def _safety_net(snap: Snapshot, on_demand: Sequence[Option], od_finish_s: Callable[[Option], float], horizon_s: float,
                slack_s: float) -> Decision:
    in_time = [d for d in on_demand if od_finish_s(d) <= horizon_s]
    if not in_time:
        d = min(on_demand, key=od_finish_s)
        late_h = (od_finish_s(d) - horizon_s) / 3600
        return _decision(snap, d, f"deadline at risk: even on-demand {d.what} finishes {late_h:.2f} h late",
                         _finish_cost(snap, d, od_finish_s(d)), snap.now_s + od_finish_s(d))
    d = min(in_time, key=lambda o: _finish_cost(snap, o, od_finish_s(o)))
    reason = (f"safety net: losing spot now would leave {slack_s / 3600:+.2f} h of slack, so run "
              f"on-demand {d.what}, the cheapest slice that finishes in time "
              f"({(horizon_s - od_finish_s(d)) / 3600:.2f} h to spare)")
    return _decision(snap, d, reason, _finish_cost(snap, d, od_finish_s(d)), snap.now_s + od_finish_s(d))


def _finish_cost(snap: Snapshot, d: Option, finish_s: float) -> float:
    """Cost of finishing on on-demand `d` from now: everything but provisioning is billed."""
    if d == snap.current:
        unbilled = max(snap.current_ready_in_s - snap.restart.startup_s, 0.0)
    else:
        unbilled = snap.restart.provisioning_s
    return d.usd_per_hour / 3600 * (finish_s - unbilled)


def _usd(x: float) -> str:
    return f"${x:,.2f}" if abs(x) < 100 else f"${x:,.0f}"


def _reason(snap: Snapshot, v: ActionValue) -> str:
    o, plan, cost = v.option, v.plan.describe(), _usd(v.cost_usd)
    if o is None:
        return f"wait for spot: expected {cost} to finish with plan {plan}"
    what = f"{o.tier} {o.what}"
    if o == snap.current:
        return f"keep {what}: cheapest expected cost {cost}, then {plan}"
    if snap.current is not None:
        return f"move from {snap.current.label} to {what}: expected {cost}, then {plan}"
    return f"run {what}: expected {cost}, then {plan}"


def _decision(snap: Snapshot, option: Option | None, reason: str, cost: float, finish_s: float) -> Decision:
    within = snap.budget_usd is None or snap.spent_usd + cost <= snap.budget_usd
    if not within and snap.budget_usd is not None:  # (not within: there is a budget)
        reason += f" (over budget: {_usd(snap.spent_usd + cost)} expected against {_usd(snap.budget_usd)})"
    resize = snap.current is not None and option != snap.current
    interval = None
    if option is not None:
        interval = snap.restart.interval_s(slice_hazard_per_hour(option, snap))
    return Decision(option, reason, cost, finish_s, resize, within, interval)
