"""`GcpTpuProvider`: a slice's lifecycle on Cloud TPU queued resources.

request creates the queued resource in the first zone; wait_ready follows it (and falls
through to the next zone when one has no capacity) until every host has joined Ray;
poll_events reports what the API shows of the slices it follows; release and list work
by name and by label. How the API's states read is in `states`, the calls themselves in
`api`, the zone order in `zones`, labels and leaks in `gc`, when hosts count as joined in `join`.

Every state change of a slice goes through `states.move`, which checks it against the
lifecycle table (`SLICE_TRANSITIONS`), and is told to `on_change` once.
"""

from __future__ import annotations

import builtins
import logging
import math
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import replace
from typing import Any

from orchestrator.errors import ProvisioningError
from orchestrator.providers.base import Slice, SliceEvent, SliceEventKind, SliceRequest
from orchestrator.providers.gcp.api import CloudApiError, RetryPolicy, TpuApi, queued_resource
from orchestrator.providers.gcp.gc import find_ours, label_value, labelled_ours, labels_for, made_for
from orchestrator.providers.gcp.join import JoinCheck, ray_join_check
from orchestrator.providers.gcp.looks import ZoneListings, look
from orchestrator.providers.gcp.pace import CreatePace, Polling
from orchestrator.providers.gcp.states import Seen, Tracked, judge, move, no_capacity, still_queued
from orchestrator.providers.gcp.zones import NoCapacityError, ZonePlan, tier_fields, zone_order
from orchestrator.providers.startup import WorkerSetup, startup_script
from orchestrator.state.states import SliceState

log = logging.getLogger(__name__)

# Runtime (VM image) per generation, from Google's TPU software versions page.
DEFAULT_RUNTIMES = {"v4": "tpu-ubuntu2204-base", "v5e": "v2-alpha-tpuv5-lite", "v5p": "v2-alpha-tpuv5",
                    "v6e": "v2-alpha-tpuv6e"}


class GcpTpuProvider:
    """`SliceProvider` on Cloud TPU queued resources.

    project, zones: where slices go; `zones` is also the fall-through order when a zone
        has no capacity (a request's own zone, if set, goes first).
    endpoint: None for the real API, or the emulator's URL (``http://127.0.0.1:PORT``).
    credentials: a google.auth Credentials; None means application default credentials
        (anonymous for a loopback http endpoint). `impersonate` names a service account
        to act as, via the IAM credentials API.
    worker_setup: how hosts join the Ray cluster (the head's address...); needed by `request`.
    reservation: for Tier.RESERVED, a reservation name, or zone -> name.
    join_check: whether hosts have joined; default `ray_join_check`.
    create_pace: the project's create quota, shared by the providers of one project (`pace.CreatePace`);
        default: one of this provider's own, at `polling.creates_per_minute`.
    on_change: called with the slice each time one of ours changes state (requested,
        waiting in the queue for capacity, provisioning, ready, preempting, gone,
        released), as the local provider does; the controller records it, which is how a
        job learns what the zone gave it and when it was billed. Never called under the
        provider's lock; an exception in it is logged, not raised. A zone fall-through is
        no change of state: the slice is still the same request, now in another zone.
    """

    name = "gcp"

    def __init__(self, project: str, zones: Sequence[str], *, endpoint: str | None = None, credentials: Any = None,
                 impersonate: str | None = None, node_service_account: str | None = None,
                 worker_setup: WorkerSetup | None = None, reservation: str | Mapping[str, str] | None = None,
                 runtime_versions: Mapping[str, str] | None = None, zone_fallthrough: bool = True,
                 retry: RetryPolicy = RetryPolicy(), polling: Polling = Polling(),
                 join_check: JoinCheck | None = None, sleep: Callable[[float], None] = time.sleep,
                 on_change: Callable[[Slice], None] | None = None, create_pace: CreatePace | None = None):
        if not zones:
            raise ValueError("GcpTpuProvider needs at least one zone")
        self.project, self.zones = project, tuple(zones)
        self._setup, self._node_sa = worker_setup, node_service_account
        self._reservation = reservation
        self._runtimes = {**DEFAULT_RUNTIMES, **(runtime_versions or {})}
        self._fallthrough, self._poll = zone_fallthrough, polling
        self._join_check = join_check or ray_join_check
        self._sleep = sleep
        self._on_change = on_change
        self._api = TpuApi(project, endpoint=endpoint, credentials=credentials, impersonate=impersonate,
                           retry=retry, request_timeout_s=polling.request_timeout_s, sleep=sleep,
                           connections=polling.connections,
                           pace=create_pace or CreatePace(polling.creates_per_minute, burst=polling.create_burst))
        self._lock = threading.Lock()
        self._tracked: dict[str, Tracked] = {}
        self._events: list[SliceEvent] = []
        self._released_at: dict[str, float] = {}  # name -> when released, oldest first (`_forget_released`)
        self._found: dict[str, set[tuple[str, str]]] = {}  # name -> {(zone, "qr"|"node")} seen by list()
        self._listings = ZoneListings(self._api, self.project, list_over=self._poll.list_over,
                                      list_s=self._poll.list_s)

    # -- the SliceProvider protocol --------------------------------------------------------

    def request(self, req: SliceRequest) -> Slice:
        with self._lock:
            t = self._tracked.get(req.name)
        if t is not None and not t.released:
            return self._slice(t)
        zones = zone_order(req, self.zones, fallthrough=self._fallthrough, reservation=self._reservation)
        t = Tracked(req, ZonePlan.start(zones), since=time.monotonic())  # a new slice: its lifecycle starts
        self._create(t)
        t = replace(t, listable_at=time.monotonic())
        with self._lock:
            self._tracked[req.name] = t
            self._released_at.pop(req.name, None)
        log.info("job %s: requested %s %s slice %s in %s/%s", req.job_id, req.tier.value, req.tpu_type.name,
                 req.name, self.project, t.zone)
        self._changed(None, t)
        return self._slice(t)

    def wait_ready(self, name: str, *, timeout_s: float) -> Slice:
        deadline = time.monotonic() + timeout_s
        try:
            return self._wait_ready(name, deadline, timeout_s)
        except ProvisioningError as e:
            # Whatever went wrong, nothing of the slice may stay behind.
            self._teardown_quietly(name, str(e))
            raise

    def _wait_ready(self, name: str, deadline: float, timeout_s: float) -> Slice:
        while True:
            t = self._refresh(name)
            if t.released:
                raise ProvisioningError(f"slice {name} was released while waiting for it", slice_name=name)
            if t.state is SliceState.READY:
                return self._slice(t)
            why = self._no_capacity(t)
            if why and t.plan.left:
                self._next_zone(t, why)
                continue
            if why:
                raise NoCapacityError(name, t.plan.tried, why)
            if t.state is SliceState.GONE:
                failed = t.seen.error if t.seen else None
                raise ProvisioningError(
                    f"slice {name} in {self.project}/{t.zone} was lost while provisioning: "
                    + (f"queued resource FAILED: {failed[1]}" if failed else f"{t.seen}"),
                    slice_name=name, transient=failed is None)
            if time.monotonic() >= deadline and still_queued(t):
                # Still queued when the caller's patience ran out: that is no capacity, too.
                why = f"zone {t.zone}: still {t.seen.qr if t.seen else 'queued'} after the {timeout_s:.0f}s wait"
                with self._lock:
                    self._tracked[name] = self._event(self._tracked[name], SliceEventKind.NO_CAPACITY, why)
                raise NoCapacityError(name, t.plan.tried, why)
            if time.monotonic() >= deadline:
                joined = f"{sum(h.node_id is not None for h in t.hosts)}/{t.req.tpu_type.hosts} hosts joined Ray"
                # Capacity may come elsewhere; hosts that never join will not join elsewhere either.
                raise ProvisioningError(
                    f"slice {name} in {self.project}/{t.zone} not ready after {timeout_s:.0f}s "
                    f"(queued resource {t.seen.qr if t.seen else 'not seen yet'}, {joined})",
                    slice_name=name, transient=not t.ever_up)
            self._sleep(max(0.0, min(self._poll.poll_s, deadline - time.monotonic())))

    def check(self, name: str) -> Slice:
        t = self._refresh(name)
        why = self._no_capacity(t)
        if why and not t.released and t.state is not SliceState.READY:
            if t.plan.left:
                self._next_zone(t, why)
            else:  # refused in every zone (or expired): the request is over; nothing of it is left behind
                self._teardown_quietly(name, why)
        return self.get(name)

    def get(self, name: str) -> Slice:
        with self._lock:
            t = self._tracked.get(name)
        if t is None:
            raise KeyError(name)
        return self._slice(t)

    def release(self, name: str) -> None:
        with self._lock:
            known = name in self._tracked
        if known:
            self._teardown(name, "released")
            return
        with self._lock:
            found = sorted(self._found.pop(name, set()))
        if found:  # found by list(), e.g. a leak
            for zone, kind in found:
                self._api.delete(zone, kind, name)
            return
        # Unknown here (e.g. a controller restarted with the name in its store): look in
        # every zone, and delete only what carries this tool's label.
        for zone in self.zones:
            for kind in ("qr", "node"):
                if labelled_ours(self._api, zone, kind, name):
                    self._api.delete(zone, kind, name)

    def list(self, *, job_id: str | None = None) -> list[Slice]:
        out: dict[tuple[str, str], Slice] = {}
        with self._lock:
            extra = {t.zone for t in self._tracked.values()} - set(self.zones)
        for zone, kind, s in find_ours(self._api, self.zones + tuple(sorted(extra)), provider=self.name):
            with self._lock:
                t = self._tracked.get(s.name)
                self._found.setdefault(s.name, set()).add((zone, kind))
            out[(zone, s.name)] = self._slice(t) if t is not None and t.zone == zone else s
        wanted = None if job_id is None else {job_id, label_value(job_id)}
        return [s for s in out.values() if wanted is None or s.job_id in wanted]

    def poll_events(self, *, slices: Collection[str] | None = None) -> builtins.list[SliceEvent]:
        with self._lock:  # a driver asks about its own few slices: looked up, not found among every one followed
            pairs = (self._tracked.items() if slices is None
                     else ((n, t) for n in slices if (t := self._tracked.get(n)) is not None))
            names = [n for n, t in pairs if not t.released and t.state is not SliceState.GONE]
        for name in names:
            try:
                self._refresh(name)
            except CloudApiError as e:  # one slice's failed look must not hide the others' events
                log.warning("could not look at slice %s: %s", name, e)
        with self._lock:
            self._forget_released()
            if not self._events:
                return []
            mine = [slices is None or e.slice_name in slices for e in self._events]
            events = [e for e, m in zip(self._events, mine, strict=True) if m]
            # Other slices' events stay for their jobs.
            self._events = [e for e, m in zip(self._events, mine, strict=True) if not m]
        return events

    def adopt(self, s: Slice, zone: str) -> None:
        """Follow a READY slice an earlier controller made (found in the store; its workers run on it).

        It is looked at through the API from now on like any other; if its queued resource
        is gone or reclaimed meanwhile, the next look says so.
        """
        req = SliceRequest(job_id=s.job_id, name=s.name, tpu_type=s.tpu_type, tier=s.tier, zone=zone)
        t = Tracked(req, ZonePlan.start([zone]), since=time.monotonic(), state=SliceState.READY, ever_up=True,
                    hosts=s.hosts)
        with self._lock:
            self._tracked[s.name] = t
        log.info("job %s: adopted slice %s in %s/%s", s.job_id, s.name, self.project, zone)

    # -- following a slice ---------------------------------------------------------------

    def _refresh(self, name: str) -> Tracked:
        """Look at the slice through the API, record what that means, and check its hosts."""
        with self._lock:
            t = self._tracked[name]
        if t.released:
            return t
        read = look(self._api, self._listings, t, followed=lambda: self._followed(t.zone))
        with self._lock:
            cur = before = self._tracked[name]
            if cur.released or cur.plan != t.plan or (read is not None and read[1] < cur.seen_at):
                return cur  # released, moved on, or read since
            if read is not None:  # else nothing newer than its last reading yet (`looks.look`)
                cur = self._tracked[name] = replace(self._judge(cur, read[0]), seen_at=read[1])
        self._changed(before.state, cur)
        seen = cur.seen
        if seen is None or cur.state is not SliceState.PROVISIONING or seen.qr != "ACTIVE" or seen.node != "READY":
            return cur
        hosts = tuple(self._join_check(self._slice(cur)))
        with self._lock:
            cur = self._tracked[name]
            if cur.released or cur.plan != t.plan or cur.state is not SliceState.PROVISIONING:
                return cur
            # Joined hosts replace the placeholders (worker id and IP only) of the same worker.
            merged = {h.worker_id: h for h in cur.hosts} | {h.worker_id: h for h in hosts}
            ready = len({h.worker_id for h in hosts}) >= cur.req.tpu_type.hosts
            cur = replace(cur, hosts=tuple(merged[w] for w in sorted(merged)))
            cur = self._tracked[name] = move(cur, SliceState.READY) if ready else cur
        if ready:
            log.info("job %s: slice %s ready in %s/%s", cur.req.job_id, name, self.project, cur.zone)
            self._changed(SliceState.PROVISIONING, cur)
        return cur

    def _changed(self, before: SliceState | None, t: Tracked) -> None:
        """Tell `on_change` of a new state (call without the lock)."""
        if self._on_change is None or t.state is before:
            return
        try:
            self._on_change(self._slice(t))
        except Exception:  # the record of a change must not break following the slice
            log.exception("on_change failed for slice %s (%s)", t.req.name, t.state.value)

    def _followed(self, zone: str) -> int:
        with self._lock:
            return sum(1 for t in self._tracked.values() if t.zone == zone and not t.released)

    def _judge(self, t: Tracked, seen: Seen) -> Tracked:
        """The slice state that `seen` means, and the events it raises (called under the lock)."""
        t, events = judge(t, seen, now=time.monotonic(), accept_grace_s=self._poll.accept_grace_s,
                          capacity_wait_s=self._poll.capacity_wait_s, where=f"{self.project}/{t.zone}")
        for kind, reason in events:
            t = self._event(t, kind, reason)
        return t

    def _no_capacity(self, t: Tracked) -> str:
        """Why this zone has no capacity for the slice, or "" if it may still come."""
        return no_capacity(t, now=time.monotonic(), capacity_wait_s=self._poll.capacity_wait_s)

    def _event(self, t: Tracked, kind: SliceEventKind, reason: str) -> Tracked:
        if kind in t.reported:
            return t
        log.warning("job %s: slice %s: %s: %s", t.req.job_id, t.req.name, kind.value, reason)
        self._events.append(SliceEvent(t.req.name, kind, reason))
        return replace(t, reported=t.reported | {kind})

    def _next_zone(self, t: Tracked, why: str) -> None:
        plan = t.plan.next()
        log.info("job %s: slice %s: %s; trying %s next", t.req.job_id, t.req.name, why, plan.zone)
        self._api.delete(t.zone, "qr", t.req.name)
        with self._lock:
            cur = self._tracked[t.req.name]
            if cur.released or cur.plan != t.plan:  # released, or moved on, while we deleted
                return
            # Still the same request, now in another zone: the slice keeps its state (REQUESTED or
            # WAITING), and the next zone's looks move it on from there, never back.
            moved = self._tracked[t.req.name] = replace(cur, plan=plan, since=time.monotonic(), seen=None,
                                                        seen_at=0.0, listable_at=math.inf, hosts=(),
                                                        reported=frozenset())
        self._create(moved)
        with self._lock:
            cur = self._tracked[t.req.name]
            if not cur.released and cur.plan == plan:
                self._tracked[t.req.name] = replace(cur, listable_at=time.monotonic())

    # -- creating and deleting ----------------------------------------------------------

    def _create(self, t: Tracked) -> None:
        req, zone = t.req, t.zone
        if self._setup is None:
            raise ProvisioningError("GcpTpuProvider needs worker_setup (the Ray head's address) to request slices",
                                    slice_name=req.name)
        parent = self._api.parent(zone)
        qr = queued_resource(
            parent, req.name, accelerator_type=req.tpu_type.name,
            runtime_version=self._runtimes[req.tpu_type.generation.chip.name], labels=labels_for(req),
            startup_script=startup_script(self._setup, req.tpu_type, req.name), service_account=self._node_sa,
            tier=tier_fields(req.tier, zone, parent=parent, reservation=self._reservation),
            valid_for_s=req.queue_timeout_s)
        try:
            self._api.create_queued_resource(zone, req.name, qr)
        except CloudApiError as e:
            if e.code != 409 or not made_for(self._api, zone, req):
                raise
            # A retried create whose first try did land: the queued resource is ours already.
            log.info("queued resource %s already exists in %s/%s; adopting it", req.name, self.project, zone)

    def _teardown(self, name: str, why: str) -> None:
        """Delete the slice's queued resource (and so its node); idempotent."""
        with self._lock:
            t = self._tracked.get(name)
            if t is None or t.released:
                return
            # Marked first, so a concurrent look does not report our own delete as a loss; the
            # state moves to RELEASED once the delete is through (a lifecycle has no way back).
            self._tracked[name] = replace(t, released=True)
        log.info("job %s: deleting slice %s in %s/%s (%s)", t.req.job_id, name, self.project, t.zone, why)
        try:
            self._api.delete(t.zone, "qr", name)
        except CloudApiError:
            with self._lock:
                cur = self._tracked[name]
                if cur.released:
                    self._tracked[name] = replace(cur, released=False)  # a later release() tries again
            raise
        with self._lock:
            cur = self._tracked[name]
            if not cur.released:  # asked for anew meanwhile
                return
            gone = move(cur, SliceState.GONE) if cur.state is SliceState.PREEMPTING else None
            cur = self._tracked[name] = move(gone or cur, SliceState.RELEASED)
            self._released_at.pop(name, None)  # to the end: the dict stays oldest first
            self._released_at[name] = time.monotonic()
        if gone is not None:  # reclaimed: deleted early, under its notice
            self._changed(SliceState.PREEMPTING, gone)
        self._changed(t.state, cur)

    def _forget_released(self) -> None:
        """Drop the slices released more than `forget_after_s` ago, and their events not taken (under the lock;
        the oldest first, so each poll looks only at what it drops)."""
        cutoff, gone = time.monotonic() - self._poll.forget_after_s, set()
        while self._released_at and next(iter(self._released_at.values())) <= cutoff:
            name = next(iter(self._released_at))
            del self._released_at[name]
            if (t := self._tracked.get(name)) is not None and t.state is SliceState.RELEASED:
                del self._tracked[name]
                gone.add(name)
        if gone and self._events:
            self._events = [e for e in self._events if e.slice_name not in gone]

    def _teardown_quietly(self, name: str, why: str) -> None:
        try:
            self._teardown(name, why)
        except CloudApiError as e:
            # Labelled, so `collect_leaked` finds it later; the original error matters more.
            log.error("could not delete slice %s after a failure (gc will find it): %s", name, e)

    # -- records ---------------------------------------------------------------------------

    def _slice(self, t: Tracked) -> Slice:
        r = t.req
        return Slice(r.name, r.job_id, r.tpu_type, r.tier, t.zone, t.state, t.hosts, self.name, t.created_at)
