"""A job's slice request while it waits for capacity: asked for, looked at, given up.

Make-before-break: a move (to spot, to another size, to on-demand) requests the new
slice beside the running one and the job trains on while it waits. The driver looks at
the request once a poll (`look`, which never blocks): READY means switch; a refusal, an
expiry (the request's queue timeout, which on GCP is the queued resource's own
`validUntil`) or a slice gone means the size is missing now. A refusal is a capacity
fact: the store's slice events (WAITING, then GONE or RELEASED, never billed) are what
the policy reads, and it never spends `max_failures`.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass

from orchestrator import catalog
from orchestrator.domain.spec import JobSpec
from orchestrator.errors import ProvisioningError
from orchestrator.providers.base import CapacityError, Slice, SliceProvider, SliceRequest
from orchestrator.providers.capacity import SpotCapacity
from orchestrator.state.states import SliceState
from policies.cost.clock import Clock

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Waiting:
    """A request made and not READY yet: one slice, or several of one type asked for together
    (`parts`: the others' names, in slice order)."""

    name: str
    accelerator: str
    tier: str
    since: float  # monotonic time of the request
    limit_s: float | None  # wall seconds it may wait; None: as long as the policy wants it
    count: int = 1  # slices the job trains on once it is filled (those it adds to included, for a grow)
    parts: tuple[str, ...] = ()
    grow: bool = False  # slices added beside those the job trains on (same type and tier)

    @property
    def key(self) -> tuple[str, str, int]:
        return self.accelerator, self.tier, self.count

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.parts)


class Look(str, enum.Enum):
    WAITING = "waiting"  # for capacity, or for its hosts to join
    READY = "ready"
    REFUSED = "refused"  # no capacity (refused, expired, reclaimed before it was up): released
    FAILED = "failed"  # capacity came but its hosts could not start (not a capacity fact): released


def clock_for(spec: JobSpec, created_at: float) -> Clock:
    """The job's clock: trace time when it replays a capacity trace, else wall time."""
    t = spec.capacity_trace
    if t is None:
        return Clock(origin=created_at)
    return Clock(origin=created_at, scale=t.time_scale, start_s=t.start_s)


def spot_capacity(spec: JobSpec, created_at: float) -> SpotCapacity | None:
    t = spec.capacity_trace
    if t is None:
        return None
    return SpotCapacity(t.path, clock_for(spec, created_at), grace_s=t.grace_s)


def request(provider: SliceProvider, job_id: str, name: str, spec: JobSpec, accelerator: str, tier: str, *,
            created_at: float, limit_s: float | None) -> Waiting:
    """Ask for the slice without waiting for it; CapacityError if the provider refuses at once."""
    req = SliceRequest(job_id, name, catalog.lookup(accelerator), catalog.Tier(tier), spec.zone,
                       queue_timeout_s=limit_s, spot_capacity=spot_capacity(spec, created_at))
    provider.request(req)
    log.info("job %s: requested %s %s as slice %s (waits %s)", job_id, accelerator, tier, name,
             "while wanted" if limit_s is None else f"up to {limit_s:.1f} s")
    return Waiting(name, accelerator, tier, time.monotonic(), limit_s)


def look(provider: SliceProvider, w: Waiting) -> tuple[Look, Slice | None, str]:
    """One look at the request: what it is now, the slice, and why when refused (then released)."""
    try:
        s = provider.check(w.name)
    except CapacityError as e:
        return _refused(provider, w, str(e))
    except ProvisioningError as e:  # its hosts would not start: gone, but not for capacity
        release(provider, w.name, f"could not start: {e}")
        return Look.FAILED, None, f"could not start: {e}"
    events = provider.poll_events(slices=[w.name])
    if s.state is SliceState.READY:
        return Look.READY, s, ""
    if s.state.terminal:
        return _refused(provider, w, "; ".join(e.reason for e in events) or f"slice {s.state.value}")
    waited = time.monotonic() - w.since
    if w.limit_s is not None and waited > w.limit_s and s.state in (SliceState.REQUESTED, SliceState.WAITING):
        return _refused(provider, w, f"still waiting for capacity after {waited:.1f} s (its queue timeout)")
    return Look.WAITING, s, ""


def _refused(provider: SliceProvider, w: Waiting, why: str) -> tuple[Look, None, str]:
    release(provider, w.name, why)
    return Look.REFUSED, None, why


def release(provider: SliceProvider, name: str, why: str) -> None:
    """Give the request back (idempotent); one that never filled was never billed."""
    try:
        provider.release(name)
    except Exception:  # a cloud that does not answer: the request expires there by itself (validUntil)
        log.exception("could not release slice %s (%s)", name, why)
    else:
        log.info("released slice %s: %s", name, why)
