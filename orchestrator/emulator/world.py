"""The emulated cloud: queued resources, nodes and operations, moved along by a clock.

One lock guards everything. On real time, a single "ticker" thread sleeps until the
next record is due (or until a change wakes it) and performs the automatic moves of
`machines.py`. On a manual clock (`manual_clock=True`, for tests) there is no ticker:
time stands still until `advance(seconds)` moves it, and the moves that fall due on the
way are made then, each at its own time, before `advance` returns. Hook callbacks (a
node became ready, a node went away) run on a separate thread in order, so a slow
callback, such as starting a Ray node, never holds the clock back or blocks an API
request.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from google.cloud import tpu_v2

from orchestrator import catalog
from orchestrator.emulator import machines as m
from orchestrator.emulator.errors import ApiError, already_exists, failed_precondition, invalid, not_found
from orchestrator.emulator.faults import Faults
from orchestrator.emulator.records import (
    RESOURCE_EXHAUSTED,
    NodeRecord,
    OperationRecord,
    QueuedResourceRecord,
)
from orchestrator.emulator.validation import RESERVATION_RE, validate_id, validate_node

log = logging.getLogger(__name__)

Record = QueuedResourceRecord | NodeRecord | OperationRecord



@dataclass(frozen=True)
class Hooks:
    """Callbacks from the emulator to whoever backs its nodes (e.g. with local Ray nodes).

    on_node_ready(node_id, accelerator_type, worker_count, labels, metadata): the node is READY; `metadata`
        is its instance metadata as requested (``startup-script`` among it).
    on_node_gone(node_id, reason): its VMs are down; reason is preempted, terminated or deleted.
    on_preemption_notice(node_id): a reclaim began; the VMs go down after the grace period.
    """

    on_node_ready: Callable[[str, str, int, dict[str, str], dict[str, str]], None] | None = None
    on_node_gone: Callable[[str, str], None] | None = None
    on_preemption_notice: Callable[[str], None] | None = None


class World:
    def __init__(self, *, timings: m.MachineTimings, faults: Faults, hooks: Hooks, zones: tuple[str, ...] | None = None,
                 manual_clock: bool = False):
        self.timings = timings
        self.faults = faults
        self.hooks = hooks
        self.zones = zones  # None: any zone exists
        self._cond = threading.Condition()
        self._qrs: dict[str, QueuedResourceRecord] = {}
        self._nodes: dict[str, NodeRecord] = {}
        self._ops: dict[str, OperationRecord] = {}
        self._ids = itertools.count(1)
        self._stopping = False
        self._callbacks: queue.Queue[tuple[Callable[..., None], tuple[Any, ...]] | None] = queue.Queue()
        self._threads: list[threading.Thread] = []
        self._manual_now: float | None = 0.0 if manual_clock else None  # None: real (monotonic) time

    # -- life of the clock -------------------------------------------------------------

    def now(self) -> float:
        """The clock that records fall due on: monotonic seconds, or the manual clock's reading."""
        return time.monotonic() if self._manual_now is None else self._manual_now

    def advance(self, seconds: float) -> None:
        """Move a manual clock `seconds` on, making every move that falls due on the way at its own time."""
        if self._manual_now is None:
            raise RuntimeError("this emulator runs on real time; serve(manual_clock=True) for one that advance() moves")
        if not seconds >= 0:  # NaN too
            raise ValueError(f"the clock only moves forward, not by {seconds!r} s")
        with self._cond:
            end = self._manual_now + seconds
            while (due := self._next_due()) is not None and due <= end:
                self._manual_now = max(self._manual_now, due)
                self._advance(self._manual_now)
            self._manual_now = end

    def start(self) -> None:
        self._threads = [threading.Thread(target=self._callback_loop, name="tpu-emulator-hooks", daemon=True)]
        if self._manual_now is None:
            self._threads.append(threading.Thread(target=self._tick_loop, name="tpu-emulator-clock", daemon=True))
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._callbacks.put(None)
        for t in self._threads:
            t.join(timeout=10)

    def _tick_loop(self) -> None:
        with self._cond:
            while not self._stopping:
                now = time.monotonic()
                self._advance(now)
                due = self._next_due()
                # Sleep until the next due move; a change that adds one notifies us.
                self._cond.wait(timeout=max(0.0, due - now) if due is not None else None)

    def _next_due(self) -> float | None:
        records: list[QueuedResourceRecord | NodeRecord] = [*self._qrs.values(), *self._nodes.values()]
        dues = [r.due for r in records if r.due is not None]
        return min(dues) if dues else None

    def _callback_loop(self) -> None:
        while (item := self._callbacks.get()) is not None:
            fn, args = item
            try:
                fn(*args)
            except Exception:  # a broken callback must not stop the emulator
                log.exception("emulator hook %s%r failed", getattr(fn, "__name__", fn), args)

    def _call_hook(self, fn: Callable[..., None] | None, *args: Any) -> None:
        if fn is not None:
            self._callbacks.put((fn, args))

    # -- the automatic moves ------------------------------------------------------------

    def _advance(self, now: float) -> None:
        for qr in [q for q in self._qrs.values() if q.due is not None and q.due <= now]:
            self._advance_qr(qr, now)
        for node in [n for n in self._nodes.values() if n.due is not None and n.due <= now]:
            self._advance_node(node, now)

    def _advance_qr(self, qr: QueuedResourceRecord, now: float) -> None:
        t = self.timings
        if qr.state == m.CREATING:
            self._move_qr(qr, m.ACCEPTED, due=now + t.of("queue"))
        elif qr.state == m.ACCEPTED:
            self._move_qr(qr, m.WAITING_FOR_RESOURCES, due=now + t.of("capacity"))
        elif qr.state == m.WAITING_FOR_RESOURCES:
            mode = self.faults.stockout_mode(qr.zone, qr.accelerator_type)
            if mode == "wait" and _expired(qr, now):  # its validUntil passed while it waited: over, unbilled
                self._move_qr(qr, m.FAILED, due=None, error=(DEADLINE_EXCEEDED, (
                    f"the queued resource's validUntil passed before capacity came in zone {qr.zone}")))
            elif mode == "wait":  # look again later: the stockout may be cleared
                self._qrs[qr.name] = replace(qr, due=now + max(t.of("capacity"), 0.02))
            elif mode == "fail":
                msg = (
                    f'There is no more capacity in the zone "{qr.zone}"; you can try in another zone '
                    "where Cloud TPU Nodes are offered (see https://cloud.google.com/tpu/docs/regions)"
                )
                self._move_qr(qr, m.FAILED, due=None, error=(RESOURCE_EXHAUSTED, msg))
            else:
                self._provision(qr, now)
        elif qr.state == m.PROVISIONING:
            self._move_qr(qr, m.ACTIVE, due=None)
            self._move_node(self._nodes[qr.node_name], m.N_READY, due=None)
        elif qr.state == m.SUSPENDING:
            node = self._nodes.get(qr.node_name)
            if node is not None and node.state not in m.NODE_DOWN:
                self._move_node(node, m.N_PREEMPTED, due=None, gone_reason="preempted")
            self._move_qr(qr, m.SUSPENDED, due=None)
        elif qr.state == m.DELETING:
            del self._qrs[qr.name]
            self._nodes.pop(qr.node_name, None)
            self._settle_ops(qr.name)
            self._settle_ops(qr.node_name)

    def _advance_node(self, node: NodeRecord, now: float) -> None:
        if node.state == m.N_CREATING:
            self._move_node(node, m.N_READY, due=None)
        elif node.state == m.N_READY:  # a reclaim's grace period ended
            self._move_node(node, m.N_PREEMPTED, due=None, gone_reason="preempted")
        elif node.state == m.N_DELETING:
            del self._nodes[node.name]
            self._settle_ops(node.name)

    def _provision(self, qr: QueuedResourceRecord, now: float) -> None:
        spec = qr.spec.tpu.node_spec[0].node
        node = NodeRecord(
            name=qr.node_name,
            zone=qr.zone,
            spec=spec,
            worker_count=catalog.lookup(qr.accelerator_type).hosts,
            state=m.N_CREATING,
            uid=next(self._ids),
            create_time=time.time(),
            queued_resource=qr.name,
            spot="spot" in qr.spec,
        )
        self._nodes[node.name] = node
        self._move_qr(qr, m.PROVISIONING, due=now + self.timings.of("provision"))

    def _move_qr(self, qr: QueuedResourceRecord, target: str, *, due: float | None, **changes: Any) -> None:
        m.check_qr(qr.name, qr.state, target)
        log.debug("queued resource %s: %s -> %s", qr.name, qr.state, target)
        self._qrs[qr.name] = replace(qr, state=target, due=due, **changes)
        self._settle_ops(qr.name)

    def _move_node(self, node: NodeRecord, target: str, *, due: float | None, gone_reason: str = "") -> None:
        m.check_node(node.name, node.state, target)
        log.debug("node %s: %s -> %s", node.name, node.state, target)
        announced = node.announced
        if target == m.N_READY and not announced:
            announced = True
            labels = dict(node.spec.labels)
            self._call_hook(
                self.hooks.on_node_ready, node.node_id, node.spec.accelerator_type, node.worker_count, labels,
                dict(node.spec.metadata),
            )
        elif target in m.NODE_DOWN and announced:
            announced = False
            self._call_hook(self.hooks.on_node_gone, node.node_id, gone_reason or target.lower())
        self._nodes[node.name] = replace(node, state=target, due=due, announced=announced)
        self._settle_ops(node.name)

    def _settle_ops(self, target: str) -> None:
        """Finish the operations on `target` whose condition now holds."""
        qr, node = self._qrs.get(target), self._nodes.get(target)
        for op in [o for o in self._ops.values() if o.target == target and not o.done]:
            if op.verb == "delete" and qr is None and node is None:
                self._ops[op.name] = replace(op, done=True, end_time=time.time())
            elif op.verb == "create" and qr is not None and qr.state != m.CREATING:
                # Creating a queued resource ends once it is accepted into the queue.
                self._ops[op.name] = replace(op, done=True, end_time=time.time(), response=qr)
            elif op.verb == "create" and node is not None and node.state == m.N_READY:
                self._ops[op.name] = replace(op, done=True, end_time=time.time(), response=node)

    def _new_op(self, zone: str, project: str, verb: str, target: str) -> OperationRecord:
        name = f"projects/{project}/locations/{zone}/operations/operation-{next(self._ids)}"
        op = OperationRecord(name=name, verb=verb, target=target, create_time=time.time())
        self._ops[name] = op
        self._settle_ops(target)
        self._cond.notify_all()  # a new due record: the clock must recompute its sleep
        return self._ops[name]

    # -- the API ------------------------------------------------------------------------

    def check_zone(self, zone: str, project: str) -> None:
        if self.zones is not None and zone not in self.zones:
            raise not_found(f"projects/{project}/locations/{zone}")

    def create_queued_resource(
        self, project: str, zone: str, qr_id: str, spec: tpu_v2.QueuedResource
    ) -> OperationRecord:
        parent = f"projects/{project}/locations/{zone}"
        name = f"{parent}/queuedResources/{qr_id}"
        validate_id("queuedResourceId", qr_id)
        specs = list(spec.tpu.node_spec)
        if len(specs) != 1 or "multislice_params" in specs[0]:
            raise invalid("the emulator supports exactly one nodeSpec with a nodeId (no multislice)")
        ns = specs[0]
        if ns.parent != parent:
            raise invalid(f"nodeSpec.parent {ns.parent!r} must be {parent!r}")
        node_name = f"{parent}/nodes/{ns.node_id}"
        validate_node(ns.node_id, ns.node)
        if spec.reservation_name:
            r = RESERVATION_RE.match(spec.reservation_name)
            if not r or r["zone"] != zone:
                raise invalid(f"reservationName {spec.reservation_name!r} is not a reservation in {parent}")
            if "guaranteed" not in spec:
                raise invalid("reservationName requires the guaranteed tier")
        with self._cond:
            if name in self._qrs:
                raise already_exists(name)
            if node_name in self._nodes:
                raise already_exists(node_name)
            self._qrs[name] = QueuedResourceRecord(
                name=name,
                zone=zone,
                spec=spec,
                accelerator_type=ns.node.accelerator_type,
                node_name=node_name,
                state=m.CREATING,
                create_time=time.time(),
                queued_at=self.now(),
                due=self.now() + self.timings.of("accept"),
            )
            return self._new_op(zone, project, "create", name)

    def create_node(self, project: str, zone: str, node_id: str, spec: tpu_v2.Node) -> OperationRecord:
        name = f"projects/{project}/locations/{zone}/nodes/{node_id}"
        validate_node(node_id, spec)
        with self._cond:
            if name in self._nodes:
                raise already_exists(name)
            if self.faults.stockout_mode(zone, spec.accelerator_type):
                # A direct create does not queue: its operation fails at once with
                # RESOURCE_EXHAUSTED, as the real API's does.
                op = OperationRecord(
                    name=f"projects/{project}/locations/{zone}/operations/operation-{next(self._ids)}",
                    verb="create",
                    target=name,
                    create_time=time.time(),
                    done=True,
                    end_time=time.time(),
                    error=ApiError(429, "RESOURCE_EXHAUSTED", f'There is no more capacity in the zone "{zone}"'),
                )
                self._ops[op.name] = op
                return op
            self._nodes[name] = NodeRecord(
                name=name,
                zone=zone,
                spec=spec,
                worker_count=catalog.lookup(spec.accelerator_type).hosts,
                state=m.N_CREATING,
                uid=next(self._ids),
                create_time=time.time(),
                spot=bool(spec.scheduling_config.spot or spec.scheduling_config.preemptible),
                due=self.now() + self.timings.of("provision"),
            )
            return self._new_op(zone, project, "create", name)

    # Records are frozen snapshots: callers render them outside the lock.

    def get(self, kind: str, name: str) -> Record:
        with self._cond:
            rec = self._collection(kind).get(name)
            if rec is None:
                raise not_found(name)
            return rec

    def list(self, kind: str, parent: str) -> list[Record]:
        with self._cond:
            return [r for n, r in sorted(self._collection(kind).items()) if n.startswith(parent + "/")]

    def _collection(self, kind: str) -> dict[str, Any]:
        collections: dict[str, dict[str, Any]] = {"queuedResources": self._qrs, "nodes": self._nodes,
                                                  "operations": self._ops}
        return collections[kind]

    def delete_queued_resource(self, project: str, zone: str, name: str, *, force: bool) -> OperationRecord:
        with self._cond:
            qr = self._qrs.get(name)
            if qr is None:
                raise not_found(name)
            node = self._nodes.get(qr.node_name)
            if qr.state != m.DELETING:
                if node is not None and qr.state in m.QR_NEEDS_FORCE and not force:
                    raise failed_precondition(
                        f"Queued resource {name} in state {qr.state} still has nodes; delete them first or set force"
                    )
                self._move_qr(qr, m.DELETING, due=self.now() + self.timings.of("delete"))
                if node is not None and node.state != m.N_DELETING:
                    self._move_node(node, m.N_DELETING, due=None, gone_reason="deleted")
            return self._new_op(zone, project, "delete", name)

    def delete_node(self, project: str, zone: str, name: str) -> OperationRecord:
        with self._cond:
            node = self._nodes.get(name)
            if node is None:
                raise not_found(name)
            if node.queued_resource:
                raise failed_precondition(
                    f"Node {name} was created by queued resource {node.queued_resource}; delete that instead"
                )
            if node.state != m.N_DELETING:
                self._move_node(
                    node, m.N_DELETING, due=self.now() + self.timings.of("delete"), gone_reason="deleted"
                )
            return self._new_op(zone, project, "delete", name)

    # -- faults that act on resources ------------------------------------------------------

    def reclaim(self, name: str) -> str:
        """The service takes a spot slice back; `name` is a queued resource or node id or full name.

        Returns the full name of what was reclaimed.
        """
        with self._cond:
            now = self.now()
            qr = self._find(self._qrs, name)
            if qr is not None:
                if qr.state != m.ACTIVE:
                    raise failed_precondition(f"cannot reclaim {qr.name} in state {qr.state}; it must be ACTIVE")
                self._move_qr(
                    qr, m.SUSPENDING, due=now + self.timings.of("preempt_grace"), initiator="SERVICE"
                )
                self._call_hook(self.hooks.on_preemption_notice, qr.node_name.rsplit("/", 1)[1])
                self._cond.notify_all()
                return qr.name
            node = self._find(self._nodes, name)
            if node is None:
                raise not_found(name)
            if node.queued_resource:
                return self.reclaim(node.queued_resource)
            if node.state != m.N_READY:
                raise failed_precondition(f"cannot reclaim {node.name} in state {node.state}; it must be READY")
            self._nodes[node.name] = replace(node, due=now + self.timings.of("preempt_grace"))
            self._call_hook(self.hooks.on_preemption_notice, node.node_id)
            self._cond.notify_all()
            return node.name

    def fill(self, name: str) -> str:
        """Capacity comes for one queued resource waiting for it (an id or a full name), whatever its zone's
        stockout: it provisions now, and the others in the zone wait on. Returns its full name."""
        with self._cond:
            qr = self._find(self._qrs, name)
            if qr is None:
                raise not_found(name)
            if qr.state != m.WAITING_FOR_RESOURCES:
                raise failed_precondition(
                    f"cannot fill {qr.name} in state {qr.state}; it must be WAITING_FOR_RESOURCES")
            self._provision(qr, self.now())
            self._cond.notify_all()  # a new due record: the clock must recompute its sleep
            return qr.name

    def terminate(self, name: str) -> str:
        """A host of the node dies (hardware, maintenance): the node becomes TERMINATED."""
        with self._cond:  # a reentrant lock: `node` takes it again
            node = self.node(name)
            if node.state != m.N_READY:
                raise failed_precondition(f"cannot terminate {node.name} in state {node.state}; it must be READY")
            self._move_node(node, m.N_TERMINATED, due=None, gone_reason="terminated")
            return node.name

    def node(self, name: str) -> NodeRecord:
        """The node `name` is, or the node of the queued resource it is (an id or a full name)."""
        with self._cond:
            node = self._find(self._nodes, name)
            if node is None:
                qr = self._find(self._qrs, name)
                node = self._nodes.get(qr.node_name) if qr else None
            if node is None:
                raise not_found(name)
            return node

    @staticmethod
    def _find(records: dict[str, Any], name: str) -> Any:
        if name in records:
            return records[name]
        hits = [r for n, r in records.items() if n.rsplit("/", 1)[1] == name]
        return hits[0] if len(hits) == 1 else None

    def snapshot(self) -> dict[str, Any]:
        with self._cond:
            return {
                "queuedResources": [q.render() for q in self._qrs.values()],
                "nodes": [n.render() for n in self._nodes.values()],
                "operations": [o.render() for o in self._ops.values()],
            }


DEADLINE_EXCEEDED = 4  # google.rpc.Code of a queued resource whose validUntil passed


def _expired(qr: QueuedResourceRecord, now: float) -> bool:
    """Whether the queued resource's `queueingPolicy.validUntilDuration` has passed since its creation, by the
    world's clock (`now`)."""
    if "queueing_policy" not in qr.spec or not qr.spec.queueing_policy.valid_until_duration:
        return False
    return now - qr.queued_at > qr.spec.queueing_policy.valid_until_duration.total_seconds()
