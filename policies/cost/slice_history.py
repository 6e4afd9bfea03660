"""What a job's slices showed of spot capacity, read from slice records: the one reading
that the autoscaler (over the store's slice events) and the simulator (over the records
it emits) share.

A `SliceRecord` is one change of one slice, in the store's slice lifecycle (REQUESTED,
WAITING, PROVISIONING, READY, PREEMPTING, GONE, RELEASED), with the slice's tier, size
and zone. For spot slices `read_history` takes from them:

- a stretch WAITING for capacity, or under a preemption notice (PREEMPTING), says the
  size and every larger one could not be had then; a stretch READY says the size and
  every smaller one could;
- a refusal (size missing at a moment): a request let go or lost before it was ever
  READY (a queue timeout, a request no longer wanted, a fill that vanished), and a
  READY or PREEMPTING slice lost without being released: a reclaim, with or without a
  notice first, is never read as "spot is up"; and a request still waiting or a notice
  still running: the size is missing now;
- exposure and preemptions for the hazard: host-hours READY or PREEMPTING, and losses
  after READY.

An on-demand slice lost (a host died) says nothing about spot: no refusal, no
preemption. Times are policy seconds on one clock (the simulator's: from the job's
start; the autoscaler's: the same, through `policies.cost.clock.Clock`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from policies.cost.slice_options import SPOT

UP, DOWN = "READY", ("WAITING", "PREEMPTING")
ENDED = ("GONE", "RELEASED")


@dataclass(frozen=True)
class SliceRecord:
    at_s: float
    name: str
    state: str  # a SliceState value
    tier: str
    chips: int
    hosts: int
    zone: str = "default"


@dataclass(frozen=True)
class Stretch:
    """A stretch during which a spot slice showed its size could (`up`) or could not be had."""

    zone: str
    chips: int
    start_s: float
    end_s: float
    up: bool


@dataclass(frozen=True)
class History:
    """What a list of slice records says of spot, up to `now_s`."""

    stretches: tuple[Stretch, ...]  # oldest first
    seen: tuple[tuple[float, str, int, bool], ...]  # (when, zone, chips, could be had): refusals, and ups until
    host_hours: Mapping[tuple[str, str], float]  # spot exposure by (tier, zone)
    preemptions: Mapping[tuple[str, str], int]  # by (tier, zone)


def read_history(records: Iterable[SliceRecord], now_s: float) -> History:
    """Read `records` (any order, several slices mixed) as of `now_s`; later records are ignored."""
    by_name: dict[str, list[SliceRecord]] = {}
    for r in sorted(records, key=lambda r: r.at_s):
        if r.at_s <= now_s and r.tier == SPOT and r.chips:
            by_name.setdefault(r.name, []).append(r)
    stretches, seen = [], []
    host_hours: dict[tuple[str, str], float] = {}
    preemptions: dict[tuple[str, str], int] = {}
    for evs in by_name.values():
        was_ready = False
        for r, after in zip(evs, [*evs[1:], None], strict=True):
            end = after.at_s if after is not None else now_s
            key = (r.tier, r.zone)
            if r.state in (UP, *DOWN) and end > r.at_s:
                stretches.append(Stretch(r.zone, r.chips, r.at_s, end, r.state == UP))
            if r.state == UP and not (after is not None and after.state == "GONE"):
                seen.append((end, r.zone, r.chips, True))  # up until then (a reclaim below says otherwise)
            if r.state in (UP, "PREEMPTING"):
                host_hours[key] = host_hours.get(key, 0.0) + r.hosts * (end - r.at_s) / 3600
                was_ready = True
            if r.state in DOWN and after is None:
                seen.append((now_s, r.zone, r.chips, False))  # still waiting, or a notice: missing now
            if after is not None and after.state in ENDED and r.state not in ENDED:
                if after.state == "GONE" or r.state == "WAITING":  # reclaimed or vanished, or let go unfilled
                    seen.append((after.at_s, r.zone, r.chips, False))
                if after.state == "GONE" and was_ready:
                    preemptions[key] = preemptions.get(key, 0) + 1
    stretches.sort(key=lambda s: (s.start_s, s.end_s))
    return History(tuple(stretches), tuple(sorted(seen)), host_hours, preemptions)
