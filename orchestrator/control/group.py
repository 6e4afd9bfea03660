"""One slice's workers for one generation: launched together, asked how they fare, stopped together.

The driver holds one `WorkerGroup` per launch (`JobDriver.group`) and never a worker itself:
what it decides (`orchestrator.control.job`, `orchestrator.control.job.watch`) reads only
this interface, so it runs the same against `RayWorkerGroup` (one `HostWorker` actor per
host, gang-placed) and against the scripted groups of the driver's tests.

`RayWorkerGroup`: one `HostWorker` per host, all or none (a placement group with one
bundle per host); host 0 brings up the JAX runtime's coordinator and the others join once
it listens. Each worker is told what its slice says its host is (`workers.accelerator.HostClaim`)
and decides its platform from what the host is: TPU, or its CPU where its Ray node declares
that it stands in for the chips. Workers are detached actors named by slice, generation and rank, so a
restarted controller finds them (`orchestrator.control.adoption`). A worker whose process
is gone is asked about where it ran (`orchestrator.control.postmortem`): its Ray node dead, or a
task that cannot run there, is a host loss; otherwise its stderr's end says how it aborted.

A host that goes silently (powered off, no reset) is seen by the beats every worker sends the
controller's liveness monitor (`orchestrator.control.liveness`), in about two seconds rather than
after Ray's node health check: `silent_host` names it, marks its slice lost and ends the workers
stuck in a collective with it (`ray.kill`: SIGTERM is taken by XLA's preemption handler). The
hosts' keepers stay, so a multi-slice job's survivors go on from their memory.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import ray
from ray.util.placement_group import PlacementGroup, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from orchestrator import cluster
from orchestrator.cluster.home import Home
from orchestrator.control import liveness, memory, postmortem, shipping, spares
from orchestrator.control.compile_ahead import launch_programs
from orchestrator.control.ends import END_WAIT_S, WorkerEnds
from orchestrator.control.generation import kill_workers, pg_name, where_placed, worker_name
from orchestrator.domain.provider_facts import ReportRoute
from orchestrator.domain.spec import JobSpec
from orchestrator.providers.base import Slice
from orchestrator.state.events import Launched
from orchestrator.state.store import Store
from policies.decisions.recovery import (
    Outcome,
    OutcomeKind,
)
from workers import inbox
from workers.accelerator import CPU, TPU, HostClaim
from workers.host import HostWorker
from workers.order import LaunchOrder, UserEntrypoint
from workers.protocol import WorkerResult

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from orchestrator.control.launched import Launch
    from workers.profiling import CaptureRequest

log = logging.getLogger(__name__)

PING_S = 30.0  # how long workers have to answer a ping, or to be seen dead (a process that aborts takes a while to go)


class WorkerGone(Exception):
    """A worker's process is gone (its host, or the process alone: `WorkerGroup.died` tells which)."""

    def __init__(self, error_type: str, message: str = ""):
        super().__init__(f"{error_type}: {message}" if message else error_type)
        self.error_type = error_type  # what the group's runtime raised (RayActorError, ActorDiedError, ...)


class WorkerGroup(Protocol):
    """The workers of one generation on the attempt's slices, as the driver sees them."""

    hosts: int

    def launch(self) -> Outcome | None:
        """Place and start every host's worker; an outcome only if they could not all be placed."""

    def results(self, timeout_s: float) -> list[WorkerResult | None] | None:
        """Each host's result (None while it trains); None if they do not all answer within `timeout_s`.
        Raises `WorkerGone` if a worker's process is gone."""

    def request_stop(self, reason: str) -> None:
        """Ask every host to stop after the same step, with that step's checkpoint committed."""

    def silent_host(self) -> Outcome | None:
        """INFRA_LOST once the liveness monitor found a host lost (its beats stopped and its node answers no
        probe: `orchestrator.control.liveness`), its slice marked lost and the stuck workers ended; else None."""

    def ping(self) -> tuple[WorkerGone | None, list[int]]:
        """A worker gone (as soon as one is known), else the ranks that neither answered nor died in time."""

    def died(self, error: WorkerGone) -> Outcome:
        """How a worker's process went, once the provider has not said its host went: INFRA_LOST or
        WORKER_ABORTED (its native error in the job's log)."""

    def held_step(self, slices: list[Slice], expect: int | None = None) -> tuple[int | None, str]:
        """The newest step every host of `slices` holds in its memory, or None and why not; `expect`: the step
        they should hold, waited for a moment (`memory.common_step`)."""

    def history(self) -> list[dict] | None:
        """Worker 0's steps of this generation (None if it does not answer)."""

    def request_profile(self, request: CaptureRequest) -> None:
        """Hand every host a profile capture (each votes; the chosen ones trace)."""

    def stop(self) -> None:
        """End every worker and free their places; idempotent."""


class RayWorkerGroup:
    """`HostWorker` actors in a placement group on one slice's hosts."""

    def __init__(self, store: Store, home: Home, job_id: str, spec: JobSpec, launch: Launch, *,
                 on_lost: Callable[[str], None], workers: list[ActorHandle] | None = None,
                 pg: PlacementGroup | None = None, wake: threading.Event | None = None):
        self.store, self.home, self.job_id, self.spec, self.launched = store, home, job_id, spec, launch
        self.on_lost = on_lost  # a slice whose host is gone (`Placement.mark_lost`)
        self.wake = wake  # set when the liveness monitor finds a host lost: the driver looks at once (`silent_host`)
        self.workers: list[ActorHandle] = workers or []  # rank order: slice-major
        self.pg = pg
        self.liveness: liveness.Hosts | None = None  # None: an adopted group, whose workers beat to no one here
        self._monitor: liveness.Monitor | None = None
        self.slices = list(launch.slices)
        self.hosts = sum(s.tpu_type.hosts for s in self.slices)
        self._nodes: list[str] | None = None  # each rank's Ray node, once launched
        self._spares_started = False
        self._ends: WorkerEnds | None = None  # the workers' ends as they come back, once launched or adopted
        if workers:
            self._beats_here()

    def launch(self) -> Outcome | None:
        launch, spec, slices = self.launched, self.spec, self.slices
        t, first = slices[0].tpu_type, slices[0]
        timeout = spec.recovery.start_timeout_s
        hosts = [h for s in slices for h in s.hosts]
        bundles = [{"TPU": float(t.chips_per_host), h.resource: 1.0} for h in hosts]
        self.pg = placement_group(bundles, strategy="STRICT_SPREAD", name=pg_name(first.name, launch.generation),
                                  lifetime="detached")
        names = ", ".join(s.name for s in slices)
        where = f"slice {first.name}" if len(slices) == 1 else f"{len(slices)} slices {names}"
        try:
            ray.get(self.pg.ready(), timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            return Outcome(OutcomeKind.PROVISION_FAILED,
                           f"the {len(hosts)} workers of {where} could not all be placed within {timeout:.0f} s "
                           f"(each needs {t.chips_per_host} TPU chips on its own host)", transient=True)
        code, env = self._shipped()
        # A multi-slice job's first tier: each host's copy of the state outlives its worker (`workers.memory`).
        keeps = len(slices) > 1 or launch.memory_step is not None  # or the survivors of one restore from it
        keepers = [k for s in slices for k in memory.keepers(s, env)] if keeps else [None] * len(hosts)
        actor, controller = ray.remote(HostWorker), _report_to(spec)
        on_hosts = [(s, i) for s in slices for i in range(s.tpu_type.hosts)]  # rank order
        named = [worker_name(s.name, launch.generation, i) for s, i in on_hosts]
        waiting = spares.take(named, len(hosts), controller) if spares.wanted(spec) else [None] * len(hosts)
        self.workers = [
            spare or actor.options(  # type: ignore[misc]  # ray types .remote() of an actor class as the handle
                num_cpus=0, resources={"TPU": float(t.chips_per_host)}, max_concurrency=8, runtime_env=env,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=rank),
                name=name, namespace=cluster.NAMESPACE, lifetime="detached")
            .remote(rank=rank, num_hosts=len(hosts), **self._worker_args(controller, s.name, i))
            for rank, ((s, i), name, spare) in enumerate(zip(on_hosts, named, waiting, strict=True))
        ]
        placed: list[dict] = ray.get([w.info.remote() for w in self.workers], timeout=timeout)
        self._nodes = [p["node_id"] for p in placed]
        beat = self._watch_liveness(self._nodes)
        took = sum(w is not None for w in waiting)
        self.store.add_event(self.job_id, Launched(first.name, self._nodes, [p["pid"] for p in placed],
                                                   launch.generation, len(slices), [s.name for s in slices]),
                             f"{len(hosts)} workers of generation {launch.generation} on {where}, "
                             f"{_platforms([p.get('platform') for p in placed])}"
                             + (f"; {took} of them the spares that waited on their hosts" if took else ""))
        coordinator: str | None = None
        if len(hosts) > 1:
            # Ray types an actor handle's methods as Never.
            coordinator = ray.get(self.workers[0].coordinator_address.remote(), timeout=120)  # type: ignore[assignment]
        order = self._order(shipped=code is not None)
        share_key = secrets.token_bytes(32)  # seals what hosts hand each other through the coordinator
        ray.get(self.workers[0].start.remote(coordinator, order, share_key, beat, keeper=keepers[0]), timeout=120)
        if coordinator is not None:  # the others join once host 0 listens (an early one waits out a backoff)
            ray.get(self.workers[0].coordinator_listening.remote(coordinator, 10.0), timeout=30)
        others = zip(self.workers[1:], keepers[1:], strict=True)
        ray.get([w.start.remote(coordinator, order, share_key, beat, keeper=k) for w, k in others], timeout=120)
        return None

    def _worker_args(self, controller: Any, slice_name: str, host: int) -> dict:
        """What every `HostWorker` of this launch is made with but its rank (a spare learns it when taken)."""
        t = self.slices[0].tpu_type
        return {"job_id": self.job_id, "generation": self.launched.generation, "devices_per_host": t.chips_per_host,
                "compile_cache_dir": str(self.home.compile_cache), "controller": controller,
                "workload_type": self.spec.workload.type,
                "claim": HostClaim(slice_name, t.name, host, t.generation.chip.name)}

    def prepare_next(self) -> None:
        """Once this generation has stepped: start the next one's spare worker on each host
        (`orchestrator.control.spares`), once, where the job has spares."""
        if self._spares_started or not self.workers or not spares.wanted(self.spec):
            return
        self._spares_started = True
        nodes = self._nodes or [node for node, _ in where_placed(self.store, self.job_id, self.launched.generation)]
        on_hosts = [(s.name, i) for s in self.slices for i in range(s.tpu_type.hosts)]
        if len(nodes) != len(on_hosts):  # an adopted group of an older version, whose launch named no nodes
            return
        following, controller = self.launched.generation + 1, _report_to(self.spec)
        spares.start(ray.remote(HostWorker), self._shipped()[1], [
            (node, worker_name(name, following, host),
             self._worker_args(controller, name, host) | {"generation": following, "num_hosts": self.hosts})
            for node, (name, host) in zip(nodes, on_hosts, strict=True)])

    def _shipped(self) -> tuple[shipping.Package | None, dict | None]:
        """The job's kept code folder (None: nothing shipped), and the runtime environment its workers run in:
        what the hosts cannot have."""
        code = shipping.kept(self.home.job_dir(self.job_id))
        return code, shipping.runtime_env(code, ship_project=self.spec.provider_facts.ships_code)

    def _order(self, *, shipped: bool) -> LaunchOrder:
        """The launch plan's order as the hosts get it: a user's program imported from the shipped copy of its
        folder (the runtime environment's working_dir) where the launch ships one, and where the job's storage
        keeps the train step compiled ahead for them."""
        plan, t = self.launched.plan, self.slices[0].tpu_type
        assert plan is not None, "a group this controller launches has its plan (`JobDriver.new_launch`)"
        order, program = plan.order, plan.order.program
        if shipped and isinstance(program, UserEntrypoint):
            order = dataclasses.replace(order, program=dataclasses.replace(program, workdir=None))
        programs = launch_programs(self.home, self.job_id, self.spec, t, len(self.slices))
        return dataclasses.replace(order, programs=programs)

    def _beats_here(self) -> None:
        """An adopted group's workers beat to the monitor of the controller that started them: point them at
        this one's. Each host gets a window from now, so a host that went while no controller ran (it beats
        no more) is found too; a worker the adoption found gone (None) is its host lost at once."""
        nodes = [node for node, _ in where_placed(self.store, self.job_id, self.launched.generation)]
        if len(nodes) != len(self.workers):
            log.warning("job %s: no launch record names every host; its hosts are watched by Ray alone", self.job_id)
            return
        beat = self._watch_liveness(nodes, judged_from_now=True)
        for rank, w in enumerate(self.workers):
            if w is None:
                self.liveness.gone(rank, "its worker answered no call at adoption", time.monotonic())
                continue
            try:
                w.beat_to.remote(*beat)
            except AttributeError:  # a worker of a version that does not beat: Ray's health check watches it
                log.warning("job %s: its workers cannot beat; its hosts are watched by Ray alone", self.job_id)
                self.stop_watching()
                return

    def _watch_liveness(self, nodes: list[str], *, judged_from_now: bool = False) -> tuple[tuple[str, int], bytes,
                                                                                            float]:
        """Register this launch's hosts with the controller's liveness monitor; what each worker beats with:
        where to, the launch's key (over Ray's authenticated channel, never logged), and the period."""
        period = self.spec.recovery.beat_period_s
        raylets = {n["NodeID"]: (n["NodeManagerAddress"], int(n["NodeManagerPort"])) for n in ray.nodes()
                   if n.get("Alive") and n.get("NodeManagerPort")}
        key = secrets.token_bytes(32)
        mon = self._monitor = liveness.monitor(ray.util.get_node_ip_address())
        self.liveness = mon.watch(self.job_id, self.launched.generation, key,
                                  {rank: raylets.get(node) for rank, node in enumerate(nodes)},
                                  liveness.Rule.for_period(period), judged_from_now=judged_from_now,
                                  changed=self.wake)
        return mon.address, key, period

    def results(self, timeout_s: float) -> list[WorkerResult | None] | None:
        """Each worker's result (None while it trains), read from what its `wait_result` call sent back
        (`orchestrator.control.ends`): no call, no wait. Workers that cannot wait are asked now, and given up
        to `timeout_s` to answer (None: slow to answer)."""
        if self._ends is None and WorkerEnds.can_wait(self.workers):
            self._ends = WorkerEnds(self.workers, self.wake)
        if self._ends is not None:
            try:
                return self._ends.results()
            except ray.exceptions.RayActorError as e:
                raise WorkerGone(type(e).__name__, str(e)) from e
        refs: list[Any] = [w.result.remote() for w in self.workers]
        deadline = time.monotonic() + timeout_s
        try:
            while True:  # in short waits, so a host found lost meanwhile ends the wait (`silent_host`)
                ready, _ = ray.wait(refs, num_returns=len(refs),
                                    timeout=max(0.0, min(0.1, deadline - time.monotonic())))
                ray.get(ready, timeout=0)  # a worker gone raises at once, as a plain get would
                if len(ready) == len(refs):
                    return ray.get(refs, timeout=0)
                if time.monotonic() >= deadline or self._host_lost():
                    return None
        except ray.exceptions.RayActorError as e:
            raise WorkerGone(type(e).__name__, str(e)) from e
        except ray.exceptions.GetTimeoutError:
            return None

    def _host_lost(self) -> bool:
        return self.liveness is not None and self.liveness.lost is not None

    def quiet_s(self) -> float:
        """How long the driver may wait before it looks again (`watch._wait_s`): as long as it likes once its
        workers' ends come back by themselves and wake it (a host the liveness monitor finds lost wakes it
        too); else not at all (looked at every `watch.POLL_S`)."""
        return 0.0 if self._ends is None else END_WAIT_S

    def silent_host(self) -> Outcome | None:
        lost = self.liveness.lost if self.liveness is not None else None
        if lost is None:
            return None
        self._lost(lost.rank)
        kill_workers(self.workers, None)  # the survivors wait on the lost host in a collective; keepers stay
        return Outcome(OutcomeKind.INFRA_LOST, lost.reason(self.liveness.nodes.get(lost.rank)),  # type: ignore[union-attr]
                       at=time.time() - (time.monotonic() - lost.at))

    def request_stop(self, reason: str) -> None:
        for w in self.workers:
            w.request_stop.remote(reason)

    def ping(self) -> tuple[WorkerGone | None, list[int]]:
        """A worker that aborts (a native error) is not gone at once: it writes its stack dump and core
        first, on a loaded host for seconds. Waiting for it to be seen dead, rather than calling it
        unreachable early, is what tells a worker abort from a host loss."""
        refs: list[Any] = [w.info.remote() for w in self.workers]
        pending: list[Any] = list(refs)
        deadline = time.monotonic() + PING_S
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            try:
                ray.get(ready[0])
            except ray.exceptions.RayActorError as e:
                return WorkerGone(type(e).__name__, str(e)), []
        return None, [refs.index(r) for r in pending]

    def died(self, error: WorkerGone) -> Outcome:
        """Why a worker is gone (`orchestrator.control.postmortem`): a lost host marks its slice lost."""
        placed = where_placed(self.store, self.job_id, self.launched.generation)
        verdict = postmortem.why_died(self.workers, placed, error.error_type)
        if verdict.rank is not None and verdict.host_lost:
            self._lost(verdict.rank)
        elif verdict.rank is not None and verdict.log_lines:
            self._log_lines(verdict.rank, verdict.log_lines)
        return verdict.outcome

    def held_step(self, slices: list[Slice], expect: int | None = None) -> tuple[int | None, str]:
        return memory.common_step(slices, expect=expect)

    def history(self) -> list[dict] | None:
        try:
            return ray.get(self.workers[0].history.remote(), timeout=5)
        except Exception as e:  # noqa: BLE001 -- the worker went with its host after all, however it fails
            log.warning("job %s: no step history from worker 0 (%s)", self.job_id, type(e).__name__)
            return None

    def request_profile(self, request: CaptureRequest) -> None:
        for w in self.workers:
            w.request_profile.remote(request)

    def stop_watching(self) -> None:
        if self.liveness is not None and self._monitor is not None:
            self._monitor.forget(self.job_id, self.launched.generation)
        self.liveness = None

    def stop(self) -> None:
        self.stop_watching()
        kill_workers(self.workers, self.pg)
        self.workers, self.pg, self._ends = [], None, None

    def _lost(self, rank: int) -> None:
        if (name := self.launched.slice_of(rank)) is not None:
            self.on_lost(name)

    def _log_lines(self, rank: int, lines: list[str]) -> None:
        """Lines into the job's log (`orchestrator logs`), as the host's own."""
        try:
            with open(self.home.job_dir(self.job_id) / "job.log", "a") as f:
                f.writelines(f"[host-{rank}] {line}\n" for line in lines)
        except OSError as e:
            log.warning("job %s: cannot write its log: %s", self.job_id, e)


def _platforms(platforms: list[str | None]) -> str:
    """What the workers run on, in words, from what each decided (`HostWorker.info`)."""
    if all(p == TPU for p in platforms):
        return "on TPU"
    if all(p == CPU for p in platforms):
        return "on CPU standing in for TPU chips"
    return "on " + ", ".join(f"host {rank}: {p}" for rank, p in enumerate(platforms))


def _report_to(spec: JobSpec):
    """Where the workers send their reports. A TPU VM has only the shipped packages and cannot load the
    controller's class, so its hosts report to the controller's inbox (`workers.inbox`); a local host
    shares this machine's installation and reports to the controller directly, by name."""
    if spec.provider_facts.report_route is ReportRoute.DIRECT:
        return (cluster.CONTROLLER_NAME, cluster.NAMESPACE)
    return inbox.start(cluster.NAMESPACE, cluster.CONTROLLER_NAME, ray.get_runtime_context().get_node_id())
