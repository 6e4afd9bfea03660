"""What the TPU API's states mean as slice states and events.

One look at a slice through the API is a `Seen`; `slice_state` reads it:

    queued resource          node             slice          event
    CREATING, ACCEPTED       -                REQUESTED
    WAITING_FOR_RESOURCES    -                WAITING        NO_CAPACITY past capacity_wait_s
    PROVISIONING             CREATING         PROVISIONING
    ACTIVE                   READY            PROVISIONING until every host joined Ray, then READY
    ACTIVE                   PREEMPTED        GONE           RECLAIMED
    ACTIVE                   TERMINATED, ...  GONE           HOST_LOST
    SUSPENDING (service)     READY            PREEMPTING     PREEMPTION_NOTICE (hosts save within the grace)
    SUSPENDING/SUSPENDED     down             GONE           RECLAIMED
    FAILED (RESOURCE_EXHAUSTED, before ACTIVE)  GONE         NO_CAPACITY
    FAILED (DEADLINE_EXCEEDED: validUntil)      GONE         NO_CAPACITY (the request expired, unbilled)
    FAILED, DELETING, 404                     GONE           HOST_LOST if it had been up

A reading is not yet a move. A capacity refusal (the FAILED row above) while another
zone is left is not a loss: the slice keeps its state and the same request goes on in
the next zone. And the slice's lifecycle (`SLICE_TRANSITIONS`) only goes forward:
`follow` keeps the slice where it is when a reading would take it back (after a
fall-through the new zone's queue reads REQUESTED while the slice has been WAITING
already) or along an edge the table lacks (a reclaim notice before the hosts joined:
PROVISIONING stays PROVISIONING, the RECLAIMED event still goes out). `move` is the one
place a followed slice (`Tracked`) changes state, and it checks the move with `check_slice`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace

from orchestrator.providers.base import Host, SliceEventKind, SliceRequest, host_resource
from orchestrator.providers.gcp.zones import ZonePlan
from orchestrator.state.states import SLICE_TRANSITIONS, SliceState, check_slice

log = logging.getLogger(__name__)

RESOURCE_EXHAUSTED = 8  # google.rpc.Code in a FAILED queued resource's error
DEADLINE_EXCEEDED = 4  # the queued resource's validUntil passed before capacity came
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
    # When (monotonic) the data of `seen` was read: its listing began, or its GET was sent. A reading older than
    # this one is dropped: judged after it, it would take the slice back (a listing begun before a GET that saw
    # the node READY, finished after it, still shows the node CREATING: a READY slice read as lost).
    seen_at: float = 0.0
    # When (monotonic) its create had returned: a zone listing begun since holds its queued resource unless it is
    # gone. One begun before may not hold it yet (`looks.look`). 0: an adopted slice's exists already.
    listable_at: float = 0.0
    ever_up: bool = False  # its node was READY at least once
    hosts: tuple[Host, ...] = ()
    reported: frozenset[SliceEventKind] = frozenset()  # events already reported for this zone
    released: bool = False  # let go by us: being deleted (state not changed yet), or deleted (RELEASED)

    @property
    def zone(self) -> str:
        return self.plan.zone


def move(t: Tracked, state: SliceState) -> Tracked:
    """`t` in `state`; IllegalTransitionError if the slice lifecycle does not allow the move."""
    if state is not t.state:
        check_slice(t.req.name, t.state, state)
    return replace(t, state=state)


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


def follow(current: SliceState, reading: SliceState) -> SliceState:
    """Where a slice in `current` goes on a reading: there, if the lifecycle allows it, else nowhere."""
    return reading if reading in SLICE_TRANSITIONS[current] else current


def loss(seen: Seen, state: SliceState, *, was_up: bool, where: str) -> tuple[SliceEventKind, str] | None:
    """The event a look means when the slice was taken back or lost (`where`: project/zone), else None."""
    q, node = seen.qr, seen.node
    if q == "SUSPENDING" and seen.initiator != "USER" and node == "READY":
        return SliceEventKind.PREEMPTION_NOTICE, f"reclaim notice: queued resource SUSPENDING, initiator " \
                                                 f"{seen.initiator}, in {where}"
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
    if s.qr == "FAILED" and s.error and s.error[0] in (RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED):
        return f"zone {t.zone} has no capacity: {s.error[1]}"
    waited = now - t.since
    if s.qr in QUEUED and waited > capacity_wait_s:
        return f"zone {t.zone}: queued {waited:.0f}s ({s.qr}), past the {capacity_wait_s:.0f}s limit"
    return ""


def still_queued(t: Tracked) -> bool:
    """Whether the request has not got capacity yet: the slice is REQUESTED or WAITING, or
    (having fallen through from PROVISIONING) its queued resource in this zone is queued."""
    return t.state in (SliceState.REQUESTED, SliceState.WAITING) or (t.seen is not None and t.seen.qr in QUEUED)


def judge(t: Tracked, seen: Seen, *, now: float, accept_grace_s: float, capacity_wait_s: float,
          where: str) -> tuple[Tracked, list[tuple[SliceEventKind, str]]]:
    """`t` after the look `seen` (its state moved on as far as the lifecycle allows), and
    the events that look raises (`where`: the project/zone, for their reasons)."""
    never_seen = t.seen is None or t.seen.qr is None
    if seen.qr is None and never_seen and now - t.since < accept_grace_s:
        reading = SliceState.REQUESTED  # created a moment ago, not readable yet
    else:
        reading = slice_state(seen, joined=t.state is SliceState.READY, was_up=t.ever_up)
    hosts = t.hosts or tuple(Host(i, host_resource(t.req.name, i), address=a) for i, a in enumerate(seen.addresses))
    t = replace(t, seen=seen, ever_up=t.ever_up or seen.node == "READY", hosts=hosts)
    why = no_capacity(t, now=now, capacity_wait_s=capacity_wait_s)
    if why and t.plan.left and reading is SliceState.GONE:
        reading = t.state  # refused for capacity, not lost: the same request goes on in the next zone
    if follow(t.state, reading) is not reading:
        log.debug("slice %s stays %s: the API reads %s (%s)", t.req.name, t.state.value, reading.value, seen)
    t = move(t, follow(t.state, reading))
    events = []
    lost = loss(seen, t.state, was_up=t.ever_up, where=where)
    if lost:
        events.append(lost)
    if why:
        events.append((SliceEventKind.NO_CAPACITY, why))
    return t, events
