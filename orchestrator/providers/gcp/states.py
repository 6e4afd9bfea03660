"""What the TPU API's states mean as slice states and events.

One look at a slice through the API is a `Seen`; `slice_state` reads it:

    queued resource          node             slice          event
    CREATING, ACCEPTED       -                REQUESTED
    WAITING_FOR_RESOURCES    -                WAITING        NO_CAPACITY past capacity_wait_s
    PROVISIONING             CREATING         PROVISIONING
    ACTIVE                   READY            PROVISIONING until every host joined Ray, then READY
    ACTIVE                   PREEMPTED        GONE           RECLAIMED
    ACTIVE                   TERMINATED, ...  GONE           HOST_LOST
    SUSPENDING (service)     READY            PREEMPTING     RECLAIMED
    SUSPENDING/SUSPENDED     down             GONE           RECLAIMED
    FAILED (RESOURCE_EXHAUSTED, before ACTIVE)  GONE         NO_CAPACITY
    FAILED, DELETING, 404                     GONE           HOST_LOST if it had been up
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from orchestrator.providers.base import Host, SliceEventKind, SliceRequest, host_resource
from orchestrator.providers.gcp.zones import ZonePlan
from orchestrator.state.states import SliceState

RESOURCE_EXHAUSTED = 8  # google.rpc.Code in a FAILED queued resource's error
QUEUED = ("CREATING", "ACCEPTED", "WAITING_FOR_RESOURCES")  # queued resource states before capacity came


@dataclass(frozen=True)
class Seen:
    """One look at a slice through the API."""

    qr: str | None  # QueuedResourceState.State name; None: the queued resource is gone (404)
    initiator: str = ""
    error: tuple[int, str] | None = None  # a FAILED queued resource's (google.rpc code, message)
    node: str | None = None  # Node.State name; None: no node (yet, or any more)
    addresses: tuple[str, ...] = ()


@dataclass(frozen=True)
class Tracked:
    """What the provider knows of one slice it follows."""

    req: SliceRequest
    plan: ZonePlan  # the zone asked now, where to fall through to when it has no capacity
    since: float  # monotonic time the queued resource was created in this zone
    created_at: float = field(default_factory=time.time)
    state: SliceState = SliceState.REQUESTED
    seen: Seen | None = None
    ever_up: bool = False  # its node was READY at least once
    hosts: tuple[Host, ...] = ()
    reported: frozenset[SliceEventKind] = frozenset()  # events already reported for this zone
    released: bool = False

    @property
    def zone(self) -> str:
        return self.plan.zone


def slice_state(seen: Seen, *, joined: bool, was_up: bool) -> SliceState:
    """The slice state a look at the API means; `joined`: its hosts have joined Ray;
    `was_up`: its node has been READY before (so a missing node is a lost one)."""
    q, node = seen.qr, seen.node
    if q in ("CREATING", "ACCEPTED"):
        return SliceState.REQUESTED
    if q == "WAITING_FOR_RESOURCES":
        return SliceState.WAITING
    if q == "PROVISIONING" or (q == "ACTIVE" and node in (None, "CREATING") and not was_up):
        return SliceState.PROVISIONING
    if q == "ACTIVE" and node == "READY":
        return SliceState.READY if joined else SliceState.PROVISIONING
    if q == "SUSPENDING" and node == "READY":
        return SliceState.PREEMPTING  # reclaim notice: the hosts have their grace period left
    return SliceState.GONE  # 404, node down, SUSPENDED, FAILED, DELETING


def loss(seen: Seen, state: SliceState, *, was_up: bool, where: str) -> tuple[SliceEventKind, str] | None:
    """The event a look means when the slice was taken back or lost (`where`: project/zone), else None."""
    q, node = seen.qr, seen.node
    if (q in ("SUSPENDING", "SUSPENDED") and seen.initiator != "USER") or node == "PREEMPTED":
        return SliceEventKind.RECLAIMED, f"queued resource {q}, initiator {seen.initiator}, node {node} in {where}"
    if state is SliceState.GONE and was_up:
        return SliceEventKind.HOST_LOST, f"queued resource {q}, node {node} in {where}"
    return None


def no_capacity(t: Tracked, *, now: float, capacity_wait_s: float) -> str:
    """Why the slice's zone has no capacity for it, or "" if it may still come."""
    s = t.seen
    if s is None or t.ever_up:
        return ""
    if s.qr == "FAILED" and s.error and s.error[0] == RESOURCE_EXHAUSTED:
        return f"zone {t.zone} has no capacity: {s.error[1]}"
    waited = now - t.since
    if s.qr in QUEUED and waited > capacity_wait_s:
        return f"zone {t.zone}: queued {waited:.0f}s ({s.qr}), past the {capacity_wait_s:.0f}s limit"
    return ""


def judge(t: Tracked, seen: Seen, *, now: float, accept_grace_s: float, capacity_wait_s: float,
          where: str) -> tuple[Tracked, list[tuple[SliceEventKind, str]]]:
    """`t` after the look `seen`, and the events that look raises (`where`: the project/zone,
    for their reasons)."""
    never_seen = t.seen is None or t.seen.qr is None
    if seen.qr is None and never_seen and now - t.since < accept_grace_s:
        reading = SliceState.REQUESTED  # created a moment ago, not readable yet
    else:
        reading = slice_state(seen, joined=t.state is SliceState.READY, was_up=t.ever_up)
    hosts = t.hosts or tuple(Host(i, host_resource(t.req.name, i), address=a) for i, a in enumerate(seen.addresses))
    t = replace(t, seen=seen, state=reading, ever_up=t.ever_up or seen.node == "READY", hosts=hosts)
    why = no_capacity(t, now=now, capacity_wait_s=capacity_wait_s)
    events = []
    lost = loss(seen, t.state, was_up=t.ever_up, where=where)
    if lost:
        events.append(lost)
    if why:
        events.append((SliceEventKind.NO_CAPACITY, why))
    return t, events
