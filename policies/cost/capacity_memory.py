"""Capacity memory: what slice records (a job's own, and those of earlier jobs in the
same zone, pooled) teach the cost policy about spot there.

Observations are pooled by (zone, slice size, tier): every spot slice of every job in a
zone says when its size could be had, when it was refused or reclaimed, and how long
its hosts lived. A new job starts from what the jobs before it learned instead of the
bare priors: the outage and up-period lengths, the preemption rate, and refusals recent
enough to still hold. Only `pooled` chooses which records count (the zone, and an age
limit: a zone's capacity a month ago says little of it today); `estimates` folds
records into the policy's estimates. No I/O: the store keeps the records (slice events
outlive their job) and the autoscaler hands them in; the simulator hands in those of
the jobs it replayed before.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from policies.cost.slice_history import History, SliceRecord, read_history
from policies.cost.spot_estimates import REFUSAL_HOLDS_S, SpotAvailability, SpotHazard, spot_chips_known

POOL_HORIZON_S = 14 * 24 * 3600.0  # records older than this (policy seconds) are not pooled


def pooled(records: Iterable[SliceRecord], *, zone: str, now_s: float,
           horizon_s: float = POOL_HORIZON_S) -> tuple[SliceRecord, ...]:
    """Earlier jobs' records worth pooling for a job in `zone` now: that zone's, not too old."""
    return tuple(r for r in records if r.zone == zone and now_s - horizon_s <= r.at_s <= now_s)


def estimates(history: History, *, sizes: Sequence[int], availability: SpotAvailability = SpotAvailability(),
              hazard: SpotHazard = SpotHazard()) -> tuple[SpotAvailability, SpotHazard]:
    """The availability and hazard estimates after what `history` shows, on top of the given ones.

    A stretch up says its size and every smaller one could be had; a stretch down, its
    size and every larger one could not (`sizes`: the spot sizes the job may run). A moment
    one could not be had (a reclaim, a refusal: `History.seen`) ends an up period of its
    size and every larger one: without it, the up stretches of a size the job held again and
    again, with reclaims between and no wait for that size, read as one long up period
    (one slice of several after each reclaim of the group: 6-8 h learned for 0.5 h stretches).
    """
    missing = [(at, zone, chips) for at, zone, chips, up in history.seen if not up]
    # In time order, a moment missing before a stretch that starts then: (time, 0, moment) or (time, 1, stretch)
    order = sorted([(m[0], 0, i) for i, m in enumerate(missing)]
                   + [(s.start_s, 1, i) for i, s in enumerate(history.stretches)])
    for _, is_stretch, i in order:
        if not is_stretch:
            _, zone, chips = missing[i]
            availability = availability.end_up(zone, [c for c in sizes if c >= chips])
            continue
        s = history.stretches[i]
        which = [c for c in sizes if (c <= s.chips if s.up else c >= s.chips)]
        availability = availability.observe(s.zone, which, s.chips if s.up else 0, s.end_s - s.start_s)
    for (tier, zone) in sorted({*history.host_hours, *history.preemptions}):
        hazard = hazard.observe(tier, zone, host_hours=history.host_hours.get((tier, zone), 0.0),
                                preemptions=history.preemptions.get((tier, zone), 0))
    return availability, hazard


def chips_known(history: History, *, zone: str, sizes: Sequence[int], largest: int, now_s: float,
                hold_s: float = REFUSAL_HOLDS_S) -> int:
    """The largest spot size worth asking for now (`spot_chips_known` over the history's
    refusals and slices up in `zone`); 0 when none of `sizes` is left."""
    seen = [(at, chips, up) for at, z, chips, up in history.seen if z == zone]
    return spot_chips_known(sizes, largest=largest, seen=seen, now=now_s, hold_s=hold_s)


def learn(records: Iterable[SliceRecord], *, now_s: float, sizes: Sequence[int],
          availability: SpotAvailability = SpotAvailability(),
          hazard: SpotHazard = SpotHazard()) -> tuple[History, SpotAvailability, SpotHazard]:
    """`read_history` then `estimates`: what the records teach, with the history read."""
    history = read_history(records, now_s)
    return (history, *estimates(history, sizes=sizes, availability=availability, hazard=hazard))
