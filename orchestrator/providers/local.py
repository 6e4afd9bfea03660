"""The local provider: a "TPU slice" is `hosts(T)` new Ray nodes on this machine.

Each host is its own `ray start --block` process group (raylet, agents, and later the
worker process) carrying the resources and labels of a real TPU VM (see
`providers.base`), with its CPU devices standing in for the host's chips. Releasing a
slice stops its process groups; `kill_host` makes one vanish the way a preempted VM
does (SIGKILL, no goodbye), which is what the fault-injection tests use.
"""

from __future__ import annotations

import builtins
import logging
import os
import threading
import time
from collections.abc import Collection
from dataclasses import replace
from pathlib import Path

import ray

from orchestrator import catalog, cluster
from orchestrator.catalog import Tier
from orchestrator.errors import ProvisioningError
from orchestrator.providers.base import (
    CapacityError,
    Host,
    Slice,
    SliceEvent,
    SliceEventKind,
    SliceRequest,
    host_node_labels,
    host_node_resources,
    host_resource,
)
from orchestrator.state.events import SliceChanged
from orchestrator.state.states import SliceState, check_slice
from orchestrator.state.store import SliceRow

log = logging.getLogger(__name__)


class LocalProvider:
    """`SliceProvider` on this machine's Ray cluster.

    A request whose slice would not fit the free hosts is refused (`CapacityError`). With
    a replayed trace (`SliceRequest.spot_capacity`), a spot request above the trace's
    capacity waits (WAITING, no host started) until capacity comes or its
    `queue_timeout_s` passes (then GONE with a NO_CAPACITY event: a refusal, unbilled);
    a spot slice up when the capacity drops below it gets a PREEMPTION_NOTICE, and its
    hosts are killed the trace's grace later (RECLAIMED). A job's spot slices of one type
    (a multi-slice job's) share the trace's capacity, in the order they were asked for: a
    request waits until the chips of those holding capacity and its own fit, and when the
    capacity drops the last asked for are reclaimed first, as the simulator replays it.
    Nothing here blocks but `wait_ready`: `check` and `poll_events` move every slice on by
    one look.
    """

    name = "local"
    START_RETRIES = 3
    START_STAGGER_S = 0.5
    START_TOGETHER = max(2, os.cpu_count() or 2)  # hosts started at once, before the next stagger

    def __init__(self, home: cluster.Home, address: str, *, max_hosts: int = 8, on_change=None):
        self.home, self.address, self.max_hosts = home, address, max_hosts
        self._on_change = on_change or (lambda s, pgids: None)  # persists slices (the controller's store)
        self._lock = threading.Lock()
        self._slices: dict[str, Slice] = {}
        self._reqs: dict[str, SliceRequest] = {}
        self._pgids: dict[str, list[int]] = {}
        self._restarts: dict[str, dict[int, int]] = {}
        self._since: dict[str, float] = {}  # monotonic time the request started waiting, or the notice came
        self._events: dict[str, list[SliceEvent]] = {}  # by slice: each job's driver takes its own
        self.short_hosts: set[int] = set()  # fault injection, see `inject_fault`

    def inject_fault(self, kind: str, **kw) -> None:
        """Fault injection for tests and drills (a test reaches it in the controller's actor with
        ``controller.__ray_call__``; it is no part of the controller's API). Kinds:

        - ``short_host`` (worker_id): that host of the next slices registers half its chips,
          so the job's workers cannot all be placed; ``clear`` undoes it.
        """
        if kind == "short_host":
            self.short_hosts.add(int(kw["worker_id"]))
        elif kind == "clear":
            self.short_hosts.clear()
        else:
            raise ValueError(f"unknown fault {kind!r}")

    def _set(self, s: Slice, state: SliceState | None = None) -> Slice:
        if state is not None and state != s.state:
            check_slice(s.name, s.state, state)
            s = replace(s, state=state)
            self._since[s.name] = time.monotonic()
        self._slices[s.name] = s
        self._on_change(s, self._pgids.get(s.name, []))
        return s

    def _event(self, name: str, kind: SliceEventKind, reason: str, worker_id: int | None = None) -> None:
        log.warning("slice %s: %s: %s", name, kind.value, reason)
        self._events.setdefault(name, []).append(SliceEvent(name, kind, reason, worker_id=worker_id))

    def adopt(self, s: Slice, pgids: list[int]) -> None:
        """Take over a slice started by an earlier controller (found in the store)."""
        with self._lock:
            self._pgids[s.name] = list(pgids)
            self._slices[s.name] = s

    def hosts_in_use(self) -> int:
        """Hosts of slices started or about to be (a request waiting for spot capacity holds none)."""
        return sum(s.tpu_type.hosts for s in self._slices.values()
                   if not s.state.terminal and s.state is not SliceState.WAITING)

    def request(self, req: SliceRequest) -> Slice:
        t = req.tpu_type
        with self._lock:
            if t.hosts > self.max_hosts:
                raise ProvisioningError(
                    f"local provider: {t.name} needs {t.hosts} hosts but this machine is set up for at most "
                    f"{self.max_hosts}", slice_name=req.name, transient=False)
            hosts = tuple(Host(worker_id=i, resource=host_resource(req.name, i)) for i in range(t.hosts))
            s = Slice(req.name, req.job_id, t, req.tier, req.zone or "local", SliceState.REQUESTED, hosts, self.name)
            if self._spot_short(req) is None and self.hosts_in_use() + t.hosts > self.max_hosts:
                raise CapacityError(
                    f"local provider: {t.name} needs {t.hosts} hosts but only "
                    f"{self.max_hosts - self.hosts_in_use()} of {self.max_hosts} are free on this machine",
                    slice_name=req.name)
            self._reqs[req.name], self._pgids[req.name], self._restarts[req.name] = req, [], {}
            s = self._set(s)  # reserves the hosts before the lock is let go
            if (short := self._spot_short(req)) is not None:
                log.info("slice %s waits for spot capacity (%s)", req.name, short)
                return self._set(s, SliceState.WAITING)
        return self._start_hosts(req.name)

    def _spot_short(self, req: SliceRequest, *, held: bool = False) -> str | None:
        """Why the replayed trace has no spot capacity for the request now, or None. The job's
        other spot slices of the type that hold capacity come first: all of them for a request
        still waiting, those asked for before it for a slice up (`held`)."""
        cap = req.spot_capacity
        if cap is None or req.tier is not Tier.SPOT:
            return None
        chips, beside = cap.chips(), 0
        for name, other in self._slices.items():
            if name == req.name:
                if held:
                    break
                continue
            r = self._reqs.get(name)
            if (r is not None and r.job_id == req.job_id and r.tier is Tier.SPOT and r.tpu_type == req.tpu_type
                    and not other.state.terminal and other.state is not SliceState.WAITING):
                beside += other.tpu_type.chips
        if beside + req.tpu_type.chips <= chips:
            return None
        also = f" beside the job's {beside} chips of it" if beside else ""
        return (f"the replayed trace has spot capacity for {chips} chips, {req.tpu_type.name} needs "
                f"{req.tpu_type.chips}{also}")

    def _start_hosts(self, name: str) -> Slice:
        """Move the slice to PROVISIONING (once: a second caller gets it as it is) and start its hosts."""
        with self._lock:
            s = self._slices[name]
            if s.state not in (SliceState.REQUESTED, SliceState.WAITING):
                return s
            s = self._set(s, SliceState.PROVISIONING)
        t = s.tpu_type
        for i in range(t.hosts):  # outside the lock: other slices' events go on being polled
            if i and i % self.START_TOGETHER == 0:
                time.sleep(self.START_STAGGER_S)  # a herd of raylets starting at once can miss Ray's 30 s
            self._pgids[name].append(self._start_host(name, t, i))
        with self._lock:
            if self._slices[name].state is SliceState.RELEASED:  # released while its hosts started
                cluster.stop_groups(self.home, self._pgids[name], grace_s=5.0)
            return self._slices[name]

    def _start_host(self, name: str, t, worker_id: int) -> int:
        resources = host_node_resources(t, name, worker_id)
        if worker_id in self.short_hosts:  # fault injection: a host that comes up with half its chips
            resources["TPU"] = resources["TPU"] / 2
        return cluster.start_host_node(
            self.home, address=self.address, resources=resources,
            labels=host_node_labels(t, name, worker_id), log_path=self._host_log(name, worker_id))

    def _host_log(self, name: str, worker_id: int) -> Path:
        return self.home.root / "logs" / "slices" / name / f"host-{worker_id}.log"

    def check(self, name: str) -> Slice:
        s = self.get(name)
        if s.state is SliceState.WAITING:
            return self._check_waiting(name)
        if s.state is not SliceState.PROVISIONING:
            return s
        joined = self._joined_nodes(name)
        for i, pgid in enumerate(list(self._pgids.get(name, []))):
            if i in joined or cluster.group_alive(pgid):
                continue
            # Ray gives a raylet 30 s to register; a busy machine can miss that. Try again a few times.
            tries = self._restarts[name].get(i, 0)
            if tries >= self.START_RETRIES:
                self.release(name)
                raise ProvisioningError(f"host {i} of slice {name} exited while starting ({tries + 1} tries); see "
                                        f"{self._host_log(name, i)}", slice_name=name, transient=True)
            self._restarts[name][i] = tries + 1
            log.warning("host %d of slice %s exited while starting; starting it again (%d/%d)",
                        i, name, tries + 1, self.START_RETRIES)
            self._pgids[name][i] = self._start_host(name, s.tpu_type, i)
        if len(joined) < len(s.hosts):
            return s
        hosts = tuple(replace(h, node_id=joined[h.worker_id]["NodeID"],
                              address=joined[h.worker_id]["NodeManagerAddress"]) for h in s.hosts)
        with self._lock:
            cur = self._slices[name]
            if cur.state is not SliceState.PROVISIONING:
                return cur
            return self._set(replace(cur, hosts=hosts), SliceState.READY)

    def _check_waiting(self, name: str) -> Slice:
        with self._lock:
            s, req = self._slices[name], self._reqs[name]
            if s.state is not SliceState.WAITING:
                return s
            short = self._spot_short(req)
            waited = time.monotonic() - self._since[name]
            if short is not None and req.queue_timeout_s is not None and waited > req.queue_timeout_s:
                self._event(name, SliceEventKind.NO_CAPACITY, f"waited {waited:.1f} s, past its queue timeout; {short}")
                return self._set(s, SliceState.GONE)
            if short is not None or self.hosts_in_use() + s.tpu_type.hosts > self.max_hosts:
                return s
        log.info("spot capacity came for slice %s after %.1f s; starting its hosts", name, waited)
        return self._start_hosts(name)

    def wait_ready(self, name: str, *, timeout_s: float) -> Slice:
        deadline = time.monotonic() + timeout_s
        while True:
            s = self.check(name)
            if s.state is SliceState.READY:
                return s
            if s.state.terminal:
                why = "; ".join(e.reason for e in self._events.get(name, [])) or s.state.value
                self.release(name)
                raise CapacityError(f"slice {name}: {why}", slice_name=name)
            if time.monotonic() > deadline:
                self.release(name)
                if s.state is SliceState.WAITING:
                    raise CapacityError(f"slice {name}: no spot capacity in the replayed trace within "
                                        f"{timeout_s:.0f} s", slice_name=name)
                joined = len(self._joined_nodes(name))
                raise ProvisioningError(
                    f"slice {name}: only {joined} of {len(s.hosts)} hosts joined the cluster within "
                    f"{timeout_s:.0f} s", slice_name=name, transient=True)
            time.sleep(0.1)

    @staticmethod
    def _joined_nodes(name: str) -> dict[int, dict]:
        out = {}
        for n in ray.nodes():
            labels = n.get("Labels") or {}
            if n.get("Alive") and labels.get("ray.io/tpu-slice-name") == name:
                out[int(labels["ray.io/tpu-worker-id"])] = n
        return out

    def get(self, name: str) -> Slice:
        with self._lock:
            return self._slices[name]

    def list(self, *, job_id: str | None = None) -> list[Slice]:
        with self._lock:
            return [s for s in self._slices.values() if job_id is None or s.job_id == job_id]

    def release(self, name: str) -> None:
        with self._lock:
            s = self._slices.get(name)
            pgids = self._pgids.get(name, [])
        cluster.stop_groups(self.home, pgids, grace_s=5.0)  # every host at once, not one grace period after another
        if s is not None and s.state is not SliceState.RELEASED:
            with self._lock:
                if self._slices[name].state is SliceState.PREEMPTING:  # reclaimed: given back early, under notice
                    self._set(self._slices[name], SliceState.GONE)
                self._set(self._slices[name], SliceState.RELEASED)
            log.info("released slice %s (%d hosts)", name, len(pgids))

    def kill_host(self, name: str, worker_id: int) -> None:
        """Make one host vanish at once, as a preempted VM does (for fault injection)."""
        cluster.stop_group(self.home, self._pgids[name][worker_id], hard=True, grace_s=2.0)

    def poll_events(self, *, slices: Collection[str] | None = None) -> builtins.list[SliceEvent]:
        with self._lock:
            names = [n for n in self._slices if slices is None or n in slices]
        reclaim = []
        with self._lock:
            for name in names:
                s = self._slices[name]
                if s.state in (SliceState.READY, SliceState.PREEMPTING):
                    if self._host_gone(s):
                        continue
                    reclaim += self._replay_capacity(s)
        for name in reclaim:  # outside the lock: killing takes a moment
            for i in range(len(self._pgids.get(name, []))):
                self.kill_host(name, i)
        for name in names:
            if self._slices[name].state is SliceState.WAITING:
                self.check(name)
        with self._lock:
            return [e for name in names for e in self._events.pop(name, [])]

    def _host_gone(self, s: Slice) -> bool:
        """A host of the slice is gone: HOST_LOST, the slice GONE (under the lock)."""
        for i, pgid in enumerate(self._pgids.get(s.name, [])):
            if not cluster.group_alive(pgid):
                self._event(s.name, SliceEventKind.HOST_LOST, f"host {i} of slice {s.name} is gone", worker_id=i)
                self._set(s, SliceState.GONE)
                return True
        return False

    def _replay_capacity(self, s: Slice) -> builtins.list[str]:
        """The replayed trace's word on an up spot slice: a notice when capacity drops below it,
        the slice's end (to reclaim: returned) the grace later (under the lock)."""
        req = self._reqs.get(s.name)
        cap = req.spot_capacity if req is not None else None
        if cap is None or s.tier is not Tier.SPOT:
            return []
        if s.state is SliceState.READY and req is not None and (short := self._spot_short(req, held=True)) is not None:
            self._event(s.name, SliceEventKind.PREEMPTION_NOTICE, f"reclaim notice: {short}")
            self._set(s, SliceState.PREEMPTING)
        elif s.state is SliceState.PREEMPTING and time.monotonic() - self._since[s.name] > cap.grace_wall_s():
            self._event(s.name, SliceEventKind.RECLAIMED, f"spot slice {s.name} reclaimed after its "
                        f"{cap.grace_s:.0f} s (trace) grace")
            self._set(s, SliceState.GONE)
            return [s.name]
        return []


def release_recorded(home: cluster.Home, store, rec: SliceRow) -> list[int]:
    """Stop the hosts of a slice known only from the store (an earlier controller's), and record it released.

    Returns the recorded process ids left alone because they are another program's now.
    """
    foreign = cluster.stop_groups(home, rec.data.get("pgids", []))
    if rec.state is SliceState.RELEASED:  # recorded already: its billing ended then
        return foreign
    kind = catalog.CATALOG.get(rec.accelerator)  # the catalog may have lost a type since
    # The event ends the slice's billing and its capacity record, as a provider's own release does.
    event = SliceChanged(rec.name, rec.accelerator, kind.chips if kind else None, rec.tier, SliceState.RELEASED.value,
                         kind.usd_per_hour(rec.tier) if kind else None, rec.data.get("zone"))
    store.put_slice(rec.name, rec.job_id, rec.provider, rec.accelerator, rec.tier,
                    SliceState.RELEASED.value, rec.data, event=event,
                    reason=f"slice {rec.name} released (an earlier controller's, found in the store)")
    return foreign
