"""How the provider looks at a slice in the TPU API: what a look saw (`seen_of`), and one listing of a
zone shared by every look at that zone's slices.

Every running job's driver looks at its slices once a second (four times, when this was written); a look used
to GET the queued resource and its node, 2 requests a second a job (8 then). Once the provider follows more
than `list_over` slices in a zone, `ZoneListings` lists the zone's queued resources and nodes at most every `list_s`
(2 calls, however many slices) and every look of that moment reads the same listing. A slice made since the
listing began waits for the next one; one missing from a listing begun after its create is gone. Readings are
judged in the order their data was read (`look`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from orchestrator.providers.gcp.api import QRS, CloudApiError, TpuApi
from orchestrator.providers.gcp.states import Seen, Tracked

log = logging.getLogger(__name__)

# At most this share of a core goes to listing a zone (its thread's CPU time: the client parses each object).
PARSE_SHARE = 0.25
WITH_A_NODE = (QRS.PROVISIONING, QRS.ACTIVE, QRS.SUSPENDING, QRS.SUSPENDED)  # queued resources that have one


def seen_of(qr: Any, node: Callable[[], Any]) -> Seen:
    """What a look saw of a queued resource `qr`, with its node (`node()`, asked only in a state that has
    one; None if there is none yet)."""
    st = qr.state
    error = (st.failed_data.error.code, st.failed_data.error.message) if st.state == QRS.FAILED else None
    seen = Seen(qr=st.state.name, initiator=st.state_initiator.name, error=error)
    if st.state in WITH_A_NODE and (n := node()) is not None:
        seen = replace(seen, node=n.state.name, addresses=tuple(e.ip_address for e in n.network_endpoints))
    return seen


@dataclass(frozen=True)
class ZoneListing:
    """One listing of a zone: its queued resources by short name and its nodes by full name, when
    (monotonic) the listing began, and for how long it is fresh."""

    at: float
    qrs: dict[str, Any]
    nodes: dict[str, Any]
    fresh_for: float  # seconds: `list_s`, or longer when listing took long (`PARSE_SHARE`)
    _seen: dict[str, Seen] = field(default_factory=dict, compare=False, repr=False)

    def seen(self, name: str, node_name: str, get_node: Callable[[], Any]) -> Seen | None:
        """What a look at queued resource `name` (short) sees in this listing, None if it is not listed; its
        node is `node_name` (full) in the listing, else asked for by name (`get_node`: made after the listing).

        Read from the listed messages once a listing: every field read of a proto-plus message converts it
        again, and a driver looks at its slices several times while one listing is fresh (at N=1,000 those
        reads were a tenth of the controller's time). A look that asked for its node by name is not kept:
        the next look asks again, as before."""
        if (kept := self._seen.get(name)) is not None:
            return kept
        if (qr := self.qrs.get(name)) is None:
            return None
        asked = False

        def node() -> Any:
            nonlocal asked
            if (listed := self.nodes.get(node_name)) is not None:
                return listed
            asked = True
            return get_node()

        seen = seen_of(qr, node)
        if not asked:
            self._seen[name] = seen  # a race only computes it twice
        return seen


class ZoneListings:
    """The latest listing of each zone, made at most every `list_s` while more than `list_over` slices
    are followed there (else none: each look GETs its own)."""

    def __init__(self, api: TpuApi, project: str, *, list_over: int, list_s: float):
        self._api, self._project, self.list_over, self.list_s = api, project, list_over, list_s
        self._lock = threading.Lock()
        self._latest: dict[str, ZoneListing] = {}
        self._locks: dict[str, threading.Lock] = {}  # one listing of a zone at a time
        self._counted: dict[str, tuple[int, float]] = {}  # zone -> (slices followed there, when counted)

    def get(self, zone: str, *, followed: Callable[[], int]) -> ZoneListing | None:
        """The zone's listing, no older than `list_s`, if `followed()` slices there are more than
        `list_over` (counted at most once every `list_s`, not once a look).

        One caller lists; while it does, the others read the listing before it rather than wait (a
        listing of a thousand slices takes a while to parse, and every driver's look would queue behind
        it). The next listing starts no sooner than `PARSE_SHARE` of the time between two listings
        is spent making them, so listing never takes more than that share of a core, however many
        slices the zone holds."""
        with self._lock:
            if (listing := self._fresh(zone)) is not None:
                return listing
            lock = self._locks.setdefault(zone, threading.Lock())
            latest = self._latest.get(zone)
        if self._count(zone, followed) <= self.list_over:
            return None
        if not lock.acquire(blocking=latest is None):  # being listed: the one before it will do meanwhile
            return latest
        try:
            with self._lock:
                if (listing := self._fresh(zone)) is not None:
                    return listing
            at, cpu = time.monotonic(), time.thread_time()
            try:
                qrs, nodes = self._api.list_zone(zone, states_only=True)
            except CloudApiError as e:  # the slices are looked at one by one meanwhile
                log.warning("could not list %s/%s: %s", self._project, zone, e)
                return None
            took = time.thread_time() - cpu  # this thread's CPU: the wall time also counts its waits for the GIL
            listing = ZoneListing(at, {q.name.rsplit("/", 1)[1]: q for q in qrs}, nodes,
                                  fresh_for=max(self.list_s, took / PARSE_SHARE))
            with self._lock:
                self._latest[zone] = listing
            return listing
        finally:
            lock.release()

    def _count(self, zone: str, followed: Callable[[], int]) -> int:
        """`followed()`, counted at most once every `list_s` a zone: counting walks every slice followed, and
        every look counted while a listing was stale or being made (a tenth of the controller's time at
        N=1,000). It decides only whether to list, so a count a second old does."""
        now = time.monotonic()
        with self._lock:
            counted = self._counted.get(zone)
            if counted is not None and now - counted[1] <= self.list_s:
                return counted[0]
        n = followed()
        with self._lock:
            self._counted[zone] = (n, now)
        return n

    def _fresh(self, zone: str) -> ZoneListing | None:
        listing = self._latest.get(zone)
        return listing if listing is not None and time.monotonic() - listing.at <= listing.fresh_for else None


def look(api: TpuApi, listings: ZoneListings, t: Tracked, *, followed: Callable[[], int]) -> tuple[Seen, float] | None:
    """What the API says of the slice `t`, and when (monotonic) that was read; None if nothing newer than its last
    reading (`Tracked.seen_at`) is known yet.

    While its zone is listed (`followed`: how many slices the provider follows there), the slice is read from the
    listing: a listing begun after its create returned (`Tracked.listable_at`) that does not hold its queued
    resource says it is gone, as a GET's 404 would; one begun before it, or before its last reading, says
    nothing, and the next listing (within `list_s`) will. So a look costs no call of its own however many slices
    wait. Each GET by name is an HTTP call and a parse, about 7 ms of the process's one core for Python: at
    N=1,000, looking by name at every slice made since the last listing until the next was 30% of it.
    Otherwise (few slices, or the listing failed) the slice is asked for by name."""
    listing = listings.get(t.zone, followed=followed)
    if listing is not None:
        if listing.at < t.seen_at:
            return None
        seen = listing.seen(t.req.name, api.full_name(t.zone, "node", t.req.name),
                            lambda: api.get(t.zone, "node", t.req.name))
        if seen is not None:
            return seen, listing.at
        return (Seen(qr=None), listing.at) if listing.at >= t.listable_at else None
    at = time.monotonic()
    qr = api.get(t.zone, "qr", t.req.name)
    return (Seen(qr=None) if qr is None else seen_of(qr, lambda: api.get(t.zone, "node", t.req.name))), at
