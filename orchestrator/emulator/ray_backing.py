"""Back the emulator's TPU nodes with local Ray nodes, so whole jobs run through `provider: gcp`.

When a node becomes READY, each of its hosts joins the local cluster as its own Ray node
with the resources and labels a real TPU VM's startup script gives it; when the node is
preempted or deleted, those Ray nodes go (a preemption kills them outright, as a VM
power-off does).

Two ways to be a host:
- ``share_nothing=True`` (what a real slice is like): each host is an `EmulatedVm` that runs
  the startup script the provider wrote into the node's metadata, in namespaces where none of
  this machine's files are (the state directory, the job's folder, the checkpoints, the
  project's sources). Its Ray token comes from the fake Secret Manager (`secrets`).
- otherwise a plain local Ray node started from this process's environment (fast, shares the disk).

Either way a host's CPU stands in for its TPU chips and says so (`workers.accelerator`), unless
``stand_in=False``: then its hosts are like real TPU VMs, and as this machine has no TPU, a job's
launch on them fails, as it must.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from orchestrator import catalog, cluster
from orchestrator.emulator.errors import failed_precondition, no_such_host
from orchestrator.emulator.metadata import NOTICE_EVENTS
from orchestrator.emulator.vm import EmulatedVm
from orchestrator.emulator.world import Hooks
from orchestrator.providers.base import host_node_labels, host_node_resources

log = logging.getLogger(__name__)


class RayBackedNodes:
    def __init__(self, home: cluster.Home, address: str, *, share_nothing: bool = False,
                 secrets: dict[str, str] | None = None, hide: Sequence[Path] = (), stand_in: bool = True):
        self.home, self.address = home, address
        self.share_nothing, self.secrets, self.hide = share_nothing, dict(secrets or {}), list(hide)
        self.stand_in = stand_in
        self._lock = threading.Lock()
        self._groups: dict[str, list[int | EmulatedVm]] = {}

    def hooks(self) -> Hooks:
        return Hooks(on_node_ready=self.node_ready, on_node_gone=self.node_gone)

    START_RETRIES = 3

    def node_ready(self, node_id: str, accelerator_type: str, worker_count: int, labels: dict[str, str],
                   metadata: dict[str, str] | None = None) -> None:
        t = catalog.lookup(accelerator_type)
        script = (metadata or {}).get("startup-script")
        if self.share_nothing and not script:
            log.error("emulated node %s has no startup-script: its hosts cannot boot", node_id)
            return

        def start(w: int) -> int | EmulatedVm:
            log_path = self.home.root / "logs" / "emulator" / node_id / f"host-{w}.log"
            if self.share_nothing:
                assert script is not None, "a node without its script returned above"
                return EmulatedVm(self.home, node_id, w, script, log_path=log_path, secrets=self.secrets,
                                  hide=self.hide, stand_in=self.stand_in)
            return cluster.start_host_node(self.home, address=self.address,
                                           resources=host_node_resources(t, node_id, w),
                                           labels=host_node_labels(t, node_id, w), log_path=log_path,
                                           stand_in=self.stand_in)

        hosts = [start(w) for w in range(worker_count)]
        with self._lock:
            self._groups[node_id] = hosts
        # A booting VM comes up; a local raylet on a busy machine can miss Ray's 30 s
        # registration and exit. Start such a host again, as LocalProvider does.
        tries = [0] * worker_count
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            with self._lock:
                if self._groups.get(node_id) is not hosts:
                    return  # gone meanwhile
                dead = [w for w, h in enumerate(hosts) if not _alive(h)]
                for w in dead:
                    if tries[w] < self.START_RETRIES:
                        tries[w] += 1
                        log.warning("emulated node %s: host %d exited while starting; again (%d)", node_id, w, tries[w])
                        _stop(self.home, hosts[w], hard=True)
                        hosts[w] = start(w)
            if not dead and self._joined(node_id, hosts) == worker_count:
                log.info("emulated node %s: its %d hosts are up", node_id, worker_count)
                return
            time.sleep(1.0)

    @staticmethod
    def _joined(node_id: str, hosts: list[int | EmulatedVm]) -> int:
        """How many hosts of the node are up: by Ray when this process is connected to it (tests), else (the
        `orchestrator emulator --vms` process, which is no Ray driver) the VMs whose startup script ended well."""
        import ray

        if not ray.is_initialized():
            return sum(1 for h in hosts if isinstance(h, EmulatedVm) and h.booted())
        return sum(1 for n in ray.nodes()
                   if n.get("Alive") and (n.get("Labels") or {}).get("ray.io/tpu-slice-name") == node_id)

    def vms(self, node_id: str) -> list[EmulatedVm]:
        """The emulated VMs of a node, by worker number (share-nothing mode): a test may power one off,
        or send it a notice through its own metadata server (`vm.metadata`)."""
        with self._lock:
            return [h for h in self._groups.get(node_id, []) if isinstance(h, EmulatedVm)]

    # -- what `orchestrator emulator poweroff|notice` does to a host (share-nothing mode) ----------------------

    def power_off(self, node_id: str, host: int, *, silent: bool = False) -> None:
        """Power one VM of the node off, as a host that crashes: its processes and its disk go at once (its
        peers' connections reset), or with `silent` as a host that loses power: its processes stop
        answering and its peers see only silence (`EmulatedVm.silence`)."""
        vm = self._vm(node_id, host)
        if silent:
            vm.silence()
        else:
            vm.kill()

    def notice(self, node_id: str, host: int | None, event: str) -> list[int]:
        """Announce `event` (one of `NOTICE_EVENTS`) on the metadata server of one VM of the node, or of each;
        returns the hosts told."""
        key, value = NOTICE_EVENTS[event]
        vms = [self._vm(node_id, host)] if host is not None else self._booted_vms(node_id)
        for vm in vms:
            vm.metadata.set(key, value)
        return [vm.worker_id for vm in vms]

    def describe(self) -> dict[str, list[dict[str, Any]]]:
        """Each node's hosts: whether they run, booted, and what their metadata server says."""
        with self._lock:
            groups = {n: list(hosts) for n, hosts in self._groups.items()}
        return {n: [{"host": w, "alive": _alive(h), "booted": isinstance(h, EmulatedVm) and h.booted(),
                     "metadata": dict(h.metadata.values) if isinstance(h, EmulatedVm) else {}}
                    for w, h in enumerate(hosts)]
                for n, hosts in groups.items()}

    def _booted_vms(self, node_id: str) -> list[EmulatedVm]:
        vms = [vm for vm in self.vms(node_id) if vm.alive()]
        if not vms:
            raise failed_precondition(f"slice {node_id} has no VM running")
        return vms

    def _vm(self, node_id: str, host: int) -> EmulatedVm:
        with self._lock:
            hosts = self._groups.get(node_id)
        if hosts is None:
            raise failed_precondition(f"slice {node_id} has no VMs: it is not READY, or its VMs are gone")
        if not 0 <= host < len(hosts):
            raise no_such_host(node_id, host, len(hosts))
        vm = hosts[host]
        if not isinstance(vm, EmulatedVm):
            raise failed_precondition(f"slice {node_id}'s hosts are Ray nodes on this machine, not VMs")
        if not vm.alive():
            raise failed_precondition(f"host {host} of slice {node_id} is powered off already")
        return vm

    def node_gone(self, node_id: str, reason: str) -> None:
        with self._lock:
            hosts = self._groups.pop(node_id, [])
        for host in hosts:
            _stop(self.home, host, hard=(reason == "preempted"))

    def close(self) -> None:
        for node_id in list(self._groups):
            self.node_gone(node_id, "deleted")


def _alive(host: int | EmulatedVm) -> bool:
    return host.alive() if isinstance(host, EmulatedVm) else cluster.group_alive(host)


def _stop(home: cluster.Home, host: int | EmulatedVm, *, hard: bool) -> None:
    if isinstance(host, EmulatedVm):
        host.kill()  # a VM deleted or preempted is powered off either way; its disk goes with it
    else:
        cluster.stop_group(home, host, hard=hard)
