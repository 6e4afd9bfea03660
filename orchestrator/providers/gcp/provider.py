"""Cloud TPU slices through queued resources (TPU API v2): request, follow, release, collect leaks.

One slice is one queued resource with one node, both named after the slice, whose
``startup-script`` (see `startup.py`) joins the hosts to the Ray cluster. Every node
carries the labels ``managed-by=tpu-orchestrator``, ``orchestrator-job=<job>`` and
``orchestrator-slice=<slice>``; that is how `list` and `collect_leaked` find what this
tool made (a queued resource has no labels of its own in API v2, its node spec does).

How the API's states read as slice states:

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

The client always speaks REST, against the real API as against the emulator, so the
code path the tests exercise is the one that runs in production.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import requests
import tenacity
from google.api_core import exceptions as gexc
from google.api_core.client_options import ClientOptions
from google.cloud import tpu_v2

from orchestrator import catalog
from orchestrator.catalog import Tier, TpuType
from orchestrator.errors import ProvisioningError
from orchestrator.providers.base import (CapacityError, Host, Slice, SliceEvent, SliceEventKind, SliceRequest,
                                         host_resource)
from orchestrator.providers.startup import WorkerSetup, startup_script
from orchestrator.state.states import SliceState

log = logging.getLogger(__name__)

T = TypeVar("T")
QRS = tpu_v2.QueuedResourceState.State
CLOUD_PLATFORM = "https://www.googleapis.com/auth/cloud-platform"

MANAGED_BY_KEY, MANAGED_BY = "managed-by", "tpu-orchestrator"
JOB_KEY, SLICE_KEY = "orchestrator-job", "orchestrator-slice"

# Runtime (VM image) per generation, from Google's TPU software versions page.
DEFAULT_RUNTIMES = {"v4": "tpu-ubuntu2204-base", "v5e": "v2-alpha-tpuv5-lite", "v5p": "v2-alpha-tpuv5",
                    "v6e": "v2-alpha-tpuv6e"}

_TRANSIENT_HTTP = frozenset({429, 500, 502, 503, 504})
# A 429 that is a resource quota, not a request rate: waiting seconds will not free it.
_PERMANENT_REASONS = frozenset({"QUOTA_EXCEEDED"})
_RESOURCE_EXHAUSTED = 8  # google.rpc.Code in a FAILED queued resource's error


class CloudApiError(ProvisioningError):
    """A TPU API call failed; names the project, zone and the API's own reason."""

    def __init__(self, *, action: str, project: str, zone: str, code: int | None, reason: str, message: str,
                 transient: bool, slice_name: str | None = None):
        self.action, self.project, self.zone = action, project, zone
        self.code, self.reason, self.api_message = code, reason, message
        kind = "transient, gave up after retries" if transient else "permanent, not retried"
        super().__init__(
            f"{action} in project {project}, zone {zone} failed: HTTP {code} {reason}: {message} ({kind})",
            slice_name=slice_name, transient=transient,
        )


class NoCapacityError(CapacityError):
    """No zone allowed for the slice had capacity; the policy may try another size or later."""

    def __init__(self, slice_name: str, zones: Sequence[str], detail: str):
        self.zones = tuple(zones)
        super().__init__(f"slice {slice_name}: no capacity in zone(s) {', '.join(zones)}: {detail}",
                         slice_name=slice_name)


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter for transient API errors (429, 5xx, deadline, connection)."""

    attempts: int = 6
    initial_s: float = 1.0
    max_s: float = 30.0
    total_s: float = 120.0


@dataclass(frozen=True)
class Polling:
    poll_s: float = 5.0  # between two looks at a slice in wait_ready
    capacity_wait_s: float = 900.0  # queued longer than this in one zone counts as no capacity
    accept_grace_s: float = 30.0  # a just-created queued resource may not be readable yet
    request_timeout_s: float = 30.0  # one HTTP call


# Given a slice whose node is READY, the hosts that have joined the Ray cluster.
JoinCheck = Callable[[Slice], Sequence[Host]]


def ray_join_check(s: Slice) -> list[Host]:
    """Hosts of `s` alive in the Ray cluster this process is connected to (call ray.init first)."""
    import ray  # here, not at the top: listing or collecting slices needs no Ray

    hosts = []
    for n in ray.nodes():
        labels = n.get("Labels") or {}
        if not n.get("Alive") or labels.get("ray.io/tpu-slice-name") != s.name:
            continue
        w = int(labels.get("ray.io/tpu-worker-id", -1))
        if 0 <= w < s.tpu_type.hosts and host_resource(s.name, w) in (n.get("Resources") or {}):
            hosts.append(Host(w, host_resource(s.name, w), node_id=n["NodeID"], address=n.get("NodeManagerAddress")))
    return sorted(hosts, key=lambda h: h.worker_id)


def label_value(s: str) -> str:
    """`s` as a GCP label value: lowercase letters, digits, - and _, at most 63 characters."""
    return re.sub(r"[^a-z0-9_-]", "-", s.lower())[:63]


@dataclass(frozen=True)
class _Seen:
    """One look at a slice through the API."""

    qr: str | None  # QueuedResourceState.State name; None: the queued resource is gone (404)
    initiator: str = ""
    error: tuple[int, str] | None = None  # a FAILED queued resource's (google.rpc code, message)
    node: str | None = None  # Node.State name; None: no node (yet, or any more)
    addresses: tuple[str, ...] = ()


@dataclass(frozen=True)
class _Tracked:
    req: SliceRequest
    zone: str
    zones_left: tuple[str, ...]  # where to fall through to when this zone has no capacity
    tried: tuple[str, ...]
    since: float  # monotonic time the queued resource was created in this zone
    created_at: float = field(default_factory=time.time)
    state: SliceState = SliceState.REQUESTED
    seen: _Seen | None = None
    ever_up: bool = False  # its node was READY at least once
    hosts: tuple[Host, ...] = ()
    reported: frozenset[SliceEventKind] = frozenset()  # events already reported for this zone
    released: bool = False


def _slice_state(seen: _Seen, *, joined: bool, was_up: bool) -> SliceState:
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
    on_change: called with the slice each time one of ours changes state (requested,
        waiting in the queue for capacity, provisioning, ready, preempting, gone,
        released), as the local provider does; the controller records it, which is how a
        job learns what the zone gave it and when it was billed. Never called under the
        provider's lock; an exception in it is logged, not raised.
    """

    name = "gcp"

    def __init__(self, project: str, zones: Sequence[str], *, endpoint: str | None = None, credentials: Any = None,
                 impersonate: str | None = None, node_service_account: str | None = None,
                 worker_setup: WorkerSetup | None = None, reservation: str | Mapping[str, str] | None = None,
                 runtime_versions: Mapping[str, str] | None = None, zone_fallthrough: bool = True,
                 retry: RetryPolicy = RetryPolicy(), polling: Polling = Polling(),
                 join_check: JoinCheck | None = None, sleep: Callable[[float], None] = time.sleep,
                 on_change: Callable[[Slice], None] | None = None):
        if not zones:
            raise ValueError("GcpTpuProvider needs at least one zone")
        self.project, self.zones = project, tuple(zones)
        self._setup, self._node_sa = worker_setup, node_service_account
        self._reservation = reservation
        self._runtimes = {**DEFAULT_RUNTIMES, **(runtime_versions or {})}
        self._fallthrough, self._retry, self._poll = zone_fallthrough, retry, polling
        self._join_check = join_check or ray_join_check
        self._sleep = sleep
        self._on_change = on_change
        self._client = tpu_v2.TpuClient(
            credentials=_credentials(credentials, impersonate, endpoint), transport="rest",
            client_options=ClientOptions(api_endpoint=endpoint) if endpoint else None,
        )
        self._lock = threading.Lock()
        self._tracked: dict[str, _Tracked] = {}
        self._events: list[SliceEvent] = []
        self._found: dict[str, set[tuple[str, str]]] = {}  # name -> {(zone, "qr"|"node")} seen by list()

    # -- the SliceProvider protocol --------------------------------------------------------

    def request(self, req: SliceRequest) -> Slice:
        with self._lock:
            t = self._tracked.get(req.name)
        if t is not None and not t.released:
            return self._slice(t)
        zones = self._zone_order(req)
        t = _Tracked(req, zones[0], zones[1:], (zones[0],), since=time.monotonic())
        self._create(t)
        with self._lock:
            self._tracked[req.name] = t
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
            if why and t.zones_left:
                self._next_zone(t, why)
                continue
            if why:
                raise NoCapacityError(name, t.tried, why)
            if t.state is SliceState.GONE:
                failed = t.seen.error if t.seen else None
                raise ProvisioningError(
                    f"slice {name} in {self.project}/{t.zone} was lost while provisioning: "
                    + (f"queued resource FAILED: {failed[1]}" if failed else f"{t.seen}"),
                    slice_name=name, transient=failed is None)
            if time.monotonic() >= deadline and t.state in (SliceState.REQUESTED, SliceState.WAITING):
                # Still queued when the caller's patience ran out: that is no capacity, too.
                why = f"zone {t.zone}: still {t.seen.qr if t.seen else 'queued'} after the {timeout_s:.0f}s wait"
                with self._lock:
                    self._tracked[name] = self._event(self._tracked[name], SliceEventKind.NO_CAPACITY, why)
                raise NoCapacityError(name, t.tried, why)
            if time.monotonic() >= deadline:
                joined = f"{sum(h.node_id is not None for h in t.hosts)}/{t.req.tpu_type.hosts} hosts joined Ray"
                # Capacity may come elsewhere; hosts that never join will not join elsewhere either.
                raise ProvisioningError(
                    f"slice {name} in {self.project}/{t.zone} not ready after {timeout_s:.0f}s "
                    f"(queued resource {t.seen.qr if t.seen else 'not seen yet'}, {joined})",
                    slice_name=name, transient=not t.ever_up)
            self._sleep(max(0.0, min(self._poll.poll_s, deadline - time.monotonic())))

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
                self._delete(zone, kind, name)
            return
        # Unknown here (e.g. a controller restarted with the name in its store): look in
        # every zone, and delete only what carries this tool's label.
        for zone in self.zones:
            for kind in ("qr", "node"):
                if self._labelled_ours(zone, kind, name):
                    self._delete(zone, kind, name)

    def list(self, *, job_id: str | None = None) -> list[Slice]:
        out: dict[tuple[str, str], Slice] = {}
        with self._lock:
            extra = {t.zone for t in self._tracked.values()} - set(self.zones)
        for zone in self.zones + tuple(sorted(extra)):
            parent = self._parent(zone)
            nodes = {n.name: n for n in self._call(f"list nodes of {parent}", zone, _all(self._client.list_nodes),
                                                   parent=parent)}
            for qr in self._call(f"list queued resources of {parent}", zone,
                                 _all(self._client.list_queued_resources), parent=parent):
                s = self._slice_from_api(zone, qr, nodes.get(f"{parent}/nodes/{qr.name.rsplit('/', 1)[1]}"))
                if s is not None:
                    out[(zone, s.name)] = s
                    self._remember(s.name, zone, "qr")
            for node in nodes.values():  # nodes made without a queued resource, or orphaned
                if not node.queued_resource and node.labels.get(MANAGED_BY_KEY) == MANAGED_BY:
                    s = self._slice_from_api(zone, None, node)
                    if s is not None:
                        out[(zone, s.name)] = s
                        self._remember(s.name, zone, "node")
        wanted = None if job_id is None else {job_id, label_value(job_id)}
        return [s for s in out.values() if wanted is None or s.job_id in wanted]

    def _remember(self, name: str, zone: str, kind: str) -> None:
        with self._lock:
            self._found.setdefault(name, set()).add((zone, kind))

    def _labelled_ours(self, zone: str, kind: str, name: str) -> bool:
        full = f"{self._parent(zone)}/{'queuedResources' if kind == 'qr' else 'nodes'}/{name}"
        get = self._client.get_queued_resource if kind == "qr" else self._client.get_node
        try:
            found = self._call(f"get {full}", zone, get, name=full)
        except CloudApiError as e:
            if e.code == 404:
                return False
            raise
        if kind == "node" and found.queued_resource:
            return False  # deleted with its queued resource
        if kind == "qr":
            labels = found.tpu.node_spec[0].node.labels if found.tpu.node_spec else {}
        else:
            labels = found.labels
        return labels.get(MANAGED_BY_KEY) == MANAGED_BY

    def poll_events(self) -> list[SliceEvent]:
        with self._lock:
            names = [n for n, t in self._tracked.items() if not t.released and t.state is not SliceState.GONE]
        for name in names:
            try:
                self._refresh(name)
            except CloudApiError as e:  # one slice's failed look must not hide the others' events
                log.warning("could not look at slice %s: %s", name, e)
        with self._lock:
            events, self._events = self._events, []
        return events

    # -- following a slice ---------------------------------------------------------------

    def _refresh(self, name: str) -> _Tracked:
        """Look at the slice through the API, record what that means, and check its hosts."""
        with self._lock:
            t = self._tracked[name]
        if t.released:
            return t
        seen = self._look(t)
        with self._lock:
            cur = self._tracked[name]
            if cur.released or cur.zone != t.zone:  # released, or moved on, while we looked
                return cur
            before = cur.state
            cur = self._tracked[name] = self._judge(cur, seen)
        self._changed(before, cur)
        if cur.state is not SliceState.PROVISIONING or seen.qr != "ACTIVE" or seen.node != "READY":
            return cur
        hosts = tuple(self._join_check(self._slice(cur)))
        with self._lock:
            cur = self._tracked[name]
            if cur.released or cur.zone != t.zone or cur.state is not SliceState.PROVISIONING:
                return cur
            # Joined hosts replace the placeholders (worker id and IP only) of the same worker.
            merged = {h.worker_id: h for h in cur.hosts} | {h.worker_id: h for h in hosts}
            ready = len({h.worker_id for h in hosts}) >= cur.req.tpu_type.hosts
            cur = self._tracked[name] = replace(
                cur, hosts=tuple(merged[w] for w in sorted(merged)), state=SliceState.READY if ready else cur.state)
        if ready:
            log.info("job %s: slice %s ready in %s/%s", cur.req.job_id, name, self.project, cur.zone)
            self._changed(SliceState.PROVISIONING, cur)
        return cur

    def _changed(self, before: SliceState | None, t: _Tracked) -> None:
        """Tell `on_change` of a new state (call without the lock)."""
        if self._on_change is None or t.state is before:
            return
        try:
            self._on_change(self._slice(t))
        except Exception:  # the record of a change must not break following the slice
            log.exception("on_change failed for slice %s (%s)", t.req.name, t.state.value)

    def _look(self, t: _Tracked) -> _Seen:
        qr_name = f"{self._parent(t.zone)}/queuedResources/{t.req.name}"
        try:
            qr = self._call(f"get {qr_name}", t.zone, self._client.get_queued_resource, name=qr_name)
        except CloudApiError as e:
            if e.code != 404:
                raise
            return _Seen(qr=None)
        st = qr.state
        error = (st.failed_data.error.code, st.failed_data.error.message) if st.state == QRS.FAILED else None
        seen = _Seen(qr=st.state.name, initiator=st.state_initiator.name, error=error)
        if st.state in (QRS.PROVISIONING, QRS.ACTIVE, QRS.SUSPENDING, QRS.SUSPENDED):
            node_name = f"{self._parent(t.zone)}/nodes/{t.req.name}"
            try:
                node = self._call(f"get {node_name}", t.zone, self._client.get_node, name=node_name)
                seen = replace(seen, node=node.state.name,
                               addresses=tuple(e.ip_address for e in node.network_endpoints))
            except CloudApiError as e:
                if e.code != 404:
                    raise
        return seen

    def _judge(self, t: _Tracked, seen: _Seen) -> _Tracked:
        """The slice state that `seen` means, and the events it raises (called under the lock)."""
        q, node = seen.qr, seen.node
        up = node == "READY"
        never_seen = t.seen is None or t.seen.qr is None
        if q is None and never_seen and time.monotonic() - t.since < self._poll.accept_grace_s:
            state = SliceState.REQUESTED  # created a moment ago, not readable yet
        else:
            state = _slice_state(seen, joined=t.state is SliceState.READY, was_up=t.ever_up)
        hosts = t.hosts or tuple(Host(i, host_resource(t.req.name, i), address=a)
                                 for i, a in enumerate(seen.addresses))
        t = replace(t, seen=seen, state=state, ever_up=t.ever_up or up, hosts=hosts)
        reclaimed = (q in ("SUSPENDING", "SUSPENDED") and seen.initiator != "USER") or node == "PREEMPTED"
        if reclaimed:
            t = self._event(t, SliceEventKind.RECLAIMED, f"queued resource {q}, initiator {seen.initiator}, "
                                                         f"node {node} in {self.project}/{t.zone}")
        elif state is SliceState.GONE and t.ever_up:
            t = self._event(t, SliceEventKind.HOST_LOST, f"queued resource {q}, node {node} "
                                                         f"in {self.project}/{t.zone}")
        why = self._no_capacity(t)
        if why:
            t = self._event(t, SliceEventKind.NO_CAPACITY, why)
        return t

    def _no_capacity(self, t: _Tracked) -> str:
        """Why this zone has no capacity for the slice, or "" if it may still come."""
        s = t.seen
        if s is None or t.ever_up:
            return ""
        if s.qr == "FAILED" and s.error and s.error[0] == _RESOURCE_EXHAUSTED:
            return f"zone {t.zone} has no capacity: {s.error[1]}"
        waited = time.monotonic() - t.since
        if s.qr in ("CREATING", "ACCEPTED", "WAITING_FOR_RESOURCES") and waited > self._poll.capacity_wait_s:
            return f"zone {t.zone}: queued {waited:.0f}s ({s.qr}), past the {self._poll.capacity_wait_s:.0f}s limit"
        return ""

    def _event(self, t: _Tracked, kind: SliceEventKind, reason: str) -> _Tracked:
        if kind in t.reported:
            return t
        log.warning("job %s: slice %s: %s: %s", t.req.job_id, t.req.name, kind.value, reason)
        self._events.append(SliceEvent(t.req.name, kind, reason))
        return replace(t, reported=t.reported | {kind})

    def _next_zone(self, t: _Tracked, why: str) -> None:
        zone, rest = t.zones_left[0], t.zones_left[1:]
        log.info("job %s: slice %s: %s; trying %s next", t.req.job_id, t.req.name, why, zone)
        self._delete(t.zone, "qr", t.req.name)
        moved = replace(t, zone=zone, zones_left=rest, tried=t.tried + (zone,), since=time.monotonic(),
                        state=SliceState.REQUESTED, seen=None, hosts=(), reported=frozenset())
        with self._lock:
            self._tracked[t.req.name] = moved
        self._create(moved)
        self._changed(t.state, moved)

    # -- creating and deleting ----------------------------------------------------------

    def _create(self, t: _Tracked) -> None:
        req, zone = t.req, t.zone
        if self._setup is None:
            raise ProvisioningError("GcpTpuProvider needs worker_setup (the Ray head's address) to request slices",
                                    slice_name=req.name)
        parent = self._parent(zone)
        labels = {label_value(k): label_value(v) for k, v in req.labels.items()}
        labels.update({MANAGED_BY_KEY: MANAGED_BY, JOB_KEY: label_value(req.job_id),
                       SLICE_KEY: label_value(req.name)})
        node = tpu_v2.Node(
            accelerator_type=req.tpu_type.name,
            runtime_version=self._runtimes[req.tpu_type.generation.name],
            labels=labels,
            metadata={"startup-script": startup_script(self._setup, req.tpu_type, req.name)},
        )
        if self._node_sa:
            node.service_account = tpu_v2.ServiceAccount(email=self._node_sa, scope=[CLOUD_PLATFORM])
        qr = tpu_v2.QueuedResource(
            tpu=tpu_v2.QueuedResource.Tpu(node_spec=[tpu_v2.QueuedResource.Tpu.NodeSpec(
                parent=parent, node_id=req.name, node=node)]),
            **self._tier(req.tier, zone),
        )
        try:
            self._call(f"create queued resource {req.name}", zone, self._client.create_queued_resource,
                       parent=parent, queued_resource_id=req.name, queued_resource=qr, slice_name=req.name)
        except CloudApiError as e:
            if e.code != 409 or not self._is_ours(zone, req):
                raise
            # A retried create whose first try did land: the queued resource is ours already.
            log.info("queued resource %s already exists in %s/%s; adopting it", req.name, self.project, zone)

    def _is_ours(self, zone: str, req: SliceRequest) -> bool:
        name = f"{self._parent(zone)}/queuedResources/{req.name}"
        qr = self._call(f"get {name}", zone, self._client.get_queued_resource, name=name)
        labels = qr.tpu.node_spec[0].node.labels if qr.tpu.node_spec else {}
        mine = labels.get(JOB_KEY) == label_value(req.job_id) and labels.get(MANAGED_BY_KEY) == MANAGED_BY
        if mine and qr.state.state in (QRS.DELETING, QRS.FAILED, QRS.SUSPENDED):
            raise ProvisioningError(f"slice {req.name}: an earlier queued resource of that name in "
                                    f"{self.project}/{zone} is still {qr.state.state.name}; retry later",
                                    slice_name=req.name, transient=True)
        return mine

    def _tier(self, tier: Tier, zone: str) -> dict[str, Any]:
        if tier is Tier.SPOT:
            return {"spot": tpu_v2.QueuedResource.Spot()}
        if tier is Tier.ON_DEMAND:
            return {"guaranteed": tpu_v2.QueuedResource.Guaranteed()}
        reservation = self._reservation_in(zone)
        if reservation is None:
            raise ProvisioningError(f"tier reserved needs a reservation for zone {zone}; pass reservation=")
        return {"guaranteed": tpu_v2.QueuedResource.Guaranteed(),
                "reservation_name": f"{self._parent(zone)}/reservations/{reservation}"}

    def _reservation_in(self, zone: str) -> str | None:
        r = self._reservation
        return r.get(zone) if isinstance(r, Mapping) else r

    def _zone_order(self, req: SliceRequest) -> tuple[str, ...]:
        zones = ((req.zone,) if req.zone else ()) + tuple(z for z in self.zones if z != req.zone)
        if not self._fallthrough:
            zones = zones[:1]
        if req.tier is Tier.RESERVED:  # only zones that hold a reservation can serve it
            zones = tuple(z for z in zones if self._reservation_in(z))
            if not zones:
                raise ProvisioningError(f"slice {req.name}: tier reserved but no reservation in any zone",
                                        slice_name=req.name)
        return zones

    def _teardown(self, name: str, why: str) -> None:
        """Delete the slice's queued resource (and so its node); idempotent."""
        with self._lock:
            t = self._tracked.get(name)
            if t is None or t.released:
                return
            # Marked first, so a concurrent look does not report our own delete as a loss.
            self._tracked[name] = replace(t, released=True, state=SliceState.RELEASED)
        log.info("job %s: deleting slice %s in %s/%s (%s)", t.req.job_id, name, self.project, t.zone, why)
        try:
            self._delete(t.zone, "qr", name)
        except CloudApiError:
            with self._lock:
                self._tracked[name] = t  # not released after all: a later release() tries again
            raise
        self._changed(t.state, replace(t, released=True, state=SliceState.RELEASED))

    def _teardown_quietly(self, name: str, why: str) -> None:
        try:
            self._teardown(name, why)
        except CloudApiError as e:
            # Labelled, so `collect_leaked` finds it later; the original error matters more.
            log.error("could not delete slice %s after a failure (gc will find it): %s", name, e)

    def _delete(self, zone: str, kind: str, name: str) -> None:
        parent = self._parent(zone)
        try:
            if kind == "qr":
                self._call(f"delete queued resource {name}", zone, self._client.delete_queued_resource,
                           request=tpu_v2.DeleteQueuedResourceRequest(name=f"{parent}/queuedResources/{name}",
                                                                      force=True), slice_name=name)
            else:
                self._call(f"delete node {name}", zone, self._client.delete_node, name=f"{parent}/nodes/{name}",
                           slice_name=name)
        except CloudApiError as e:
            if e.code != 404:  # already gone is what we wanted
                raise

    # -- records ---------------------------------------------------------------------------

    def _slice(self, t: _Tracked) -> Slice:
        r = t.req
        return Slice(r.name, r.job_id, r.tpu_type, r.tier, t.zone, t.state, t.hosts, self.name, t.created_at)

    def _slice_from_api(self, zone: str, qr: Any, node: Any) -> Slice | None:
        spec = qr.tpu.node_spec[0].node if qr is not None and qr.tpu.node_spec else node
        if spec is None or spec.labels.get(MANAGED_BY_KEY) != MANAGED_BY:
            return None
        name = (qr or node).name.rsplit("/", 1)[1]
        with self._lock:
            t = self._tracked.get(name)
        if t is not None and t.zone == zone:
            return self._slice(t)
        try:
            tpu_type: TpuType = catalog.lookup(spec.accelerator_type)
        except ValueError:
            log.warning("slice %s in %s has unknown accelerator type %s", name, zone, spec.accelerator_type)
            return None
        tier = Tier.SPOT if qr is not None and "spot" in qr else Tier.ON_DEMAND
        if qr is not None and qr.reservation_name:
            tier = Tier.RESERVED
        # A node without a queued resource reads as one whose queued resource is ACTIVE.
        seen = _Seen(qr=qr.state.state.name if qr is not None else "ACTIVE",
                     node=node.state.name if node is not None else None)
        if "DELETING" in (seen.qr, seen.node):
            state = SliceState.RELEASED  # on its way out already
        else:
            state = _slice_state(seen, joined=True, was_up=False)
        created = (qr or node).create_time
        return Slice(name, spec.labels.get(JOB_KEY, ""), tpu_type, tier, zone, state, (), self.name,
                     created.timestamp() if created else time.time())

    def _parent(self, zone: str) -> str:
        return f"projects/{self.project}/locations/{zone}"

    # -- calling the API ---------------------------------------------------------------------

    def _call(self, action: str, zone: str, fn: Callable[..., T], *, slice_name: str | None = None,
              **kwargs: Any) -> T:
        """`fn(**kwargs)`, retrying transient errors with exponential backoff and jitter."""
        p = self._retry
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(_is_transient),
            stop=tenacity.stop_after_attempt(p.attempts) | tenacity.stop_after_delay(p.total_s),
            wait=tenacity.wait_exponential_jitter(multiplier=p.initial_s, max=p.max_s, jitter=p.initial_s),
            sleep=self._sleep,
            reraise=True,
            before_sleep=lambda rs: log.warning(
                "%s in %s/%s: %s; retry %d/%d in %.2fs", action, self.project, zone,
                _describe(rs.outcome.exception()), rs.attempt_number, p.attempts - 1, rs.upcoming_sleep),
        )
        try:
            return retrying(fn, timeout=self._poll.request_timeout_s, **kwargs)
        except gexc.GoogleAPICallError as e:
            raise CloudApiError(action=action, project=self.project, zone=zone, code=e.code,
                                reason=e.reason or type(e).__name__, message=e.message,
                                transient=_is_transient(e), slice_name=slice_name) from e
        except (requests.ConnectionError, requests.Timeout) as e:
            raise CloudApiError(action=action, project=self.project, zone=zone, code=None,
                                reason=type(e).__name__, message=str(e), transient=True,
                                slice_name=slice_name) from e


def _all(list_method: Callable[..., Any]) -> Callable[..., list[Any]]:
    """A list call that reads every page, so a retry covers the later pages too."""
    return lambda **kwargs: list(list_method(**kwargs))


def _is_transient(e: BaseException) -> bool:
    if isinstance(e, (requests.ConnectionError, requests.Timeout)):
        return True
    if isinstance(e, gexc.GoogleAPICallError):
        return e.code in _TRANSIENT_HTTP and e.reason not in _PERMANENT_REASONS
    return False


def _describe(e: BaseException | None) -> str:
    if isinstance(e, gexc.GoogleAPICallError):
        return f"HTTP {e.code} {e.reason or type(e).__name__}: {e.message}"
    return f"{type(e).__name__}: {e}"


def _credentials(credentials: Any, impersonate: str | None, endpoint: str | None) -> Any:
    """The credentials to call the API with. Never logged: a token in a log is a leaked token."""
    if credentials is None:
        if endpoint and endpoint.startswith(("http://127.", "http://localhost", "http://[::1]")):
            from google.auth.credentials import AnonymousCredentials

            credentials = AnonymousCredentials()  # the local emulator has no auth
        else:
            import google.auth

            credentials, _ = google.auth.default(scopes=[CLOUD_PLATFORM])
    if impersonate:
        from google.auth import impersonated_credentials

        credentials = impersonated_credentials.Credentials(
            source_credentials=credentials, target_principal=impersonate, target_scopes=[CLOUD_PLATFORM])
    return credentials


def collect_leaked(provider: Any, live_job_ids: set[str], *, dry_run: bool = False) -> list[str]:
    """Release every slice labelled by this tool whose job is not live; returns their names.

    Works with any `SliceProvider` whose `list()` reports the slices it made (for GCP:
    every queued resource and node labelled ``managed-by=tpu-orchestrator`` in its zones).
    """
    live = set(live_job_ids) | {label_value(j) for j in live_job_ids}
    leaked = sorted({s.name for s in provider.list() if s.job_id not in live and s.state is not SliceState.RELEASED})
    for name in leaked:
        if dry_run:
            log.info("gc: would delete leaked slice %s", name)
        else:
            log.warning("gc: deleting leaked slice %s (its job is gone)", name)
            provider.release(name)
    return leaked
