"""The controller: a named, detached Ray actor that holds the registry of jobs and the public API.

Each job has its driver (`orchestrator.control.job`), a thread that runs attempts
until one ends the job; the controller only starts drivers, routes requests and workers'
reports to them, and owns what jobs share: the store, the local provider and the cloud
providers, the admission queue and the metrics endpoint.

State lives in the store. Workers and their placement group are detached, so when the
controller dies the job trains on; the restarted controller adopts the running group
(`orchestrator.control.adoption`) instead of starting a second one. Each launch gets a
new generation, written to a fence file beside the checkpoints before the group starts;
workers of an older generation never write a checkpoint.

A store that cannot be written (a full disk, a read-only or deleted `state.db`) stops no
job (`orchestrator.control.store_faults`): the controller keeps the fault in memory and
exports it with the metrics (`status` and `logs` read it there), and refuses new jobs
with that fault as the error.
"""

from __future__ import annotations

import json
import logging
import secrets
import shutil
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator import cluster
from orchestrator.control import ownership, shipping
from orchestrator.control.adoption import reconcile
from orchestrator.control.job import loop
from orchestrator.control.job.driver import JobDriver
from orchestrator.control.ownership import OnExisting
from orchestrator.control.queue import AdmissionQueue
from orchestrator.control.store_faults import HeldWrites, HoldingStore, StoreFault, StoreHealth, os_fault
from orchestrator.domain.provider_facts import facts
from orchestrator.domain.spec import JobSpec
from orchestrator.errors import IllegalTransitionError, JobStateError, StoreFaultError
from orchestrator.providers.base import Slice, SliceProvider
from orchestrator.providers.local import LocalProvider, release_recorded
from orchestrator.state.events import ResizeAsked, SliceChanged, StoreFaulted
from orchestrator.state.states import JobState
from orchestrator.state.store import SliceRow, Store
from workers.protocol import Report

if TYPE_CHECKING:
    from orchestrator.providers.gcp.pace import CreatePace

log = logging.getLogger(__name__)


class Controller:
    def __init__(self, home_root: str, address: str, *, max_hosts: int = 8):
        self.home = cluster.Home(Path(home_root)).ensure()
        _log_to(self.home.root / "logs" / "controller.log")
        self.store = Store(self.home.db)
        self.store_health = StoreHealth(on_change=self._tell_jobs)
        self.held = HeldWrites(self.store_health, self.store.batch)  # every write, in order, by one thread
        self.address = address
        self.provider = LocalProvider(self.home, address, max_hosts=max_hosts, on_change=self._save_slice)
        # The queue runs on drivers' threads: its writes wait out a store fault, as theirs do.
        self.queue = AdmissionQueue(HoldingStore(self.store, self.store_health, self.held), self.provider)
        self._gcp: dict[tuple, SliceProvider] = {}  # GcpTpuProvider by (project, zones, endpoint)
        self._create_paces: dict[tuple, CreatePace] = {}  # the project's `CreatePace` by (project, endpoint)
        self._drivers: dict[str, JobDriver] = {}
        self._lock = threading.Lock()
        self._metrics = self._serve_metrics()
        self._dashboard = self._serve_dashboard()
        (self.home.root / "metrics.json").write_text(json.dumps(
            {"url": self.metrics_url(), "dashboard": self._dashboard.url if self._dashboard else None}))
        self._reconcile()

    def _serve_metrics(self):
        """Prometheus metrics of every job, on 127.0.0.1 (the URL is recorded in the state directory's metrics.json)."""
        from orchestrator.observe.metrics import serve_metrics

        server, port = serve_metrics(self.store, host="127.0.0.1", port=0, store_health=self.store_health)
        log.info("metrics on http://127.0.0.1:%d/metrics", port)
        return server

    def _serve_dashboard(self):
        """The dashboard on 127.0.0.1, behind the cluster's token; its URL goes beside the metrics URL.

        A restarted controller serves it on the port the last one used, if that port is free,
        so an open page goes on updating.
        """
        from orchestrator.control.queue import queue_positions
        from orchestrator.observe.dashboard import serve_dashboard

        try:
            previous = json.loads((self.home.root / "metrics.json").read_text()).get("dashboard") or ""
            port = int(previous.rstrip("/").rsplit(":", 1)[1]) if previous else 0
        except (OSError, ValueError, IndexError, AttributeError):
            port = 0
        try:
            server = serve_dashboard(self.store, self.home, actions=self, port=port, queue_positions=queue_positions)
        except Exception:  # the jobs matter more than their page: run without it, and say so
            log.exception("could not serve the dashboard")
            return None
        log.info("dashboard on %s", server.url)
        return server

    # -- API (called through Ray) -------------------------------------------------

    def ping(self) -> str:
        return "ok"

    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self._metrics.port}/metrics"

    def dashboard_url(self) -> str | None:
        """The dashboard's address (without the token: `orchestrator dashboard` adds it), or None if it failed."""
        return self._dashboard.url if self._dashboard else None

    def submit(self, spec: dict, workdir: str | None = None, code: shipping.Package | None = None,
               on_existing: str = OnExisting.CHECK.value) -> str:
        """Record a job and start its driver; returns its id. `workdir` fills `spec.workdir` if unset;
        `code`, the job's packed folder, is kept in its state directory and shipped at every launch.

        The job's checkpoint folder must be free and hold no other run's checkpoints
        (`orchestrator.control.ownership`; `on_existing` says what to do if it does): else
        FolderInUseError or FolderMismatchError, and nothing is recorded.
        """
        parsed = JobSpec.from_dict(spec)
        job_id = f"{parsed.name}-{secrets.token_hex(3)}"
        parsed = parsed.with_checkpoint_directory(self.home.default_checkpoint_dir(parsed.name))
        parsed = parsed.model_copy(update={"workdir": parsed.workdir or workdir})
        try:  # its folder first: a job recorded without it would have no driver
            self.home.job_dir(job_id).mkdir(parents=True, exist_ok=True)
            if code is not None:
                shipping.keep(code, self.home.job_dir(job_id))
        except OSError as e:
            raise os_fault(self.home.job_dir(job_id), e) from None
        try:
            ownership.record_job(self.store, job_id, parsed, OnExisting(on_existing))
        except StoreFaultError:  # refused, with the store's fault as the error: no id is handed out
            shutil.rmtree(self.home.job_dir(job_id), ignore_errors=True)
            raise
        self._start(JobDriver(self, job_id))
        log.info("job %s submitted (%s on %s)", job_id, parsed.tier.value, parsed.accelerator)
        return job_id

    def cancel(self, job_id: str) -> None:
        self.held.add(lambda: self.store.update_job(job_id, cancel_requested=1))  # its driver stops it meanwhile
        driver = self._driver(job_id)
        if driver:
            driver.cancel()
        else:  # not driven by this controller (already ended, or not started): end it here
            try:
                self.store.transition(job_id, JobState.CANCELLED, "cancelled by the user")
            except IllegalTransitionError:
                pass

    def resize(self, job_id: str, accelerator: str, reason: str = "requested by the user",
               tier: str | None = None) -> None:
        """Move a running job to another slice size: checkpoint at the current step, release,
        provision `accelerator`, restore resharded onto the new mesh. The global batch and the
        learning-rate schedule stay the same, so the loss curve continues."""
        job = self.store.job(job_id)
        driver = self._driver(job_id)
        if driver is None or job.state is not JobState.RUNNING:
            raise JobStateError(job_id, job.state.value, "resized", (JobState.RUNNING.value,))
        current = job.spec
        target = JobSpec.from_dict({**current.model_dump(mode="json"), "accelerator": accelerator,
                                    "tier": tier or current.tier.value},
                                   source=f"resize of {job_id} to {accelerator}")  # SpecError if it does not fit
        if (target.accelerator, target.tier) == (current.accelerator, current.tier):
            return
        standing = driver.resize(target.accelerator, target.tier.value, reason)
        if standing is not None:  # one stop a launch: the resize would be lost behind it, so it is refused
            raise JobStateError(job_id, "stopping", "resized", (JobState.RUNNING.value,),
                                why=f"its workers are stopping already ({standing.reason}); resize once it runs again")
        self.store.add_event(job_id, ResizeAsked(current.accelerator, accelerator, target.tier.value, reason,
                                                 driver.progress.last_step + 1),
                             f"resizing {current.accelerator} {current.tier.value} -> {accelerator} "
                             f"{target.tier.value}: {reason}")

    def profile(self, job_id: str, steps: int, host: int | None = None, memory: bool = False) -> dict:
        """Trace `steps` steps of a RUNNING job on all its hosts (or host `host`), from one step they agree on.

        Returns at once: the capture's id and folder (`orchestrator.control.captures`); a
        `Profiled` event follows when the hosts are done.
        """
        job = self.store.job(job_id)
        driver = self._driver(job_id)
        if driver is None or job.state is not JobState.RUNNING:
            raise JobStateError(job_id, job.state.value, "profiled", (JobState.RUNNING.value,))
        directory = driver.spec().checkpoint.directory
        assert directory is not None, "a submitted job's spec has its checkpoint directory (`submit` fills it)"
        return driver.captures.ask(driver.view(), directory, steps, host, memory)

    def profile_abandon(self, job_id: str, capture_id: str, why: str) -> None:
        """End a capture the client stopped waiting for (its event says `why`)."""
        driver = self._driver(job_id)
        if driver is not None:
            driver.captures.abandon(capture_id, why)

    def set_local_hosts(self, hosts: int) -> None:
        """How many local "TPU hosts" may run at once on this machine (default 8); jobs beyond wait QUEUED."""
        if hosts < 1:
            raise ValueError(f"local hosts must be at least 1, got {hosts}")
        self.provider.max_hosts = hosts

    def current_generation(self, job_id: str) -> int:
        return self.store.job(job_id).generation

    def report(self, job_id: str, generation: int, rank: int, report: Report, lines: list[str]) -> None:
        """Heartbeats, metrics and log lines from a job's workers (`workers.protocol`), for its driver."""
        driver = self._driver(job_id)
        if driver is not None:
            driver.report(generation, rank, report, lines)

    def shutdown(self) -> None:
        """Cancel every active job and release every slice (before the cluster stops)."""
        with self._lock:
            jobs = list(self._drivers)
        for job_id in jobs:
            self.cancel(job_id)
        deadline = time.monotonic() + 60  # not while the store cannot record their ends
        while (time.monotonic() < deadline and self.store_health.fault is None
               and any(not self.store.job(j).state.terminal for j in jobs)):
            time.sleep(0.2)
        # A cloud is asked only while the store says one of our slices may live there: a
        # cloud endpoint that is gone would otherwise hold shutdown for its whole retry budget.
        # (`orchestrator gc` looks for slices the store never heard of.)
        clouds = {rec.provider for rec in self.store.slices(live_only=True)}
        for provider in [self.provider, *(p for p in self._gcp.values() if p.name in clouds)]:
            try:
                for s in provider.list():
                    provider.release(s.name)
            except Exception:  # one unreachable cloud must not keep the others' slices alive
                log.exception("could not release the slices of provider %s", provider.name)
        # The slices' ends, written before the cluster stops (unless the store cannot take them).
        if self.store_health.fault is None and not self.held.flush(timeout_s=30):
            log.error("the state store did not take the last writes before shutdown (%d held)", self.store_health.held)

    # -- for drivers ----------------------------------------------------------------

    def provider_for(self, spec: JobSpec) -> SliceProvider:
        """The provider of the job's slices, by the spec's `provider` (`SLICE_PROVIDERS`)."""
        return self.SLICE_PROVIDERS[spec.provider](self, spec)

    def _local_provider(self, spec: JobSpec) -> SliceProvider:
        return self.provider  # one for every local job: they share this machine's hosts

    def _gcp_provider(self, spec: JobSpec) -> SliceProvider:
        """One GcpTpuProvider for each project, zones and endpoint the jobs name."""
        from orchestrator.providers.gcp import GcpTpuProvider
        from orchestrator.providers.gcp.pace import CreatePace
        from orchestrator.providers.gcp.provider import Polling
        from orchestrator.providers.startup import WorkerSetup

        g = spec.gcp
        assert g is not None, "a gcp job's spec has its gcp section (checked by semantic_problems)"
        key = (g.project, tuple(g.zones), g.endpoint)
        # The TPU API on this machine (an emulator) is looked at every 0.5 s; Google's, every 5 s (its quota).
        local_api = (g.endpoint or "").startswith(("http://127.", "http://localhost", "http://[::1]"))
        with self._lock:
            if key not in self._gcp:
                polling = Polling(poll_s=0.5) if local_api else Polling()
                # The create quota is the project's: the providers of one project (other zones) share its pace.
                pace = self._create_paces.setdefault(
                    (g.project, g.endpoint), CreatePace(polling.creates_per_minute, burst=polling.create_burst))
                self._gcp[key] = GcpTpuProvider(
                    g.project, g.zones, endpoint=g.endpoint, node_service_account=g.service_account,
                    reservation=g.reservation, polling=polling, create_pace=pace,
                    worker_setup=WorkerSetup(g.head_address or self.address, ray_token_secret=g.ray_token_secret),
                    on_change=lambda s: self._save_slice(s, []))
            return self._gcp[key]

    # The registry from a job file's `provider` to the provider of its slices (the facts that set the
    # providers apart are in `orchestrator.domain.provider_facts`).
    SLICE_PROVIDERS: dict[str, Callable[[Controller, JobSpec], SliceProvider]] = {
        "local": _local_provider, "gcp": _gcp_provider}

    def release_record(self, rec: SliceRow) -> None:
        """Release a slice known only from the store (an earlier controller's)."""
        release_recorded(self.home, self.store, rec)
        if facts(rec.provider).owns_cloud_resources:  # delete them there, not only our record of them
            try:
                self.provider_for(self.store.job(rec.job_id).spec).release(rec.name)
            except Exception:  # `orchestrator gc` finds it later; say so now
                log.exception("could not release gcp slice %s; run `orchestrator gc`", rec.name)

    # -- the registry -----------------------------------------------------------------

    def _driver(self, job_id: str) -> JobDriver | None:
        with self._lock:
            return self._drivers.get(job_id)

    def _start(self, driver: JobDriver) -> None:
        loop.start(self._register(driver), on_exit=self._forget)

    def _register(self, driver: JobDriver) -> JobDriver:
        """The driver takes its job's reports, cancels and resizes from now on (before it starts, after a restart)."""
        with self._lock:
            self._drivers[driver.job_id] = driver
        return driver

    def _forget(self, job_id: str) -> None:
        with self._lock:
            self._drivers.pop(job_id, None)

    def _save_slice(self, s: Slice, pgids: list[int]) -> None:
        """A provider's word on one of its slices: the store records it, or refuses a move its lifecycle forbids."""
        save_slice(self.held, self.store, s, {"pgids": pgids, "hosts": [h.resource for h in s.hosts], "zone": s.zone})

    def _tell_jobs(self, line: str, ended: StoreFault | None) -> None:
        """A store fault began or `ended`: a line in the log of every job this controller drives
        (`orchestrator logs`), and when it ended, an event in each (`status --events`)."""
        if ended is None and (fault := self.store_health.fault) is not None and fault.cause == "deleted":
            self._rescue_store()
        with self._lock:
            drivers = list(self._drivers.values())
        for driver in drivers:
            driver.progress.log_lines([f"[store] {line}"])
            if ended is not None:
                try:
                    self.store.add_event(driver.job_id, StoreFaulted(ended.cause, round(time.time() - ended.since, 1),
                                                                     ended.message), line)
                except StoreFaultError:  # at fault again already: the next end says it
                    pass

    def _rescue_store(self) -> None:
        """`state.db` was deleted under the running cluster: what this controller still reads of it goes to
        `state.db.rescued` (room permitting), for `down`, `mv` and `up` to resume every job from."""
        rescued = self.home.db.with_name(self.home.db.name + ".rescued")
        try:
            self.store.copy_to(rescued)
        except (OSError, sqlite3.Error) as e:
            log.error("could not write the deleted store's content to %s: %s", rescued, e)
            return
        log.error("%s was deleted while the cluster ran; what the controller had of it is in %s: stop the cluster "
                  "(`orchestrator down`), `mv %s %s`, and `orchestrator up` resumes every job", self.home.db, rescued,
                  rescued, self.home.db)

    def _reconcile(self) -> None:
        """After a restart: adopt each job's running worker group, or clean up and relaunch."""
        reconcile(self, lambda job_id, adoption: self._register(JobDriver(self, job_id, adoption)), self._start,
                  loop.lost_with_the_cluster)


class _LogFile(logging.FileHandler):
    """The controller's log file. A line the disk refuses (it is full) stays in the file's buffer and is
    written with the first line that fits; logging's default would also print a traceback to the
    process's stderr for every such line, a flood on a disk that stays full."""

    _orchestrator = True  # marks the handler this module added (one per process)

    def handleError(self, record: logging.LogRecord) -> None:
        pass


def save_slice(held: HeldWrites, store: Store, s: Slice, data: dict) -> None:
    """Record a provider's word on slice `s` through the controller's writer (it runs on the driver that looked):
    written soon after the writes before it, or held while the store cannot be written."""
    event = SliceChanged(s.name, s.tpu_type.name, s.tpu_type.chips, s.tier.value, s.state.value,
                         s.tpu_type.usd_per_hour(s.tier))
    at = time.time()  # when it was seen, not when the writer gets to it

    def put() -> None:
        try:
            store.put_slice(s.name, s.job_id, s.provider, s.tpu_type.name, s.tier.value, s.state.value, data,
                            event=event, at=at)
        except IllegalTransitionError as e:  # a provider's bug: keep the record as it was, and say so
            log.error("job %s: the store refused a slice move: %s", s.job_id, e)

    held.add(put)


def _log_to(path: Path) -> None:
    root = logging.getLogger()
    if any(getattr(h, "_orchestrator", False) for h in root.handlers):
        return
    h = _LogFile(path)
    h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(h)
    root.setLevel(logging.INFO)
