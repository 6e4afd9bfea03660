"""The fluid plan: the expected cost of finishing a job from some moment, treating the
future as a fluid.

The cost policy (`policies.cost.policy`) prices each action it could take now as the action's
own cost over the lookahead plus the cost of this plan from where the action leaves
the job. The plan uses spot of one size whenever it can be had, at its
hazard-discounted speed and price per token (`SpotOutlook`), and the cheapest
on-demand mix (one size, or a cheap slow one and a fast one) that fills the shortfall
in the remaining outage time. Future spot time is uncertain, so the plan is priced in
five scenarios of it (`SPOT_TIME_SCENARIOS`: mean +- standard deviations from the
learned up and down period lengths) and averaged: a plan's cost is convex in spot
time, so the average prices the risk of a long outage.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from policies.cost.restart_cost import RestartCost
from policies.cost.slice_options import Option
from policies.cost.snapshot import Snapshot, slice_hazard_per_hour, slice_shrink_per_hour

# Future spot time is uncertain: plans are priced in five scenarios (5-point Gauss-
# Hermite nodes of a normal, in standard deviations, with their weights) and averaged.
# The cost of a plan is convex in spot time, so the average prices the risk of a long
# outage without a hand-picked pessimism level. The mean scenario comes first.
SPOT_TIME_SCENARIOS = (
    (0.0, 0.533333),
    (-1.355626, 0.222076),
    (1.355626, 0.222076),
    (-2.856970, 0.011257),
    (2.856970, 0.011257),
)  # (sigmas, weight)
INFEASIBLE_PENALTY = 10.0  # x the dearest $/token, per token a plan cannot fit in time


@dataclass(frozen=True)
class Plan:
    """Expected future from some moment: `spot` whenever available, `on_demand` to fill."""

    spot: Option | None
    on_demand: Option | None
    spot_tokens: float
    on_demand_tokens: float
    cost_usd: float
    finish_after_s: float
    feasible: bool
    on_demand_second: Option | None = None  # a faster size for part of the on-demand tokens
    on_demand_second_tokens: float = 0.0

    def describe(self) -> str:
        parts = []
        if self.spot and self.spot_tokens > 0:
            parts.append(f"spot {self.spot.what} for {self.spot_tokens / 1e9:.2f}B tokens")
        first = self.on_demand_tokens - self.on_demand_second_tokens
        if self.on_demand and first > 0:
            parts.append(f"on-demand {self.on_demand.what} for {first / 1e9:.2f}B")
        if self.on_demand_second and self.on_demand_second_tokens > 0:
            parts.append(f"on-demand {self.on_demand_second.what} for {self.on_demand_second_tokens / 1e9:.2f}B")
        text = " + ".join(parts) or "nothing left to train"
        return text if self.feasible else text + " (cannot fit before the deadline)"


@dataclass(frozen=True)
class SpotOutlook:
    """What the policy expects of one spot option; computed once per decision."""

    option: Option
    hazard_per_hour: float  # full restarts (every slice lost)
    usd_per_token: float  # restarts and lost work after preemptions folded in
    tokens_per_up_s: float  # speed x productive fraction, while the slice can be had
    fraction: float  # of the time the slice can be had
    spread_h: float  # standard deviation of spot hours over a horizon of H hours, / sqrt(H)
    shrink_per_hour: float = 0.0  # losses of one slice of several (the job trains on)

    def up_s(self, horizon_s: float, sigmas: float) -> float:
        """Seconds the slice can be had within the horizon, `sigmas` deviations from the mean."""
        if horizon_s <= 0:
            return 0.0
        hours = horizon_s / 3600
        return 3600 * min(max(self.fraction * hours + sigmas * self.spread_h * math.sqrt(hours), 0.0), hours)


@dataclass(frozen=True)
class PlanInputs:
    """Everything the fluid plan needs, derived from a snapshot once per decision."""

    spot: tuple[SpotOutlook, ...]
    on_demand: tuple[Option, ...]  # cheapest per token first
    on_demand_pairs: tuple[tuple[Option, Option], ...]  # (cheaper and slower, faster) pairs to mix
    fastest_tokens_per_s: float
    penalty_per_token: float
    restart: RestartCost


def plan_inputs(snap: Snapshot) -> PlanInputs:
    """The snapshot's options with their expected economics.

    Each preemption (slice hazard per hour) costs a restart and half a checkpoint
    interval of work, and provisioning is the only part of that which is not billed;
    the checkpoints themselves cost `RestartCost.save_s` each. On several slices, the loss
    of one that leaves others costs `RestartCost.shrink_loss_s` instead (billed: the job
    trains on).
    """
    r, spot = snap.restart, []
    for o in (o for o in snap.options if o.preemptible):
        hazard, shrink = slice_hazard_per_hour(o, snap), slice_shrink_per_hour(o, snap)
        productive = max(0.05, 1 - r.lost_fraction(hazard) - shrink / 3600 * r.shrink_loss_s(o.count))
        billed = max(0.05, 1 - hazard / 3600 * r.provisioning_s)
        spot.append(SpotOutlook(o, hazard, o.usd_per_token * billed / productive, o.tokens_per_s * productive,
                                snap.availability.fraction(o.zone, o.chips),
                                snap.availability.spread_h(o.zone, o.chips), shrink))
    on_demand = tuple(sorted((o for o in snap.options if not o.preemptible), key=lambda o: o.usd_per_token))
    pairs = tuple((a, b) for a in on_demand for b in on_demand
                  if a.usd_per_token < b.usd_per_token and a.tokens_per_s < b.tokens_per_s)
    return PlanInputs(tuple(spot), on_demand, pairs, max(o.tokens_per_s for o in snap.options),
                      INFEASIBLE_PENALTY * max(o.usd_per_token for o in snap.options), r)


def fluid_plan(view: PlanInputs, horizon_s: float, tokens: float, sigmas: float = 0.0,
               holding: Option | None = None) -> Plan:
    """Cheapest way to train `tokens` within `horizon_s`, treating the future as a fluid.

    Each spot size is used whenever it can be had, for `SpotOutlook.up_s` (`sigmas`
    away from the mean); what it cannot cover goes to on-demand in the rest of the
    horizon: the cheapest size fast enough alone, or a cheaper, slower size for as long
    as the time allows and a faster one for the rest, whichever costs less (a single
    size that just fits would overpay for speed on every token). Each slice the plan
    uses costs one startup unless the job is `holding` it already (later restarts after
    preemptions are in the spot price per token); without that, starting later would
    always look cheaper than starting now. A plan that cannot fit is kept but priced
    with a steep penalty, so that the policy moves away from it smoothly.
    """
    if tokens <= 0:
        return Plan(None, None, 0.0, 0.0, 0.0, 0.0, True)
    horizon_s = max(horizon_s, 0.0)
    restart, best = view.restart, None

    def start_usd(o: Option) -> float:
        return 0.0 if o == holding else o.usd_per_hour * restart.startup_s / 3600

    for spot in (None, *view.spot):
        up_s = spot.up_s(horizon_s, sigmas) if spot else 0.0
        spot_tokens = min(tokens, spot.tokens_per_up_s * up_s) if spot else 0.0
        spot_cost = spot_tokens * spot.usd_per_token + start_usd(spot.option) if spot else 0.0
        rest = tokens - spot_tokens
        if rest <= 0:
            assert spot is not None, "only spot time covers every token (tokens > 0)"
            plan = Plan(spot.option, None, tokens, 0.0, spot_cost,
                        horizon_s * tokens / (spot.tokens_per_up_s * up_s), True)
        else:
            window_s = (horizon_s - up_s - restart.overhead_s) * (1 - restart.save_s / restart.checkpoint_interval_s)
            fill = _on_demand_fill(view, rest, window_s, start_usd)
            if fill is not None:
                cost, fit, second, second_tokens = fill
                plan = Plan(spot.option if spot else None, fit, spot_tokens, rest, spot_cost + cost, horizon_s, True,
                            second, second_tokens)
            else:
                d = max(view.on_demand, key=lambda o: o.tokens_per_s) if view.on_demand else None
                short = rest - (d.tokens_per_s * max(window_s, 0.0) if d else 0.0)
                cost = spot_cost + rest * (d.usd_per_token if d else 0.0) + short * view.penalty_per_token
                finish = horizon_s + short / view.fastest_tokens_per_s
                plan = Plan(spot.option if spot else None, d, spot_tokens, rest, cost, finish, False)
        if best is None or plan.cost_usd < best.cost_usd:
            best = plan
    assert best is not None, "the plan without spot is always made"
    return best


OnDemandFill = tuple[float, Option, Option | None, float]  # cost, first size, second size or None, tokens on it


def _on_demand_fill(view: PlanInputs, tokens: float, window_s: float,
                    start_usd: Callable[[Option], float]) -> OnDemandFill | None:
    """Cheapest on-demand way to train `tokens` within `window_s`: one size, or a cheaper
    (slower) size for as long as the window allows and a faster one for the rest (one
    more restart). Returns (cost, first size, second size or None, tokens on the second),
    or None if even the fastest size cannot fit."""
    best: OnDemandFill | None = None
    for d in view.on_demand:
        if d.tokens_per_s * window_s >= tokens:
            cost = tokens * d.usd_per_token + start_usd(d)
            if best is None or cost < best[0]:
                best = (cost, d, None, 0.0)
    pair_window_s = window_s - view.restart.overhead_s
    for a, b in view.on_demand_pairs:  # as much on `a` as the window allows when `b` trains the rest
        on_a = (pair_window_s - tokens / b.tokens_per_s) / (1 / a.tokens_per_s - 1 / b.tokens_per_s)
        if not 0 < on_a < tokens:
            continue
        cost = on_a * a.usd_per_token + (tokens - on_a) * b.usd_per_token + start_usd(a) + start_usd(b)
        if best is None or cost < best[0]:
            best = (cost, a, b, tokens - on_a)
    return best


def expected_plan_cost(view: PlanInputs, horizon_s: float, tokens: float, holding: Option | None) -> tuple[float, Plan]:
    """Mean cost of the fluid plan over the spot-time scenarios, and the plan at the mean."""
    plans = [(fluid_plan(view, horizon_s, tokens, sigmas, holding), weight) for sigmas, weight in SPOT_TIME_SCENARIOS]
    return sum(p.cost_usd * w for p, w in plans), plans[0][0]
