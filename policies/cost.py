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

The objective is the least expected cost to finish (equivalently, expected cost per
token) subject to meeting the deadline. The decision rule, in `decide`:

1. Safety net (hard). Holding no on-demand slice is allowed only while, if the spot
   slice vanished at the next decision, the fastest on-demand slice could still finish
   the committed remainder before the deadline with `safety_margin_s` to spare. When
   that fails, the job runs the on-demand option that finishes in time at the least
   cost (staying on its current one when that still finishes). This is Can't Be Late's
   safety net, generalised to several sizes; it makes the deadline met whenever
   on-demand could still meet it when the job arrived.
2. Otherwise every action available now (run an obtainable spot size, run an
   on-demand size, or hold nothing and wait for spot) is priced over a lookahead of
   `lookahead_s`: its expected spend and progress during the lookahead (restart,
   preemption and lost work included), plus the expected cost of finishing from there
   under a fluid plan (`fluid_plan`): spot of one size whenever it is available (its
   learned availability, hazard-discounted speed and price per token), and the cheapest
   on-demand size that fills the shortfall within the remaining outage time. The
   cheapest action wins; near-ties keep the current slice (no churn), then waiting.

What this does that Can't Be Late's rules do not: it chooses the slice size (small spot
slices are cheaper per token, large ones save scarce spot windows when the deadline is
tight), it starts on-demand only when waiting would force a larger, dearer on-demand
slice later (instead of tracking a uniform-progress line), and it goes back to spot
whenever the safety net allows. Like Parcae it plans on predicted availability
("liveput": speed x expected uptime), but it prices each move in dollars.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

SPOT = "spot"
ON_DEMAND = "on-demand"
RESERVED = "reserved"

# Restart figures used until the orchestrator feeds measured ones (DESIGN.md: 60-180 s
# to provision a slice; init + orbax restore + XLA compile of a ~1B model, a few minutes).
DEFAULT_PROVISIONING_S = 120.0
DEFAULT_STARTUP_S = 240.0
DEFAULT_CHECKPOINT_INTERVAL_S = 600.0

# Priors, before the job has seen its zone, chosen to agree with each other: spot stays
# obtainable 4 h at a time and outages last 2 h, so it can be had 4 / (4 + 2) of the
# time; a 4-host slice lives those 4 h (one preemption per 16 host-hours, a prior worth
# 16 host-hours of evidence).
PRIOR_UPTIME_HOURS = 4.0
PRIOR_OUTAGE_HOURS = 2.0
PRIOR_HOST_HAZARD_PER_HOUR = 1 / (4 * PRIOR_UPTIME_HOURS)
PRIOR_HAZARD_HOST_HOURS = 16.0
PRIOR_AVAILABLE_FRACTION = PRIOR_UPTIME_HOURS / (PRIOR_UPTIME_HOURS + PRIOR_OUTAGE_HOURS)
PRIOR_AVAILABILITY_HOURS = 6.0

SAFETY_MARGIN_S = 600.0  # spare time the safety net keeps, against slow provisioning
LOOKAHEAD_S = 3600.0  # long enough to amortise a restart, short against a day-long job
PESSIMISM_SIGMAS = 1.0  # plan on spot time one standard deviation below its mean
INFEASIBLE_PENALTY = 10.0  # x the dearest $/token, per token a plan cannot fit in time


@dataclass(frozen=True)
class Option:
    """One thing the job can run on: a slice type in a tier and zone, with its speed and price."""

    name: str  # accelerator type, e.g. "v4-32"
    chips: int
    hosts: int
    tier: str  # SPOT, ON_DEMAND or RESERVED
    usd_per_hour: float  # for the whole slice
    tokens_per_s: float  # this job's throughput on this slice
    zone: str = "default"

    @property
    def preemptible(self) -> bool:
        return self.tier == SPOT

    @property
    def usd_per_token(self) -> float:
        return self.usd_per_hour / 3600 / self.tokens_per_s

    @property
    def label(self) -> str:
        return f"{self.name} {self.tier}"


@dataclass(frozen=True)
class RestartCost:
    """What one restart costs; measured figures replace the defaults once known."""

    provisioning_s: float = DEFAULT_PROVISIONING_S  # request to slice ready; not billed
    startup_s: float = DEFAULT_STARTUP_S  # JAX init, restore, compile; billed, no progress
    checkpoint_interval_s: float = DEFAULT_CHECKPOINT_INTERVAL_S

    @property
    def overhead_s(self) -> float:
        return self.provisioning_s + self.startup_s

    @property
    def expected_lost_work_s(self) -> float:
        return self.checkpoint_interval_s / 2  # a preemption lands uniformly between checkpoints


@dataclass(frozen=True)
class ScalingModel:
    """Throughput before the job has measured it: tokens/s = chips x peak x MFU / FLOPs per token.

    MFU starts at `mfu_one_host` and loses a factor `efficiency_per_doubling` each time
    the host count doubles (more of each step goes to cross-host communication).
    """

    flops_per_token: float  # ~6 x parameters, plus attention
    peak_flops_per_chip: float
    mfu_one_host: float = 0.50
    efficiency_per_doubling: float = 0.94

    def mfu(self, hosts: int) -> float:
        return self.mfu_one_host * self.efficiency_per_doubling ** math.log2(max(hosts, 1))

    def tokens_per_s(self, chips: int, hosts: int) -> float:
        return chips * self.peak_flops_per_chip * self.mfu(hosts) / self.flops_per_token

    @classmethod
    def dense_transformer(
        cls, *, params: float, n_layers: int, d_model: int, seq_len: int, peak_flops_per_chip: float
    ) -> ScalingModel:
        """Training FLOPs per token of a dense decoder: 6 per parameter, plus attention scores."""
        return cls(6 * params + 12 * n_layers * d_model * seq_len, peak_flops_per_chip)


def estimate_tokens_per_s(
    model: ScalingModel, chips: int, hosts: int, measured: Mapping[tuple[int, int], float] | None = None
) -> float:
    """Throughput on (chips, hosts): measured if the job ran there, else the model scaled to
    the nearest measured size (so a job that is slower than the model is slower everywhere)."""
    measured = measured or {}
    if (chips, hosts) in measured:
        return measured[(chips, hosts)]
    if not measured:
        return model.tokens_per_s(chips, hosts)
    (c, h), seen = min(measured.items(), key=lambda kv: abs(math.log2(kv[0][0] / chips)))
    return seen * model.tokens_per_s(chips, hosts) / model.tokens_per_s(c, h)


@dataclass(frozen=True)
class HazardCounts:
    preemptions: float = 0.0
    host_hours: float = 0.0


@dataclass(frozen=True)
class SpotHazard:
    """Preemption rate per host-hour, per (tier, zone): Gamma prior plus observed preemptions."""

    prior_per_host_hour: float = PRIOR_HOST_HAZARD_PER_HOUR
    prior_host_hours: float = PRIOR_HAZARD_HOST_HOURS
    counts: Mapping[tuple[str, str], HazardCounts] = field(default_factory=dict)

    def per_host_hour(self, tier: str, zone: str) -> float:
        if tier != SPOT:
            return 0.0
        c = self.counts.get((tier, zone), HazardCounts())
        prior_events = self.prior_per_host_hour * self.prior_host_hours
        return (prior_events + c.preemptions) / (self.prior_host_hours + c.host_hours)

    def per_slice_hour(self, option: Option) -> float:
        return option.hosts * self.per_host_hour(option.tier, option.zone)

    def observe(self, tier: str, zone: str, *, host_hours: float, preemptions: int = 0) -> SpotHazard:
        """The estimate after `host_hours` more of exposure with `preemptions` seen in it."""
        c = self.counts.get((tier, zone), HazardCounts())
        new = HazardCounts(c.preemptions + preemptions, c.host_hours + host_hours)
        return replace(self, counts={**self.counts, (tier, zone): new})


@dataclass(frozen=True)
class AvailabilityCounts:
    available_h: float = 0.0
    observed_h: float = 0.0
    outages: int = 0  # outages begun (a drop below the size)
    outage_h: float = 0.0
    uptimes: int = 0  # up periods begun
    in_outage: bool | None = None  # None before the first observation


@dataclass(frozen=True)
class SpotAvailability:
    """How often a spot slice of each size can be had in a zone, and how long outages last."""

    prior_fraction: float = PRIOR_AVAILABLE_FRACTION
    prior_hours: float = PRIOR_AVAILABILITY_HOURS
    prior_outage_h: float = PRIOR_OUTAGE_HOURS
    prior_uptime_h: float = PRIOR_UPTIME_HOURS
    counts: Mapping[tuple[str, int], AvailabilityCounts] = field(default_factory=dict)

    def fraction(self, zone: str, chips: int) -> float:
        c = self.counts.get((zone, chips), AvailabilityCounts())
        return (self.prior_fraction * self.prior_hours + c.available_h) / (self.prior_hours + c.observed_h)

    def mean_outage_h(self, zone: str, chips: int) -> float:
        c = self.counts.get((zone, chips), AvailabilityCounts())
        return (self.prior_outage_h + c.outage_h) / (1 + c.outages)

    def mean_uptime_h(self, zone: str, chips: int) -> float:
        c = self.counts.get((zone, chips), AvailabilityCounts())
        return (self.prior_uptime_h + c.available_h) / (1 + c.uptimes)

    def pessimistic_hours(self, zone: str, chips: int, horizon_h: float, sigmas: float) -> float:
        """Hours a spot slice can be had within the horizon, `sigmas` deviations below the mean.

        Up and down times alternate with means u and d; over a long horizon H the time up
        has variance 2 u^2 d^2 / (u + d)^3 x H (alternating renewal process, exponential
        periods), so the reserve grows as sqrt(H) while the mean grows as H.
        """
        if horizon_h <= 0:
            return 0.0
        u, d = self.mean_uptime_h(zone, chips), self.mean_outage_h(zone, chips)
        sd = math.sqrt(2 * u * u * d * d / (u + d) ** 3 * horizon_h)
        return max(self.fraction(zone, chips) * horizon_h - sigmas * sd, 0.0)

    def observe(self, zone: str, sizes: Sequence[int], capacity_chips: int, seconds: float) -> SpotAvailability:
        """The estimate after `seconds` during which the zone could give `capacity_chips`."""
        hours = seconds / 3600
        counts = dict(self.counts)
        for chips in sizes:
            c = counts.get((zone, chips), AvailabilityCounts())
            up = capacity_chips >= chips
            counts[(zone, chips)] = AvailabilityCounts(
                c.available_h + (hours if up else 0.0),
                c.observed_h + hours,
                c.outages + (0 if up or c.in_outage is True else 1),
                c.outage_h + (0.0 if up else hours),
                c.uptimes + (1 if up and c.in_outage is not False else 0),
                not up,
            )
        return replace(self, counts=counts)


@dataclass(frozen=True)
class Snapshot:
    """Every fact a decision depends on, at one moment (`now_s`, same clock as `deadline_s`)."""

    now_s: float
    deadline_s: float
    total_tokens: float
    tokens_done: float  # trained so far, including steps after the last checkpoint
    tokens_committed: float  # in the last committed checkpoint
    options: tuple[Option, ...]
    spot_chips_available: int  # largest spot slice the zone can give now; 0: none
    current: Option | None = None  # the slice the job holds, if any
    current_ready_in_s: float = 0.0  # > 0 while the current slice is provisioning or starting
    hazard: SpotHazard = SpotHazard()
    availability: SpotAvailability = SpotAvailability()
    restart: RestartCost = RestartCost()
    spent_usd: float = 0.0
    budget_usd: float | None = None
    decision_interval_s: float = 60.0  # time until the policy is asked again


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

    def describe(self) -> str:
        parts = []
        if self.spot and self.spot_tokens > 0:
            parts.append(f"spot {self.spot.name} for {self.spot_tokens / 1e9:.2f}B tokens")
        if self.on_demand and self.on_demand_tokens > 0:
            parts.append(f"on-demand {self.on_demand.name} for {self.on_demand_tokens / 1e9:.2f}B")
        text = " + ".join(parts) or "nothing left to train"
        return text if self.feasible else text + " (cannot fit before the deadline)"


@dataclass(frozen=True)
class Decision:
    """What to run next (None: hold no slice and wait for spot), why, and what it should cost."""

    option: Option | None
    reason: str
    expected_cost_usd: float  # expected spend from now to completion
    expected_finish_s: float  # expected completion time, same clock as Snapshot.now_s
    resize: bool = False  # replaces a slice the job holds
    within_budget: bool = True


@dataclass(frozen=True)
class SpotEconomics:
    usd_per_token: float  # billed time / productive time folded in
    tokens_per_up_s: float  # speed x productive fraction, while the slice can be had


def spot_economics(option: Option, snap: Snapshot) -> SpotEconomics:
    """Expected price per token and speed of a spot option while it can be had.

    Each preemption (slice hazard per hour) costs a restart and half a checkpoint
    interval of work; provisioning is the only part of that which is not billed.
    """
    per_s = snap.hazard.per_slice_hour(option) / 3600
    r = snap.restart
    productive = max(0.05, 1 - per_s * (r.overhead_s + r.expected_lost_work_s))
    billed = max(0.05, 1 - per_s * r.provisioning_s)
    return SpotEconomics(option.usd_per_token * billed / productive, option.tokens_per_s * productive)


def fluid_plan(snap: Snapshot, horizon_s: float, tokens: float, sigmas: float = PESSIMISM_SIGMAS) -> Plan:
    """Cheapest way to train `tokens` within `horizon_s`, treating the future as a fluid.

    Each spot size is used whenever it can be had, for the pessimistic spot time of
    `SpotAvailability.pessimistic_hours`; what it cannot cover goes to the cheapest
    on-demand size fast enough to fit in the rest of the horizon. Planning on less spot
    than the mean keeps a reserve that shrinks as the deadline nears, so the policy
    does not spend its slack early on slow, cheap slices. A plan that cannot fit is
    kept but priced with a steep penalty, so that the policy moves away from it smoothly.
    """
    if tokens <= 0:
        return Plan(None, None, 0.0, 0.0, 0.0, 0.0, True)
    horizon_s = max(horizon_s, 0.0)
    on_demand = sorted((o for o in snap.options if not o.preemptible), key=lambda o: o.usd_per_token)
    fastest = max(snap.options, key=lambda o: o.tokens_per_s)
    penalty = INFEASIBLE_PENALTY * max(o.usd_per_token for o in snap.options)
    best: Plan | None = None
    for spot in [None, *(o for o in snap.options if o.preemptible)]:
        econ = spot_economics(spot, snap) if spot else SpotEconomics(0.0, 0.0)
        up_s = 3600 * snap.availability.pessimistic_hours(spot.zone, spot.chips, horizon_s / 3600, sigmas) if spot else 0.0
        spot_tokens = min(tokens, econ.tokens_per_up_s * up_s)
        rest = tokens - spot_tokens
        spot_cost = spot_tokens * econ.usd_per_token
        if rest <= 0:
            plan = Plan(spot, None, tokens, 0.0, spot_cost, horizon_s * tokens / (econ.tokens_per_up_s * up_s), True)
        else:
            window_s = horizon_s - up_s - snap.restart.overhead_s
            fit = next((d for d in on_demand if d.tokens_per_s * window_s >= rest), None)
            if fit is not None:
                cost = spot_cost + rest * fit.usd_per_token + fit.usd_per_hour * snap.restart.startup_s / 3600
                plan = Plan(spot, fit, spot_tokens, rest, cost, horizon_s, True)
            else:
                d = max(on_demand, key=lambda o: o.tokens_per_s) if on_demand else None
                fill = d.tokens_per_s * max(window_s, 0.0) if d else 0.0
                short = rest - fill
                cost = spot_cost + rest * (d.usd_per_token if d else 0.0) + short * penalty
                finish = horizon_s + short / fastest.tokens_per_s
                plan = Plan(spot, d, spot_tokens, rest, cost, finish, False)
        if best is None or plan.cost_usd < best.cost_usd:
            best = plan
    assert best is not None
    return best


@dataclass(frozen=True)
class ActionValue:
    option: Option | None
    cost_usd: float  # expected spend to completion if the job takes this action now
    plan: Plan  # the fluid plan after the lookahead
    elapsed_s: float  # time the action covers (less than the lookahead if the job finishes)


def value_of(action: Option | None, snap: Snapshot, lookahead_s: float) -> ActionValue:
    """Expected cost to finish if the job runs `action` for the lookahead, then follows the plan."""
    horizon_s = snap.deadline_s - snap.now_s
    remaining = snap.total_tokens - snap.tokens_done
    if action is None:
        plan = fluid_plan(snap, horizon_s - lookahead_s, remaining)
        return ActionValue(None, plan.cost_usd, plan, lookahead_s)
    r = snap.restart
    overhead_s = snap.current_ready_in_s if action == snap.current else r.overhead_s
    billed_overhead_s = min(overhead_s, r.startup_s)  # startup is the billed tail of a restart
    run_s = max(lookahead_s - overhead_s, 0.0)
    per_s = snap.hazard.per_slice_hour(action) / 3600
    if per_s > 0:  # expected running time before a preemption, and work lost at one
        alive_s = (1 - math.exp(-per_s * run_s)) / per_s
        lost_s = (1 - math.exp(-per_s * run_s)) * r.expected_lost_work_s
    else:
        alive_s, lost_s = run_s, 0.0
    tokens = max(action.tokens_per_s * (alive_s - lost_s), 0.0)
    usd_per_s = action.usd_per_hour / 3600
    if tokens >= remaining:  # finishes inside the lookahead
        used_s = remaining / action.tokens_per_s
        done = Plan(None, None, 0.0, 0.0, 0.0, 0.0, True)
        return ActionValue(action, usd_per_s * (billed_overhead_s + used_s), done, overhead_s + used_s)
    plan = fluid_plan(snap, horizon_s - lookahead_s, remaining - tokens)
    return ActionValue(action, usd_per_s * (billed_overhead_s + alive_s) + plan.cost_usd, plan, lookahead_s)


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
        overhead = snap.current_ready_in_s if d == snap.current else snap.restart.overhead_s
        return overhead + live_left / d.tokens_per_s

    if on_demand:
        fastest = max(on_demand, key=lambda o: o.tokens_per_s)
        fallback_s = snap.decision_interval_s + snap.restart.overhead_s + committed_left / fastest.tokens_per_s
        slack_s = horizon_s - fallback_s - safety_margin_s
        if slack_s < 0:
            return _safety_net(snap, on_demand, od_finish_s, horizon_s, slack_s)

    candidates = [None, *spot_now, *on_demand]
    values = [value_of(a, snap, lookahead_s) for a in candidates]
    # Hysteresis: leaving the current slice must also pay for the startup of coming back
    # to it, or the policy chatters between two sizes at the edge of a plan.
    come_back = snap.current.usd_per_hour * snap.restart.startup_s / 3600 if snap.current else 0.0

    def score(v: ActionValue) -> float:
        return v.cost_usd + (come_back if v.option != snap.current else 0.0)

    best_score = min(score(v) for v in values)
    tolerance = max(0.01, 1e-6 * abs(best_score))

    def preference(v: ActionValue) -> tuple:
        # Among near-equal actions: keep the current slice, then spend nothing, then the
        # cheaper per token, then the smaller slice.
        o = v.option
        return (o != snap.current, o is not None, o.usd_per_token if o else 0.0, o.chips if o else 0)

    chosen = min((v for v in values if score(v) <= best_score + tolerance), key=preference)
    return _decision(snap, chosen.option, _reason(snap, chosen), chosen.cost_usd,
                     snap.now_s + chosen.elapsed_s + chosen.plan.finish_after_s)


def _safety_net(snap, on_demand, od_finish_s, horizon_s, slack_s) -> Decision:
    in_time = [d for d in on_demand if od_finish_s(d) <= horizon_s]
    if not in_time:
        d = min(on_demand, key=od_finish_s)
        late_h = (od_finish_s(d) - horizon_s) / 3600
        return _decision(snap, d, f"deadline at risk: even on-demand {d.name} finishes {late_h:.2f} h late",
                         _finish_cost(snap, d, od_finish_s(d)), snap.now_s + od_finish_s(d))
    d = min(in_time, key=lambda o: _finish_cost(snap, o, od_finish_s(o)))
    reason = (f"safety net: losing spot now would leave {slack_s / 3600:+.2f} h of slack, so run "
              f"on-demand {d.name}, the cheapest slice that finishes in time "
              f"({(horizon_s - od_finish_s(d)) / 3600:.2f} h to spare)")
    return _decision(snap, d, reason, _finish_cost(snap, d, od_finish_s(d)), snap.now_s + od_finish_s(d))


def _finish_cost(snap: Snapshot, d: Option, finish_s: float) -> float:
    """Cost of finishing on on-demand `d` from now: everything but provisioning is billed."""
    if d == snap.current:
        unbilled = max(snap.current_ready_in_s - snap.restart.startup_s, 0.0)
    else:
        unbilled = snap.restart.provisioning_s
    return d.usd_per_hour / 3600 * (finish_s - unbilled)


def _reason(snap: Snapshot, v: ActionValue) -> str:
    o, plan = v.option, v.plan.describe()
    if o is None:
        return f"wait for spot: expected ${v.cost_usd:,.0f} to finish with plan {plan}"
    what = f"{o.tier} {o.name}"
    if o == snap.current:
        return f"keep {what}: cheapest expected cost ${v.cost_usd:,.0f}, then {plan}"
    if snap.current is not None:
        return f"move from {snap.current.label} to {what}: expected ${v.cost_usd:,.0f}, then {plan}"
    return f"run {what}: expected ${v.cost_usd:,.0f}, then {plan}"


def _decision(snap: Snapshot, option: Option | None, reason: str, cost: float, finish_s: float) -> Decision:
    within = snap.budget_usd is None or snap.spent_usd + cost <= snap.budget_usd
    if not within:
        reason += f" (over budget: ${snap.spent_usd + cost:,.0f} expected against ${snap.budget_usd:,.0f})"
    resize = snap.current is not None and option != snap.current
    return Decision(option, reason, cost, finish_s, resize, within)
