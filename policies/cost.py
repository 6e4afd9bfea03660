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
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property

SPOT = "spot"
ON_DEMAND = "on-demand"
RESERVED = "reserved"

# Restart figures used until the orchestrator feeds measured ones (DESIGN.md: 60-180 s
# to provision a slice; init + orbax restore + XLA compile of a ~1B model, a few minutes).
DEFAULT_PROVISIONING_S = 120.0
DEFAULT_STARTUP_S = 240.0
DEFAULT_CHECKPOINT_INTERVAL_S = 600.0  # the longest interval: what the job checkpoints at without preemptions
# Training time one checkpoint costs: the blocking part of an async orbax save (the
# state copied to host memory) plus the slowdown while it is written. An assumption
# for a ~1B model (12 GB of parameters and Adam moments over 2-8 hosts) until a job
# measures its own; the local cluster measures a fraction of a second for its small model.
DEFAULT_SAVE_S = 5.0
MIN_CHECKPOINT_INTERVAL_S = 60.0

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
REFUSAL_HOLDS_S = 600.0  # spot capacity the zone refused a job this recently is taken to be missing still
LOOKAHEAD_S = 3600.0  # long enough to amortise a restart, short against a day-long job
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

    @cached_property
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
    checkpoint_interval_s: float = DEFAULT_CHECKPOINT_INTERVAL_S  # the longest; shorter on spot (below)
    save_s: float = DEFAULT_SAVE_S  # training time one checkpoint costs
    # Whether a preemption notice (GCE gives about 30 s) leaves time to commit a checkpoint,
    # so that a preemption loses no work. Off by default: whether a big state commits that
    # fast from every host of a slice is not known here.
    saves_on_notice: bool = False

    @property
    def overhead_s(self) -> float:
        return self.provisioning_s + self.startup_s

    def interval_s(self, hazard_per_hour: float) -> float:
        """How often to checkpoint a slice preempted `hazard_per_hour` times an hour.

        Young and Daly's first-order optimum sqrt(2 x save cost x mean time between
        preemptions) balances the time spent saving (save_s / interval) against the work
        lost at a preemption (half an interval on average), kept between
        `MIN_CHECKPOINT_INTERVAL_S` and the job's own interval.
        """
        if hazard_per_hour <= 0 or self.saves_on_notice:
            return self.checkpoint_interval_s
        best = math.sqrt(2 * self.save_s * 3600 / hazard_per_hour)
        return min(max(best, MIN_CHECKPOINT_INTERVAL_S), self.checkpoint_interval_s)

    def train_s(self, tokens: float, tokens_per_s: float, hazard_per_hour: float = 0.0) -> float:
        """Time to train `tokens` without a preemption: the training plus the saves on the way."""
        run_s = tokens / tokens_per_s
        saves = max(math.ceil(run_s / self.interval_s(hazard_per_hour) - 1e-9) - 1, 0)  # none at the end
        return run_s + self.save_s * saves

    def lost_fraction(self, hazard_per_hour: float) -> float:
        """Share of a slice's time lost to restarts, lost work and saves at that hazard."""
        interval, per_s = self.interval_s(hazard_per_hour), hazard_per_hour / 3600
        return per_s * (self.overhead_s + self.lost_per_preemption_s(interval)) + self.save_s / interval

    def lost_per_preemption_s(self, interval_s: float) -> float:
        """Work a preemption loses on average: half an interval, or none if the notice is used."""
        return 0.0 if self.saves_on_notice else interval_s / 2


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


def spot_chips_known(sizes: Sequence[int], *, largest: int, seen: Iterable[tuple[float, int, bool]], now: float,
                     hold_s: float = REFUSAL_HOLDS_S) -> int:
    """The largest spot size a job without a capacity feed should count on now.

    `seen`: (when, chips, could be had) of what the job's own spot slices showed. Starting
    from `largest` (what it may ask for), in time order, a refusal within `hold_s` rules out
    its size and every larger one, and a slice up since says its size can be had.
    Returns 0 when no size in `sizes` is left.
    """
    cap = largest
    for at, chips, up in sorted(seen):
        if at >= now - hold_s:
            cap = max(cap, chips) if up else min(cap, chips - 1)
    return max((c for c in sizes if c <= min(cap, largest)), default=0)


@dataclass(frozen=True)
class PeriodStats:
    """Lengths of completed up (or down) periods: count, sum and sum of squares, in hours."""

    count: int = 0
    total_h: float = 0.0
    total_sq_h2: float = 0.0

    def add(self, hours: float) -> PeriodStats:
        return PeriodStats(self.count + 1, self.total_h + hours, self.total_sq_h2 + hours * hours)

    def moments(self, prior_mean_h: float, current_h: float = 0.0) -> tuple[float, float]:
        """Mean and variance of a period's length. The prior is one exponential period
        (second moment 2 x mean^2); the period under way counts towards the mean as far as it got."""
        ongoing = 1 if current_h > 0 else 0
        mean = (prior_mean_h + self.total_h + current_h) / (1 + self.count + ongoing)
        second = (2 * prior_mean_h**2 + self.total_sq_h2) / (1 + self.count)
        return mean, max(second - mean * mean, 0.0)


@dataclass(frozen=True)
class AvailabilityCounts:
    available_h: float = 0.0
    observed_h: float = 0.0
    ups: PeriodStats = PeriodStats()
    downs: PeriodStats = PeriodStats()
    up_now: bool | None = None  # None before the first observation
    current_h: float = 0.0  # length of the period under way


@dataclass(frozen=True)
class SpotAvailability:
    """How often a spot slice of each size can be had in a zone, and how its up and down
    periods are distributed (learned from the capacity seen, on top of a prior)."""

    prior_fraction: float = PRIOR_AVAILABLE_FRACTION
    prior_hours: float = PRIOR_AVAILABILITY_HOURS
    prior_outage_h: float = PRIOR_OUTAGE_HOURS
    prior_uptime_h: float = PRIOR_UPTIME_HOURS
    counts: Mapping[tuple[str, int], AvailabilityCounts] = field(default_factory=dict)

    def _counts(self, zone: str, chips: int) -> AvailabilityCounts:
        return self.counts.get((zone, chips), AvailabilityCounts())

    def fraction(self, zone: str, chips: int) -> float:
        c = self._counts(zone, chips)
        return (self.prior_fraction * self.prior_hours + c.available_h) / (self.prior_hours + c.observed_h)

    def uptime_h(self, zone: str, chips: int) -> tuple[float, float]:
        """Mean and variance of the length of a period during which the slice can be had."""
        c = self._counts(zone, chips)
        return c.ups.moments(self.prior_uptime_h, c.current_h if c.up_now else 0.0)

    def outage_h(self, zone: str, chips: int) -> tuple[float, float]:
        """Mean and variance of the length of an outage."""
        c = self._counts(zone, chips)
        return c.downs.moments(self.prior_outage_h, c.current_h if c.up_now is False else 0.0)

    def spread_h(self, zone: str, chips: int) -> float:
        """Standard deviation of the hours a slice can be had in a horizon of H hours, / sqrt(H).

        Up and down periods alternate (means u, d; variances su, sd); over a long
        horizon H the time up has variance (u^2 sd + d^2 su) / (u + d)^3 x H
        (alternating renewal process), so the spread grows as sqrt(H) while the mean
        grows as H, and heavy-tailed outages widen it.
        """
        (u, var_u), (d, var_d) = self.uptime_h(zone, chips), self.outage_h(zone, chips)
        return math.sqrt((u * u * var_d + d * d * var_u) / (u + d) ** 3)

    def observe(self, zone: str, sizes: Sequence[int], capacity_chips: int, seconds: float) -> SpotAvailability:
        """The estimate after `seconds` during which the zone could give `capacity_chips`."""
        hours = seconds / 3600
        counts = dict(self.counts)
        for chips in sizes:
            c = self._counts(zone, chips)
            up = capacity_chips >= chips
            ups, downs, current = c.ups, c.downs, c.current_h + hours
            if c.up_now is not None and up != c.up_now:  # the period under way ended
                ups, downs = (ups.add(c.current_h), downs) if c.up_now else (ups, downs.add(c.current_h))
                current = hours
            counts[(zone, chips)] = AvailabilityCounts(
                c.available_h + (hours if up else 0.0), c.observed_h + hours, ups, downs, up, current)
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
    on_demand_second: Option | None = None  # a faster size for part of the on-demand tokens
    on_demand_second_tokens: float = 0.0

    def describe(self) -> str:
        parts = []
        if self.spot and self.spot_tokens > 0:
            parts.append(f"spot {self.spot.name} for {self.spot_tokens / 1e9:.2f}B tokens")
        first = self.on_demand_tokens - self.on_demand_second_tokens
        if self.on_demand and first > 0:
            parts.append(f"on-demand {self.on_demand.name} for {first / 1e9:.2f}B")
        if self.on_demand_second and self.on_demand_second_tokens > 0:
            parts.append(f"on-demand {self.on_demand_second.name} for {self.on_demand_second_tokens / 1e9:.2f}B")
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
    checkpoint_interval_s: float | None = None  # how often to checkpoint on `option`


def slice_hazard_per_hour(option: Option, snap: Snapshot) -> float:
    """Preemptions per hour of holding `option`: the job's own estimate (`SpotHazard`), or,
    if shorter-lived, what the zone's capacity says (one drop per mean up period of the
    size), since the capacity signal is seen even while the job holds no spot slice."""
    if not option.preemptible:
        return 0.0
    mean_up_h = snap.availability.uptime_h(option.zone, option.chips)[0]
    return max(snap.hazard.per_slice_hour(option), 1 / max(mean_up_h, 1e-3))


@dataclass(frozen=True)
class SpotOutlook:
    """What the policy expects of one spot option; computed once per decision."""

    option: Option
    hazard_per_hour: float
    usd_per_token: float  # restarts and lost work after preemptions folded in
    tokens_per_up_s: float  # speed x productive fraction, while the slice can be had
    fraction: float  # of the time the slice can be had
    spread_h: float  # standard deviation of spot hours over a horizon of H hours, / sqrt(H)

    def up_s(self, horizon_s: float, sigmas: float) -> float:
        """Seconds the slice can be had within the horizon, `sigmas` deviations from the mean."""
        if horizon_s <= 0:
            return 0.0
        hours = horizon_s / 3600
        return 3600 * min(max(self.fraction * hours + sigmas * self.spread_h * math.sqrt(hours), 0.0), hours)


@dataclass(frozen=True)
class Outlook:
    """Everything the fluid plan needs, derived from a snapshot once per decision."""

    spot: tuple[SpotOutlook, ...]
    on_demand: tuple[Option, ...]  # cheapest per token first
    on_demand_pairs: tuple[tuple[Option, Option], ...]  # (cheaper and slower, faster) pairs to mix
    fastest_tokens_per_s: float
    penalty_per_token: float
    restart: RestartCost


def outlook(snap: Snapshot) -> Outlook:
    """The snapshot's options with their expected economics.

    Each preemption (slice hazard per hour) costs a restart and half a checkpoint
    interval of work, and provisioning is the only part of that which is not billed;
    the checkpoints themselves cost `RestartCost.save_s` each.
    """
    r, spot = snap.restart, []
    for o in (o for o in snap.options if o.preemptible):
        hazard = slice_hazard_per_hour(o, snap)
        productive = max(0.05, 1 - r.lost_fraction(hazard))
        billed = max(0.05, 1 - hazard / 3600 * r.provisioning_s)
        spot.append(SpotOutlook(o, hazard, o.usd_per_token * billed / productive, o.tokens_per_s * productive,
                                snap.availability.fraction(o.zone, o.chips),
                                snap.availability.spread_h(o.zone, o.chips)))
    on_demand = tuple(sorted((o for o in snap.options if not o.preemptible), key=lambda o: o.usd_per_token))
    pairs = tuple((a, b) for a in on_demand for b in on_demand
                  if a.usd_per_token < b.usd_per_token and a.tokens_per_s < b.tokens_per_s)
    return Outlook(tuple(spot), on_demand, pairs, max(o.tokens_per_s for o in snap.options),
                   INFEASIBLE_PENALTY * max(o.usd_per_token for o in snap.options), r)


def fluid_plan(view: Outlook, horizon_s: float, tokens: float, sigmas: float = 0.0,
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
            plan = Plan(spot.option, None, tokens, 0.0, spot_cost, horizon_s * tokens / (spot.tokens_per_up_s * up_s), True)
        else:
            window_s = (horizon_s - up_s - restart.overhead_s) * (1 - restart.save_s / restart.checkpoint_interval_s)
            fill = _on_demand_fill(view, rest, window_s, start_usd)
            if fill is not None:
                cost, fit, second, second_tokens = fill
                plan = Plan(spot and spot.option, fit, spot_tokens, rest, spot_cost + cost, horizon_s, True,
                            second, second_tokens)
            else:
                d = max(view.on_demand, key=lambda o: o.tokens_per_s) if view.on_demand else None
                short = rest - (d.tokens_per_s * max(window_s, 0.0) if d else 0.0)
                cost = spot_cost + rest * (d.usd_per_token if d else 0.0) + short * view.penalty_per_token
                finish = horizon_s + short / view.fastest_tokens_per_s
                plan = Plan(spot and spot.option, d, spot_tokens, rest, cost, finish, False)
        if best is None or plan.cost_usd < best.cost_usd:
            best = plan
    return best


def _on_demand_fill(view: Outlook, tokens: float, window_s: float, start_usd) -> tuple | None:
    """Cheapest on-demand way to train `tokens` within `window_s`: one size, or a cheaper
    (slower) size for as long as the window allows and a faster one for the rest (one
    more restart). Returns (cost, first size, second size or None, tokens on the second),
    or None if even the fastest size cannot fit."""
    best = None
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


def expected_plan_cost(view: Outlook, horizon_s: float, tokens: float, holding: Option | None) -> tuple[float, Plan]:
    """Mean cost of the fluid plan over the spot-time scenarios, and the plan at the mean."""
    plans = [(fluid_plan(view, horizon_s, tokens, sigmas, holding), weight) for sigmas, weight in SPOT_TIME_SCENARIOS]
    return sum(p.cost_usd * w for p, w in plans), plans[0][0]


@dataclass(frozen=True)
class ActionValue:
    option: Option | None
    cost_usd: float  # expected spend to completion if the job takes this action now
    plan: Plan  # the fluid plan after the lookahead
    elapsed_s: float  # expected time the action covers before the plan takes over (less if it finishes or is preempted)


def value_of(action: Option | None, snap: Snapshot, view: Outlook, lookahead_s: float) -> ActionValue:
    """Expected cost to finish if the job runs `action` for the lookahead, then follows the plan."""
    horizon_s = snap.deadline_s - snap.now_s
    remaining = snap.total_tokens - snap.tokens_done
    if action is None:
        cost, plan = expected_plan_cost(view, horizon_s - lookahead_s, remaining, None)
        return ActionValue(None, cost, plan, lookahead_s)
    r = snap.restart
    overhead_s = snap.current_ready_in_s if action == snap.current else r.overhead_s
    billed_overhead_s = min(overhead_s, r.startup_s)  # startup is the billed tail of a restart
    run_s = max(lookahead_s - overhead_s, 0.0)
    hazard = next((s.hazard_per_hour for s in view.spot if s.option == action), 0.0)
    interval, per_s = r.interval_s(hazard), hazard / 3600
    if per_s > 0:  # expected running time before a preemption, and work lost at one
        alive_s = (1 - math.exp(-per_s * run_s)) / per_s
        lost_s = (1 - math.exp(-per_s * run_s)) * r.lost_per_preemption_s(interval)
    else:
        alive_s, lost_s = run_s, 0.0
    tokens = max(action.tokens_per_s * (alive_s * (1 - r.save_s / interval) - lost_s), 0.0)
    usd_per_s = action.usd_per_hour / 3600
    if tokens >= remaining:  # finishes inside the lookahead
        used_s = r.train_s(remaining, action.tokens_per_s, hazard)
        late = overhead_s + used_s > horizon_s  # a miss, however small: as if no token were in time
        penalty = remaining * view.penalty_per_token if late else 0.0
        done = Plan(None, None, 0.0, 0.0, 0.0, 0.0, not late)
        return ActionValue(action, usd_per_s * (billed_overhead_s + used_s) + penalty, done, overhead_s + used_s)
    # A preempted slice hands over to the plan when it dies, not at the end of the lookahead.
    elapsed_s = overhead_s + alive_s
    cost, plan = expected_plan_cost(view, horizon_s - elapsed_s, remaining - tokens, action)
    return ActionValue(action, usd_per_s * (billed_overhead_s + alive_s) + cost, plan, elapsed_s)


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
        return overhead + snap.restart.train_s(live_left, d.tokens_per_s)

    if on_demand:
        fastest = max(on_demand, key=lambda o: o.tokens_per_s)
        fallback_s = (snap.decision_interval_s + snap.restart.overhead_s
                      + snap.restart.train_s(committed_left, fastest.tokens_per_s))
        slack_s = horizon_s - fallback_s - safety_margin_s
        if slack_s < 0:
            return _safety_net(snap, on_demand, od_finish_s, horizon_s, slack_s)

    candidates = [None, *spot_now, *on_demand]
    view = outlook(snap)
    values = [value_of(a, snap, view, lookahead_s) for a in candidates]
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


def _usd(x: float) -> str:
    return f"${x:,.2f}" if abs(x) < 100 else f"${x:,.0f}"


def _reason(snap: Snapshot, v: ActionValue) -> str:
    o, plan, cost = v.option, v.plan.describe(), _usd(v.cost_usd)
    if o is None:
        return f"wait for spot: expected {cost} to finish with plan {plan}"
    what = f"{o.tier} {o.name}"
    if o == snap.current:
        return f"keep {what}: cheapest expected cost {cost}, then {plan}"
    if snap.current is not None:
        return f"move from {snap.current.label} to {what}: expected {cost}, then {plan}"
    return f"run {what}: expected {cost}, then {plan}"


def _decision(snap: Snapshot, option: Option | None, reason: str, cost: float, finish_s: float) -> Decision:
    within = snap.budget_usd is None or snap.spent_usd + cost <= snap.budget_usd
    if not within:
        reason += f" (over budget: {_usd(snap.spent_usd + cost)} expected against {_usd(snap.budget_usd)})"
    resize = snap.current is not None and option != snap.current
    interval = None
    if option is not None:
        interval = snap.restart.interval_s(slice_hazard_per_hour(option, snap))
    return Decision(option, reason, cost, finish_s, resize, within, interval)
