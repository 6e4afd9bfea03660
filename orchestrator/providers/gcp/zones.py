"""Which zones a slice may go to, in which order, and what a zone with no capacity means.

A request's own zone (if it names one) goes first, then the provider's zones in their
order; with fall-through off only the first is tried. A reserved slice can only go where
a reservation is. When a zone has no capacity (its queued resource FAILED with
RESOURCE_EXHAUSTED, or it stayed queued past the limit), the provider deletes it there
and asks again in the next zone under the same slice name: still the same request, so
the slice keeps its state (see `GcpTpuProvider._next_zone`). When no zone is left, the
caller gets a `NoCapacityError` listing every zone tried.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from google.cloud import tpu_v2

from orchestrator.catalog import Tier
from orchestrator.errors import ProvisioningError
from orchestrator.providers.base import CapacityError, SliceRequest

Reservation = str | Mapping[str, str] | None  # one reservation name for every zone, or zone -> name


class NoCapacityError(CapacityError):
    """No zone allowed for the slice had capacity; the policy may try another size or later."""

    def __init__(self, slice_name: str, zones: Sequence[str], detail: str):
        self.zones = tuple(zones)
        super().__init__(f"slice {slice_name}: no capacity in zone(s) {', '.join(zones)}: {detail}",
                         slice_name=slice_name)


@dataclass(frozen=True)
class ZonePlan:
    """Where a slice is asked for now, where it may fall through to, and where it has been asked."""

    zone: str
    left: tuple[str, ...]
    tried: tuple[str, ...]

    @classmethod
    def start(cls, zones: Sequence[str]) -> ZonePlan:
        return cls(zones[0], tuple(zones[1:]), (zones[0],))

    def next(self) -> ZonePlan:
        zone = self.left[0]
        return ZonePlan(zone, self.left[1:], self.tried + (zone,))


def zone_order(req: SliceRequest, zones: Sequence[str], *, fallthrough: bool,
               reservation: Reservation) -> tuple[str, ...]:
    """The zones to ask in for `req`, first to last."""
    order = ((req.zone,) if req.zone else ()) + tuple(z for z in zones if z != req.zone)
    if not fallthrough:
        order = order[:1]
    if req.tier is Tier.RESERVED:  # only zones that hold a reservation can serve it
        order = tuple(z for z in order if reservation_in(reservation, z))
        if not order:
            raise ProvisioningError(f"slice {req.name}: tier reserved but no reservation in any zone",
                                    slice_name=req.name)
    return order


def reservation_in(reservation: Reservation, zone: str) -> str | None:
    return reservation.get(zone) if isinstance(reservation, Mapping) else reservation


def tier_fields(tier: Tier, zone: str, *, parent: str, reservation: Reservation) -> dict[str, Any]:
    """The fields of a queued resource in `zone` (`parent`: its location) that ask for `tier`."""
    if tier is Tier.SPOT:
        return {"spot": tpu_v2.QueuedResource.Spot()}
    if tier is Tier.ON_DEMAND:
        return {"guaranteed": tpu_v2.QueuedResource.Guaranteed()}
    name = reservation_in(reservation, zone)
    if name is None:
        raise ProvisioningError(f"tier reserved needs a reservation for zone {zone}; pass reservation=")
    return {"guaranteed": tpu_v2.QueuedResource.Guaranteed(), "reservation_name": f"{parent}/reservations/{name}"}
