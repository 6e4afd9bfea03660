"""What a job's slices cost: each slice's billing window and price, from the job's slice events."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from orchestrator.catalog import lookup
from orchestrator.errors import UnknownAcceleratorError
from orchestrator.state.events import EventKind, SliceChanged
from orchestrator.state.store import Event

log = logging.getLogger(__name__)

_BILLING_ENDS = ("GONE", "RELEASED")


@dataclass(frozen=True)
class BilledSlice:
    """One slice's billing window: it costs `usd_per_hour` from `start` to `end`."""

    name: str
    accelerator: str
    tier: str
    chips: int
    usd_per_hour: float
    start: float
    end: float

    @property
    def usd(self) -> float:
        return self.usd_until(self.end)

    def usd_until(self, t: float) -> float:
        """Dollars billed for this slice up to time `t`."""
        return self.usd_per_hour * max(0.0, min(t, self.end) - self.start) / 3600.0


def billed_slices(events: list[Event], *, end: float) -> list[BilledSlice]:
    """Each slice of the job's slice events with its billing window (open windows close at `end`)."""
    by_name: dict[str, list[tuple[float, SliceChanged]]] = {}
    for e in events:
        if e.kind is EventKind.SLICE and (changed := e.payload_as(SliceChanged)).name:
            by_name.setdefault(changed.name, []).append((e.at, changed))
    out = []
    for name, evs in by_name.items():
        first = next((x for x in evs if x[1].state == "REQUESTED"), evs[0])
        waited = [i for i, (_, s) in enumerate(evs) if s.state == "WAITING"]
        if waited:  # billed from when capacity came (after the last wait: a zone fall-through waits again)
            allocated = next((x for x in evs[waited[-1]:] if x[1].state not in ("WAITING", *_BILLING_ENDS)), None)
            if allocated is None:  # let go while still queued: never allocated, never billed
                continue
            first = allocated
        last = next((x for x in evs if x[1].state in _BILLING_ENDS and x[0] >= first[0]), None)
        accelerator, tier = str(first[1].accelerator or "?"), str(first[1].tier or "?")
        price = next((s.usd_per_hour for _, s in evs if s.usd_per_hour is not None), None)
        chips = next((s.chips for _, s in evs if s.chips is not None), None)
        if price is None or chips is None:
            price, chips = _catalog_facts(accelerator, tier, price, chips)
        stop = last[0] if last is not None else max(end, first[0])
        out.append(BilledSlice(name, accelerator, tier, int(chips), float(price), first[0], stop))
    return sorted(out, key=lambda s: s.start)


def _catalog_facts(accelerator: str, tier: str, price, chips) -> tuple[float, int]:
    """The catalog's price and chips for what a slice event left out (0 for a type the catalog lacks)."""
    try:
        t = lookup(accelerator)
    except UnknownAcceleratorError:
        log.warning("slice of unknown accelerator %r: billed at $0", accelerator)
        return price or 0.0, chips or 0
    try:
        list_price = t.usd_per_hour(tier)
    except ValueError:  # an unknown tier: plan with the on-demand price, the higher one
        list_price = t.usd_per_hour("on-demand")
    return (list_price if price is None else price), (t.chips if chips is None else chips)
