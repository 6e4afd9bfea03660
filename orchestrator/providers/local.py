"""The local provider: a "TPU slice" is `hosts(T)` new Ray nodes on this machine.

Each host is its own `ray start --block` process group (raylet, agents, and later the
worker process) carrying the resources and labels of a real TPU VM (see
`providers.base`), with its CPU devices standing in for the host's chips. Releasing a
slice stops its process groups; `kill_host` makes one vanish the way a preempted VM
does (SIGKILL, no goodbye), which is what the fault-injection tests use.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import replace
from pathlib import Path

import ray

from orchestrator import cluster
from orchestrator.errors import ProvisioningError
from orchestrator.providers.base import (CapacityError, Host, Slice, SliceEvent, SliceEventKind, SliceRequest,
                                         host_node_labels, host_node_resources, host_resource)
from orchestrator.state.states import SliceState, check_slice

log = logging.getLogger(__name__)


class LocalProvider:
    name = "local"
    START_RETRIES = 3
    START_STAGGER_S = 0.5
    START_TOGETHER = max(2, os.cpu_count() or 2)  # hosts started at once, before the next stagger

    def __init__(self, home: cluster.Home, address: str, *, max_hosts: int = 8, on_change=None):
        self.home, self.address, self.max_hosts = home, address, max_hosts
        self._on_change = on_change or (lambda s, pgids: None)  # persists slices (the controller's store)
        self._lock = threading.Lock()
        self._slices: dict[str, Slice] = {}
        self._pgids: dict[str, list[int]] = {}
        self._events: list[SliceEvent] = []
        self.short_hosts: set[int] = set()  # fault injection, see `Controller.inject_fault`

    def _set(self, s: Slice, state: SliceState | None = None) -> Slice:
        if state is not None and state != s.state:
            check_slice(s.name, s.state, state)
            s = replace(s, state=state)
        self._slices[s.name] = s
        self._on_change(s, self._pgids.get(s.name, []))
        return s

    def adopt(self, s: Slice, pgids: list[int]) -> None:
        """Take over a slice started by an earlier controller (found in the store)."""
        with self._lock:
            self._pgids[s.name] = list(pgids)
            self._slices[s.name] = s

    def hosts_in_use(self) -> int:
        return sum(s.tpu_type.hosts for s in self._slices.values() if not s.state.terminal)

    def request(self, req: SliceRequest) -> Slice:
        t = req.tpu_type
        with self._lock:
            if t.hosts > self.max_hosts:
                raise ProvisioningError(
                    f"local provider: {t.name} needs {t.hosts} hosts but this machine is set up for at most "
                    f"{self.max_hosts}", slice_name=req.name, transient=False)
            if self.hosts_in_use() + t.hosts > self.max_hosts:
                raise CapacityError(
                    f"local provider: {t.name} needs {t.hosts} hosts but only "
                    f"{self.max_hosts - self.hosts_in_use()} of {self.max_hosts} are free on this machine",
                    slice_name=req.name)
            hosts = tuple(Host(worker_id=i, resource=host_resource(req.name, i)) for i in range(t.hosts))
            s = Slice(req.name, req.job_id, t, req.tier, req.zone or "local", SliceState.REQUESTED, hosts, self.name)
            self._pgids[req.name] = []
            s = self._set(s)  # reserves the hosts before the lock is let go
        for i in range(t.hosts):  # outside the lock: other slices' events go on being polled
            if i and i % self.START_TOGETHER == 0:
                time.sleep(self.START_STAGGER_S)  # a herd of raylets starting at once can miss Ray's 30 s
            self._pgids[req.name].append(self._start_host(req.name, t, i))
        with self._lock:
            return self._set(self._slices[req.name], SliceState.PROVISIONING)

    def _start_host(self, name: str, t, worker_id: int) -> int:
        resources = host_node_resources(t, name, worker_id)
        if worker_id in self.short_hosts:  # fault injection: a host that comes up with half its chips
            resources["TPU"] = resources["TPU"] / 2
        return cluster.start_host_node(
            self.home, address=self.address, resources=resources,
            labels=host_node_labels(t, name, worker_id), log_path=self._host_log(name, worker_id))

    def _host_log(self, name: str, worker_id: int) -> Path:
        return self.home.root / "logs" / "slices" / name / f"host-{worker_id}.log"

    def wait_ready(self, name: str, *, timeout_s: float) -> Slice:
        deadline = time.monotonic() + timeout_s
        s = self.get(name)
        restarts = {i: 0 for i in range(len(s.hosts))}
        while True:
            joined = self._joined_nodes(name)
            for i, pgid in enumerate(self._pgids.get(name, [])):
                if i in joined or cluster.group_alive(pgid):
                    continue
                # Ray gives a raylet 30 s to register; a busy machine can miss that. Try again a few times.
                if restarts[i] >= self.START_RETRIES:
                    self.release(name)
                    raise ProvisioningError(
                        f"host {i} of slice {name} exited while starting ({restarts[i] + 1} tries); see "
                        f"{self._host_log(name, i)}", slice_name=name, transient=True)
                restarts[i] += 1
                log.warning("host %d of slice %s exited while starting; starting it again (%d/%d)",
                            i, name, restarts[i], self.START_RETRIES)
                self._pgids[name][i] = self._start_host(name, s.tpu_type, i)
            if len(joined) == len(s.hosts):
                hosts = tuple(replace(h, node_id=joined[h.worker_id]["NodeID"],
                                      address=joined[h.worker_id]["NodeManagerAddress"]) for h in s.hosts)
                with self._lock:
                    return self._set(replace(self._slices[name], hosts=hosts), SliceState.READY)
            if time.monotonic() > deadline:
                self.release(name)
                raise ProvisioningError(
                    f"slice {name}: only {len(joined)} of {len(s.hosts)} hosts joined the cluster within "
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
                self._set(s, SliceState.RELEASED)
            log.info("released slice %s (%d hosts)", name, len(pgids))

    def kill_host(self, name: str, worker_id: int) -> None:
        """Make one host vanish at once, as a preempted VM does (for fault injection)."""
        cluster.stop_group(self.home, self._pgids[name][worker_id], hard=True, grace_s=2.0)

    def poll_events(self) -> list[SliceEvent]:
        with self._lock:
            for s in list(self._slices.values()):
                if s.state not in (SliceState.READY, SliceState.PREEMPTING):
                    continue
                for i, pgid in enumerate(self._pgids.get(s.name, [])):
                    if not cluster.group_alive(pgid):
                        self._events.append(SliceEvent(s.name, SliceEventKind.HOST_LOST,
                                                       f"host {i} of slice {s.name} is gone", worker_id=i))
                        self._set(s, SliceState.GONE)
                        break
            events, self._events = self._events, []
        return events


def release_recorded(home: cluster.Home, store, rec: dict) -> list[int]:
    """Stop the hosts of a slice known only from the store (an earlier controller's), and record it released.

    Returns the recorded process ids left alone because they are another program's now.
    """
    foreign = cluster.stop_groups(home, rec["data"].get("pgids", []))
    store.put_slice(rec["name"], rec["job_id"], rec["provider"], rec["accelerator"], rec["tier"],
                    SliceState.RELEASED.value, rec["data"])
    return foreign
