"""The controller's side of `benchmarks/fleet.py`: many jobs' drivers over one store and one gcp provider.

What runs as in production: each job's `JobDriver` on its own thread (the loop, `watch`, the recovery
rules, the moves, the reports it records), the SQLite store, the admission queue, the real cost policy
(`StoredFactsPolicy`) for the jobs that autoscale, the `GcpTpuProvider` with the real google-cloud-tpu
client against the TPU API emulator, the metrics endpoint and the dashboard's server.

What is scripted: the hosts. The emulator's nodes are API objects only, so a slice's hosts "join" as
soon as its node is READY (`api_hosts`), and each launch's workers are a `Script` that does a step
every `step_s` seconds of wall time (with jitter), saves every `interval_steps` and, now and then, is
sent a preemption notice: in the controller's process (`TimedGroup`), or, to kill the controller under
them, in another (`ScriptedHosts`, the benchmark's): there they train on while no controller runs, and a
restarted one finds them through the same adoption pass as Ray's groups (`adoption.reconcile`, with
`RemoteGroups` for Ray's named actors). The fence file a launch writes beside the checkpoints goes to Cloud Storage
in production; here it is counted and skipped (`FENCES`): it is the storage client's cost, not the
control plane's.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import logging
import queue
import random
import secrets
import threading
import time
from contextlib import contextmanager
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path

from orchestrator.cluster.home import Home
from orchestrator.control.adoption import Adoption, Found, reconcile
from orchestrator.control.controller import save_slice
from orchestrator.control.job import loop
from orchestrator.control.job.driver import JobDriver
from orchestrator.control.queue import AdmissionQueue, queue_positions
from orchestrator.control.store_faults import HeldWrites, HoldingStore, StoreHealth
from orchestrator.domain.spec import JobSpec
from orchestrator.providers.base import Host, Slice, host_resource
from orchestrator.providers.local import release_recorded
from orchestrator.state.events import Launched
from orchestrator.state.store import SliceRow, Store
from workers.protocol import Ending, Ready, Saved, StepDone, Timings, WorkerResult, saved_entry

log = logging.getLogger(__name__)

PROJECT, ZONE = "fleet-bench", "us-central2-b"
FENCES = [0]  # fences a launch would have written (skipped, see the module's docstring)


def api_hosts(s: Slice) -> list[Host]:
    """Every host of a slice whose node is READY counts as joined (the nodes are API objects only)."""
    return [Host(w, host_resource(s.name, w), node_id=f"{s.name}-node-{w}", address=f"10.0.0.{w + 1}")
            for w in range(s.tpu_type.hosts)]


class _Hosts:
    max_hosts = 8  # the local provider's; gcp jobs are not limited by this machine's hosts


class Writes:
    """Counts the store's write transactions (each `Store._tx` not inside a `Store.batch`), and the writes made
    inside batches (but step rows, which a batch puts in at its end), by wrapping it for the run."""

    def __init__(self) -> None:
        self.count = 0
        self.in_batches = 0
        self._lock = threading.Lock()

    @contextmanager
    def installed(self):
        original = Store._tx
        counter = self

        @contextmanager
        def counted(store, *args, **kwargs):
            inside = getattr(store._local, "batch", None) is not None
            with original(store, *args, **kwargs) as db:
                yield db
            with counter._lock:
                if inside:
                    counter.in_batches += 1
                else:
                    counter.count += 1

        Store._tx = counted
        try:
            yield self
        finally:
            Store._tx = original


class FleetWorld:
    """What the controller holds (`orchestrator.control.job.services.JobServices`), with the gcp provider
    on the emulator and scripted groups in place of Ray's workers."""

    def __init__(self, root: Path, endpoint: str, *, step_s: float = 3.0, notice_every: int = 400,
                 poll_s: float = 0.5, seed: int = 0, serve: bool = True,
                 list_over: int | None = None, creates_per_minute: float | None = 60.0, hosts: str | None = None):
        from orchestrator.providers.gcp import GcpTpuProvider
        from orchestrator.providers.gcp.provider import Polling
        from orchestrator.providers.startup import WorkerSetup

        self.home = Home(root).ensure()
        self.store = Store(self.home.db)
        self.store_health = StoreHealth()
        self.held = HeldWrites(self.store_health, self.store.batch)
        self.provider = _Hosts()
        self.queue = AdmissionQueue(HoldingStore(self.store, self.store_health, self.held), self.provider)
        self.endpoint, self.step_s, self.notice_every = endpoint, step_s, notice_every
        self.rng = random.Random(seed)
        # list_over: None keeps the provider's default; a large number makes every look a GET per slice
        # creates_per_minute: the project's create pace (the provider's default, 60); None: none
        polling = Polling(poll_s=poll_s, creates_per_minute=creates_per_minute)
        if list_over is not None:
            polling = Polling(poll_s=poll_s, creates_per_minute=creates_per_minute, list_over=list_over)
        self.gcp = GcpTpuProvider(PROJECT, [ZONE], endpoint=endpoint, polling=polling,
                                  worker_setup=WorkerSetup("127.0.0.1:6379"), join_check=api_hosts,
                                  on_change=self._save_slice)
        self.committed: dict[str, int] = {}  # job -> newest committed step (orbax's latest step)
        self.drivers: dict[str, JobDriver] = {}
        self.ended: dict[str, float] = {}
        self.notices = 0
        self._lock = threading.Lock()
        self.metrics_port: int | None = None
        self.dashboard_url: str | None = None
        # hosts: the address of `ScriptedHosts` (groups outside this process, which outlive it); None: in it
        self.link = HostsLink(hosts) if hosts else None
        if serve:
            self._serve()

    def _serve(self) -> None:
        from orchestrator.observe.dashboard import serve_dashboard
        from orchestrator.observe.metrics import serve_metrics

        self._metrics, self.metrics_port = serve_metrics(self.store, host="127.0.0.1", port=0,
                                                         store_health=self.store_health)
        if not self.home.token_file.exists():  # the cluster's token (`orchestrator up` writes it)
            self.home.token_file.write_text(secrets.token_urlsafe(32) + "\n")
            self.home.token_file.chmod(0o600)
        self._dashboard = serve_dashboard(self.store, self.home, actions=None, port=0, queue_positions=queue_positions)
        self.dashboard_url = self._dashboard.url

    # -- JobServices -----------------------------------------------------------------------

    def provider_for(self, spec: JobSpec):
        return self.gcp

    def _save_slice(self, s: Slice) -> None:
        save_slice(self.held, self.store, s, {"hosts": [h.resource for h in s.hosts], "zone": s.zone})  # as Controller

    # -- jobs ------------------------------------------------------------------------------

    def submit(self, job_id: str, spec: dict) -> None:
        parsed = JobSpec.from_dict(spec)
        self.store.create_job(job_id, parsed.name, parsed.model_dump(mode="json"))
        self.start(job_id)

    def start(self, job_id: str) -> JobDriver:
        driver = FleetDriver(self, job_id, groups=self.group_for)
        self._start(driver)
        return driver

    def _start(self, driver: JobDriver) -> None:
        with self._lock:
            self.drivers[driver.job_id] = driver
        loop.start(driver, on_exit=self._forget)

    def reconcile(self) -> dict:
        """What a restarted controller does first (`adoption.reconcile`, as `Controller._reconcile`), its groups
        found in `ScriptedHosts`: when each job's group was found and its driver started, and which were
        adopted (the others are relaunched)."""
        assert self.link is not None, "groups in this process went with the controller that ran them"
        finder = RemoteGroups(self.link)
        started: dict[str, float] = {}
        adopted: list[str] = []

        def new_driver(job_id: str, adoption: Adoption | None) -> JobDriver:
            if adoption is not None:
                adopted.append(job_id)
            return FleetDriver(self, job_id, adoption, groups=self.group_for)

        def start(driver: JobDriver) -> None:
            self._start(driver)
            started[driver.job_id] = time.time()

        reconcile(self, new_driver, start, loop.lost_with_the_cluster, groups=finder)
        return {"found": finder.found, "started": started, "adopted": adopted}

    def release_record(self, rec: SliceRow) -> None:
        """A slice known only from the store (an earlier controller's): released in the store (with its event, as
        `Controller.release_record`) and in the API."""
        release_recorded(self.home, self.store, rec)
        self.gcp.release(rec.name)

    def _forget(self, job_id: str) -> None:
        with self._lock:
            self.drivers.pop(job_id, None)
            self.ended[job_id] = time.time()

    def running(self) -> int:
        with self._lock:
            return len(self.drivers)

    def group_for(self, driver: JobDriver, spec: JobSpec) -> TimedGroup | RemoteGroup:
        if self.link is not None:
            assert driver.launched is not None, "a group is made for a launch"
            return RemoteGroup(self.link, driver.job_id, driver.launched.generation, driver)
        return TimedGroup(self, driver, spec)

    def stop(self) -> None:
        if self.metrics_port is not None:
            self._metrics.stop()
            self._dashboard.stop()


class Script:
    """A launch's workers on wall time: restore the newest committed step, then a step every `step_s`
    (x0.8-1.2), a checkpoint every `interval_steps`; asked to stop, they stop after the next step with
    its checkpoint committed, as the real loop does. One launch in `notice_every` gets a notice.
    `committed` is the checkpoints' storage (job -> newest committed step): it outlives every launch."""

    def __init__(self, job_id: str, generation: int, hosts: int, steps: int, interval: int, *,
                 committed: dict[str, int], step_s: float, rng: random.Random, notice_every: int):
        self.job_id, self.generation, self.hosts, self.total, self.interval = job_id, generation, hosts, steps, interval
        self.committed, self.step_s, self.rng = committed, step_s, rng
        self.restored = committed.get(job_id)
        self.step = self.restored - 1 if self.restored is not None else -1
        self.stop_reason: str | None = None
        self.ended: list[WorkerResult] | None = None
        self.notice_at: int | None = None
        if notice_every and rng.random() < 1.0 / notice_every * steps:
            self.notice_at = rng.randrange(steps)
        self.history: list[dict] = []  # every step's report, as a `HostWorker` keeps it
        self.next_at = time.time() + self._step_time()

    def first_reports(self) -> list:
        return [Ready(init_s=0.1), Timings(restore_s=0.1, compile_s=0.0, restored_step=self.restored, source="storage")]

    def _step_time(self) -> float:
        return self.step_s * self.rng.uniform(0.8, 1.2)

    def advance(self) -> tuple[list, bool]:
        """One step: its reports, and whether its host's notice came with it."""
        self.next_at = time.time() + self._step_time()
        self.step += 1
        done = self.step + 1
        step = StepDone(self.step, loss=1.0 / done, step_time_s=self.step_s)
        self.history.append({**dataclasses.asdict(step), "at": time.time()})
        reports: list = [step]
        if done % self.interval == 0 or done == self.total or self.stop_reason:
            self.committed[self.job_id] = done
            reports.append(Saved(done))
            self.history[-1] = {**self.history[-1], **saved_entry(reports[-1])}  # as a `HostWorker` keeps it
        noticed = self.notice_at is not None and self.step >= self.notice_at and self.stop_reason is None
        if noticed:
            self.notice_at = None
        if done >= self.total:  # the last step: done, whatever stop was asked meanwhile (as the real loop ends)
            self.ended = [WorkerResult(Ending.SUCCEEDED, r, steps=done) for r in range(self.hosts)]
        elif self.stop_reason:
            self.ended = [WorkerResult(Ending.STOPPED, r, steps=done, notice=self.stop_reason)
                          for r in range(self.hosts)]
        return reports, noticed

    def quiet_s(self) -> float:
        """Until its next step (the driver need not look sooner: `watch._wait_s`); 0 once ended."""
        return 0.0 if self.ended is not None else max(0.0, self.next_at - time.time())


NOTICE = "preemption notice (scripted host's metadata server)"


class _Scripted:
    """What a scripted group answers as every group must, with nothing to say: no host of it goes silent or
    dies alone, it keeps no copy in memory, and no profile is asked of it."""

    def silent_host(self):
        return None

    def ping(self):
        return None, []

    def died(self, error):
        raise AssertionError("no scripted worker dies alone")

    def held_step(self, slices, expect=None):
        return None, "scripted hosts keep no copy in memory"

    def request_profile(self, request) -> None:
        raise AssertionError("no profile is asked for in the fleet benchmark")


class TimedGroup(_Scripted):
    """A launch's `Script` in the controller's process, stepped by its driver's looks (`results`)."""

    def __init__(self, world: FleetWorld, driver: JobDriver, spec: JobSpec):
        self.world, self.driver = world, driver
        launch = driver.launched
        assert launch is not None, "a group is made for a launch"
        self.generation = launch.generation
        self.script: Script | None = None
        self.spec = spec

    def _report(self, report) -> None:
        self.driver.report(self.generation, 0, report, [])

    def launch(self):
        w, launch = self.world, self.driver.launched
        self.script = Script(self.driver.job_id, self.generation, launch.hosts, self.spec.workload.steps,
                             self.spec.checkpoint.interval_steps, committed=w.committed, step_s=w.step_s, rng=w.rng,
                             notice_every=w.notice_every)
        for r in self.script.first_reports():
            self._report(r)
        return None

    def results(self, timeout_s: float):
        script = self.script
        if script.ended is not None or time.time() < script.next_at:
            return script.ended
        reports, noticed = script.advance()
        for r in reports:
            self._report(r)
        if noticed:
            self.world.notices += 1
            self.driver.view().on_stop(NOTICE)
        return script.ended

    def quiet_s(self) -> float:
        return self.script.quiet_s()

    def request_stop(self, reason: str) -> None:
        self.script.stop_reason = reason

    def history(self):
        return []

    def stop(self) -> None:
        if self.script is not None:
            self.script.ended = self.script.ended or []


# -- groups outside the controller's process (`--kill-controller`) ---------------------------------

AUTHKEY = b"fleet-bench"


class ScriptedHosts:
    """Every launch's `Script` in a process of its own (the benchmark's), stepped on wall time by one thread:
    they train on while no controller runs, as Ray's detached workers do, and answer the controller that
    connects next (`HostsLink`). A report with no controller to take it is dropped, as a worker's is."""

    def __init__(self, *, step_s: float, notice_every: int, seed: int = 0):
        self.step_s, self.notice_every, self.rng = step_s, notice_every, random.Random(seed)
        self.listener = Listener(("127.0.0.1", 0), authkey=AUTHKEY)
        self.address = "%s:%d" % self.listener.address
        self.scripts: dict[tuple[str, int], Script] = {}
        self.committed: dict[str, int] = {}
        self.steps_done: dict[str, int] = {}  # job -> steps its hosts did, over all launches
        self.saves: dict[str, int] = {}  # job -> checkpoints its hosts committed
        self.dropped = 0  # messages no controller took
        self.notices = 0
        self._due: list[tuple[float, int, tuple[str, int]]] = []
        self._seq = 0
        self._cond = threading.Condition()
        self._conn: Connection | None = None
        self._send_lock = threading.Lock()
        for target in (self._accept, self._tick):
            threading.Thread(target=target, daemon=True).start()

    def _send(self, *msg) -> None:
        with self._send_lock:
            conn = self._conn
            if conn is None:
                self.dropped += 1
                return
            try:
                conn.send(msg)
            except (OSError, EOFError):  # the controller went
                self._conn = None
                self.dropped += 1

    def _accept(self) -> None:
        while True:
            conn = self.listener.accept()
            with self._send_lock:
                self._conn = conn
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: Connection) -> None:
        while True:
            try:
                kind, job, gen, *rest = conn.recv()
            except (OSError, EOFError):
                return
            with self._cond:
                script = self.scripts.get((job, gen))
                if kind == "launch":
                    hosts, steps, interval = rest
                    script = Script(job, gen, hosts, steps, interval, committed=self.committed, step_s=self.step_s,
                                    rng=self.rng, notice_every=self.notice_every)
                    self.scripts[(job, gen)] = script
                    self._schedule(script)
                elif kind == "stop" and script is not None:
                    script.stop_reason = rest[0]
                elif kind == "end":
                    self.scripts.pop((job, gen), None)
                elif kind == "find":  # (answered, history, next step's time, results): what adoption asks
                    answer = None if script is None else (list(script.history), script.next_at, script.ended)
            if kind == "launch":
                for r in script.first_reports():
                    self._send("report", job, gen, r, script.next_at)
            elif kind == "find":
                self._send("answer", job, gen, rest[0], answer)

    def _schedule(self, script: Script) -> None:
        self._seq += 1
        heapq.heappush(self._due, (script.next_at, self._seq, (script.job_id, script.generation)))
        self._cond.notify()

    def _tick(self) -> None:
        while True:
            with self._cond:
                while not self._due or self._due[0][0] > time.time():
                    self._cond.wait(None if not self._due else self._due[0][0] - time.time())
                _, _, key = heapq.heappop(self._due)
                script = self.scripts.get(key)
                if script is None or script.ended is not None:
                    continue
                reports, noticed = script.advance()
                self.steps_done[key[0]] = self.steps_done.get(key[0], 0) + 1
                self.saves[key[0]] = self.saves.get(key[0], 0) + sum(isinstance(r, Saved) for r in reports)
                self.notices += noticed
                if script.ended is None:
                    self._schedule(script)
            for r in reports:
                self._send("report", *key, r, script.next_at)
            if noticed:
                self._send("notice", *key)
            if script.ended is not None:
                self._send("ended", *key, script.ended)

    def running(self) -> int:
        with self._cond:
            return sum(s.ended is None for s in self.scripts.values())


class HostsLink:
    """The controller's end of `ScriptedHosts`: launches, stops and finds groups there; what the hosts report
    goes to the drivers from `lanes` threads (a job's reports in order, on one of them), as Ray's calls of
    `Controller.report` do."""

    def __init__(self, address: str, lanes: int = 4):
        host, port = address.rsplit(":", 1)
        self.conn = Client((host, int(port)), authkey=AUTHKEY)
        self.groups: dict[tuple[str, int], RemoteGroup] = {}
        self._lock, self._send_lock = threading.Lock(), threading.Lock()
        self._asked: dict[int, tuple[threading.Event, list]] = {}
        self._ids = itertools.count()
        self.lanes = [queue.SimpleQueue() for _ in range(lanes)]
        for lane in self.lanes:
            threading.Thread(target=self._deliver, args=(lane,), daemon=True).start()
        threading.Thread(target=self._receive, daemon=True).start()

    def send(self, *msg) -> None:
        with self._send_lock:
            self.conn.send(msg)

    def find(self, job_id: str, generation: int, timeout_s: float = 30.0):
        """The group's (history, next step's time, results) from the hosts, or None if they hold none."""
        rid = next(self._ids)
        done, answer = threading.Event(), []
        with self._lock:
            self._asked[rid] = (done, answer)
        self.send("find", job_id, generation, rid)
        if not done.wait(timeout_s):
            raise TimeoutError(f"the hosts did not answer for {job_id} generation {generation} in {timeout_s:.0f} s")
        return answer[0]

    def _receive(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except (OSError, EOFError):
                return
            if msg[0] == "answer":
                with self._lock:
                    done, answer = self._asked.pop(msg[3])
                answer.append(msg[4])
                done.set()
            else:
                self.lanes[hash(msg[1]) % len(self.lanes)].put(msg)

    def _deliver(self, lane: queue.SimpleQueue) -> None:
        while True:
            kind, job, gen, *rest = lane.get()
            with self._lock:
                group = self.groups.get((job, gen))
            if group is None:  # no group of it here: dropped, as `Controller.report` drops it
                continue
            if kind == "ended":
                group.ended = rest[0]
            elif kind == "report":
                group.next_at = rest[1]
            driver = group.driver
            if driver is None:  # found, its driver not made yet: the report is dropped (the history has its step)
                continue
            try:
                if kind == "report":
                    driver.report(gen, 0, rest[0], [])
                elif kind == "notice":
                    driver.view().on_stop(NOTICE)
                else:
                    driver.wake.set()
            except Exception:  # noqa: BLE001 -- one job's fault must not stop the others' reports
                log.exception("job %s: a report from the scripted hosts failed", job)


class RemoteGroup(_Scripted):
    """A launch's group in `ScriptedHosts`, seen from the controller: what its driver reads is what the hosts
    said last."""

    def __init__(self, link: HostsLink, job_id: str, generation: int, driver: JobDriver | None = None):
        self.link, self.job_id, self.generation, self.driver = link, job_id, generation, driver
        self.next_at = time.time()
        self.ended: list[WorkerResult] | None = None
        with link._lock:
            link.groups[(job_id, generation)] = self

    def launch(self):
        """Start the launch's script in the hosts, and record where it runs as Ray's group records its placed
        workers (`Launched`: what adoption finds the generation's slices by)."""
        launch, spec = self.driver.launched, self.driver.spec()
        self.link.send("launch", self.job_id, self.generation, launch.hosts, spec.workload.steps,
                       spec.checkpoint.interval_steps)
        names = [s.name for s in launch.slices]
        nodes = [h.node_id for s in launch.slices for h in s.hosts]
        self.driver.store.add_event(self.job_id, Launched(names[0], nodes, None, self.generation, len(names), names),
                                    f"{len(nodes)} scripted workers of generation {self.generation} on "
                                    f"{', '.join(names)}")
        return None

    def results(self, timeout_s: float):
        return self.ended

    def quiet_s(self) -> float:
        return 0.0 if self.ended is not None else max(0.0, self.next_at - time.time())

    def request_stop(self, reason: str) -> None:
        self.link.send("stop", self.job_id, self.generation, reason)

    def history(self):
        found = self.link.find(self.job_id, self.generation)
        return None if found is None else found[0]

    def stop(self) -> None:
        self.link.send("end", self.job_id, self.generation)
        with self.link._lock:
            self.link.groups.pop((self.job_id, self.generation), None)


class RemoteGroups:
    """`adoption.GroupFinder` for the groups in `ScriptedHosts`: what Ray's named actors are to the controller.
    `found` keeps when each job's group was found (for the benchmark's timings)."""

    def __init__(self, link: HostsLink):
        self.link = link
        self.found: dict[str, float] = {}

    def find(self, store, job, running) -> Found:
        answer = self.link.find(job.id, job.generation)
        if answer is None:
            raise RuntimeError("the hosts hold no group of this generation")
        history, next_at, ended = answer
        group = RemoteGroup(self.link, job.id, job.generation)
        group.next_at, group.ended = next_at, ended
        self.found[job.id] = time.time()
        return Found([], None, history, group)

    def discard(self, job, running) -> None:
        self.link.send("end", job.id, job.generation)


class FleetDriver(JobDriver):
    """A job's real driver that takes an adopted scripted group as it is (`Adoption.group`), where
    `JobDriver._adopt` wraps Ray's actors in a `RayWorkerGroup`."""

    def _adopt(self, adoption: Adoption) -> None:
        self.placement.adopt(adoption.provider, list(adoption.launch.slices))
        self.launched = adoption.launch
        self.progress.adopted(adoption.launch, adoption.last_step)
        self.group = adoption.group
        self.group.driver = self
