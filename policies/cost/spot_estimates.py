"""What a job learns of spot in its zone: how often its slices are preempted, and when
each size can be had.

`SpotHazard` is the preemption rate per host-hour (a multi-host slice dies when any
host dies, so a slice's hazard is hosts x the host hazard), a Gamma-Poisson estimate:
a prior, updated by the preemptions observed over the host-hours held. `SpotAvailability`
estimates, from the capacity seen so far, the fraction of time each spot size can be
had and how long its up periods and outages last. `spot_chips_known` is what a job
without a capacity feed may count on, from what its own slices showed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from policies.cost.slice_options import SPOT, Option

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

REFUSAL_HOLDS_S = 600.0  # spot capacity the zone refused a job this recently is taken to be missing still
REFUSAL_MAX_HOLD_S = 4800.0  # the longest a refusal holds, after several of the size in a row


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
                     hold_s: float = REFUSAL_HOLDS_S, max_hold_s: float = REFUSAL_MAX_HOLD_S) -> int:
    """The largest spot size a job without a capacity feed should count on now.

    `seen`: (when, chips, could be had) of what the job's own spot slices showed. Starting
    from `largest` (what it may ask for), in time order, a refusal still held rules out its
    size and every larger one, and a slice up since says its size can be had. A refusal
    holds `hold_s`, doubled for each refusal of the size (or a smaller one) before it with
    no slice of the size up in between, up to `max_hold_s`: a size refused again and again
    is asked for again less and again less often, not every `hold_s` of a long outage.
    Returns 0 when no size in `sizes` is left.
    """
    cap = largest
    refused_since_up = {c: 0 for c in sizes}  # refusals saying the size was missing, since it was last seen up
    for at, chips, up in sorted(seen):
        if up:
            cap = max(cap, chips)
            refused_since_up |= {c: 0 for c in sizes if c <= chips}
            continue
        doublings = min(refused_since_up.get(chips, 0), 30)  # (past any max: no float overflow in a long record)
        held_s = min(hold_s * 2 ** doublings, max(max_hold_s, hold_s))
        refused_since_up |= {c: n + 1 for c, n in refused_since_up.items() if c >= chips}
        if at >= now - held_s:
            cap = min(cap, chips - 1)
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

    def seen_up(self, zone: str, chips: int) -> bool:
        """Whether the size was ever seen up (its prior aside)."""
        return self._counts(zone, chips).available_h > 0

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

    def end_up(self, zone: str, sizes: Sequence[int]) -> SpotAvailability:
        """The estimate after a moment at which each of `sizes` could not be had (a reclaim, a refusal):
        an up period under way ends there, however the next observation comes."""
        counts = dict(self.counts)
        for chips in sizes:
            c = self._counts(zone, chips)
            if c.up_now:
                ups = c.ups.add(c.current_h) if c.current_h > 0 else c.ups
                counts[(zone, chips)] = replace(c, ups=ups, up_now=False, current_h=0.0)
        return replace(self, counts=counts)

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
                if c.current_h > 0:  # (an up period cut by `end_up` starts an outage of unseen length)
                    ups, downs = (ups.add(c.current_h), downs) if c.up_now else (ups, downs.add(c.current_h))
                current = hours
            counts[(zone, chips)] = AvailabilityCounts(
                c.available_h + (hours if up else 0.0), c.observed_h + hours, ups, downs, up, current)
        return replace(self, counts=counts)
