"""The controller's side of `benchmarks/fleet.py`: many jobs' drivers over one store and one gcp provider.

What runs as in production: each job's `JobDriver` on its own thread (the loop, `watch`, the recovery
rules, the moves, the reports it records), the SQLite store, the admission queue, the real cost policy
(`StoredFactsPolicy`) for the jobs that autoscale, the `GcpTpuProvider` with the real google-cloud-tpu
client against the TPU API emulator, the metrics endpoint and the dashboard's server.

What is scripted: the hosts. The emulator's nodes are API objects only, so a slice's hosts "join" as
soon as its node is READY (`api_hosts`), and each launch's workers are a `TimedGroup` that does a step
every `step_s` seconds of wall time (with jitter), saves every `interval_steps` and, now and then, is
sent a preemption notice. The fence file a launch writes beside the checkpoints goes to Cloud Storage
in production; here it is counted and skipped (`FENCES`): it is the storage client's cost, not the
control plane's.
"""

from __future__ import annotations

import random
import secrets
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from orchestrator.cluster.home import Home
from orchestrator.control.job import loop
from orchestrator.control.job.driver import JobDriver
from orchestrator.control.queue import AdmissionQueue, queue_positions
from orchestrator.control.store_faults import HeldWrites, StoreHealth
from orchestrator.domain.spec import JobSpec
from orchestrator.providers.base import Host, Slice, host_resource
from orchestrator.state.events import SliceChanged
from orchestrator.state.store import Store
from workers.protocol import Ending, Ready, Saved, StepDone, Timings, WorkerResult

PROJECT, ZONE = "fleet-bench", "us-central2-b"
FENCES = [0]  # fences a launch would have written (skipped, see the module's docstring)


def api_hosts(s: Slice) -> list[Host]:
    """Every host of a slice whose node is READY counts as joined (the nodes are API objects only)."""
    return [Host(w, host_resource(s.name, w), node_id=f"{s.name}-node-{w}", address=f"10.0.0.{w + 1}")
            for w in range(s.tpu_type.hosts)]


class _Hosts:
    max_hosts = 8  # the local provider's; gcp jobs are not limited by this machine's hosts


class Writes:
    """Counts the store's write transactions (each `Store._tx`), by wrapping it for the run."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()

    @contextmanager
    def installed(self):
        original = Store._tx
        counter = self

        @contextmanager
        def counted(store, *args, **kwargs):
            with original(store, *args, **kwargs) as db:
                yield db
            with counter._lock:
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
                 list_over: int | None = None, creates_per_minute: float | None = 60.0):
        from orchestrator.providers.gcp import GcpTpuProvider
        from orchestrator.providers.gcp.provider import Polling
        from orchestrator.providers.startup import WorkerSetup

        self.home = Home(root).ensure()
        self.store = Store(self.home.db)
        self.store_health = StoreHealth()
        self.held = HeldWrites(self.store_health)
        self.provider = _Hosts()
        self.queue = AdmissionQueue(self.store, self.provider)
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
        self.store.put_slice(s.name, s.job_id, s.provider, s.tpu_type.name, s.tier.value, s.state.value,
                             {"hosts": [h.resource for h in s.hosts], "zone": s.zone},
                             event=SliceChanged(s.name, s.tpu_type.name, s.tpu_type.chips, s.tier.value,
                                                s.state.value, s.tpu_type.usd_per_hour(s.tier)))

    # -- jobs ------------------------------------------------------------------------------

    def submit(self, job_id: str, spec: dict) -> None:
        parsed = JobSpec.from_dict(spec)
        self.store.create_job(job_id, parsed.name, parsed.model_dump(mode="json"))
        self.start(job_id)

    def start(self, job_id: str, adoption=None) -> JobDriver:
        driver = JobDriver(self, job_id, adoption, groups=self.group_for)
        with self._lock:
            self.drivers[job_id] = driver
        loop.start(driver, on_exit=self._forget)
        return driver

    def _forget(self, job_id: str) -> None:
        with self._lock:
            self.drivers.pop(job_id, None)
            self.ended[job_id] = time.time()

    def running(self) -> int:
        with self._lock:
            return len(self.drivers)

    def group_for(self, driver: JobDriver, spec: JobSpec) -> TimedGroup:
        return TimedGroup(self, driver, spec)

    def stop(self) -> None:
        if self.metrics_port is not None:
            self._metrics.stop()
            self._dashboard.stop()


class TimedGroup:
    """A launch's workers on wall time: restore the newest committed step, then a step every `step_s`
    (x0.8-1.2), a checkpoint every `interval_steps`; asked to stop, they stop after the next step with
    its checkpoint committed, as the real loop does. One launch in `notice_every` gets a notice."""

    def __init__(self, world: FleetWorld, driver: JobDriver, spec: JobSpec):
        self.world, self.driver, self.spec = world, driver, spec
        launch = driver.launched
        assert launch is not None, "a group is made for a launch"
        self.generation, self.hosts = launch.generation, launch.hosts
        self.job_id = driver.job_id
        self.step = -1
        self.next_at = 0.0
        self.stop_reason: str | None = None
        self.ended: list[WorkerResult] | None = None
        self.notice_at: int | None = None
        if world.notice_every and world.rng.random() < 1.0 / world.notice_every * spec.workload.steps:
            self.notice_at = world.rng.randrange(spec.workload.steps)

    def _report(self, report) -> None:
        self.driver.report(self.generation, 0, report, [])

    def launch(self):
        restored = self.world.committed.get(self.job_id)
        self.step = restored - 1 if restored is not None else -1
        self._report(Ready(init_s=0.1))
        self._report(Timings(restore_s=0.1, compile_s=0.0, restored_step=restored, source="storage"))
        self.next_at = time.monotonic() + self._step_time()
        return None

    def _step_time(self) -> float:
        return self.world.step_s * self.world.rng.uniform(0.8, 1.2)

    def results(self, timeout_s: float):
        if self.ended is not None:
            return self.ended
        now = time.monotonic()
        if now < self.next_at:
            return None
        self.next_at = now + self._step_time()
        total = self.spec.workload.steps
        self.step += 1
        self._report(StepDone(self.step, loss=1.0 / (self.step + 1), step_time_s=self.world.step_s))
        done = self.step + 1
        if done % self.spec.checkpoint.interval_steps == 0 or done == total or self.stop_reason:
            self.world.committed[self.job_id] = done
            self._report(Saved(done))
        if self.notice_at is not None and self.step >= self.notice_at and self.stop_reason is None:
            self.notice_at = None
            self.world.notices += 1
            self.driver.view().on_stop("preemption notice (scripted host's metadata server)")
        if self.stop_reason:
            self.ended = [WorkerResult(Ending.STOPPED, r, steps=done, notice=self.stop_reason)
                          for r in range(self.hosts)]
        elif done >= total:
            self.ended = [WorkerResult(Ending.SUCCEEDED, r, steps=done) for r in range(self.hosts)]
        return self.ended

    def quiet_s(self) -> float:
        """Until its next step (the driver need not look sooner: `watch._wait_s`); 0 once ended."""
        return 0.0 if self.ended is not None else max(0.0, self.next_at - time.monotonic())

    def request_stop(self, reason: str) -> None:
        self.stop_reason = reason

    def silent_host(self):
        return None  # no host of a scripted group goes silent

    def ping(self):
        return None, []

    def died(self, error):
        raise AssertionError("no scripted worker dies alone")

    def history(self):
        return []

    def held_step(self, slices):
        return None, "scripted hosts keep no copy in memory"

    def request_profile(self, request) -> None:
        raise AssertionError("no profile is asked for in the fleet benchmark")

    def stop(self) -> None:
        self.ended = self.ended or []
