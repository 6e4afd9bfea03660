"""The controller: a named, detached Ray actor that drives every job to an end.

For each job a thread runs attempts until one ends the job: provision a slice through
the provider, gang-launch one `HostWorker` per host (a placement group: all or none),
watch them (results, the provider's events, heartbeats, cancellation), classify how the
attempt ended (`outcomes`), and always release what it took. Preemptions and host
losses count against `recovery.max_preemptions`, failures of the user's code against
`recovery.max_failures`; the next attempt restores the last committed checkpoint.

State lives in the store, so a restarted controller finds every job and goes on; each
launch gets a new generation, and workers of an older one are fenced off from writing
checkpoints.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from orchestrator import cluster
from orchestrator.errors import IllegalTransitionError, ProvisioningError
from orchestrator.outcomes import Outcome, OutcomeKind
from orchestrator.providers.base import Slice, SliceEventKind, SliceRequest
from orchestrator.providers.local import LocalProvider
from orchestrator.spec import EntrypointWorkload, JobSpec, LmWorkload
from orchestrator.states import JobState, SliceState
from orchestrator.store import Store
from policies.sharding import ModelDims, plan_mesh
from workers.host import HostWorker
from workers.model import ModelShape
from workers.train import TrainConfig

log = logging.getLogger(__name__)

POLL_S = 0.25


@dataclass
class _Run:
    """What the controller knows of a job's current attempt (in memory; the store has the rest)."""

    generation: int = 0
    slice: Slice | None = None
    workers: list = field(default_factory=list)
    started: bool = False
    pg: object = None
    last_progress: float = field(default_factory=time.monotonic)
    cancel: threading.Event = field(default_factory=threading.Event)


class Controller:
    def __init__(self, home_root: str, address: str, *, max_hosts: int = 8):
        self.home = cluster.Home(Path(home_root)).ensure()
        _log_to(self.home.root / "logs" / "controller.log")
        self.store = Store(self.home.db)
        self.address = address
        self.provider = LocalProvider(self.home, address, max_hosts=max_hosts, on_change=self._save_slice)
        self._runs: dict[str, _Run] = {}
        self._lock = threading.Lock()
        self._reconcile()

    # -- API (called through Ray) -------------------------------------------------

    def ping(self) -> str:
        return "ok"

    def submit(self, spec: dict, workdir: str | None = None) -> str:
        parsed = JobSpec.from_dict(spec)
        job_id = f"{parsed.name}-{secrets.token_hex(3)}"
        record = parsed.model_dump(mode="json")
        if parsed.checkpoint.directory is None:
            record["checkpoint"]["directory"] = str(self.home.default_checkpoint_dir(parsed.name))
        record["_workdir"] = workdir
        self.store.create_job(job_id, parsed.name, record)
        self.home.job_dir(job_id).mkdir(parents=True, exist_ok=True)
        self._start_thread(job_id)
        log.info("job %s submitted (%s on %s)", job_id, parsed.tier.value, parsed.accelerator)
        return job_id

    def cancel(self, job_id: str) -> None:
        self.store.update_job(job_id, cancel_requested=1)
        with self._lock:
            run = self._runs.get(job_id)
        if run:
            run.cancel.set()
        else:  # not driven by this controller (already ended, or not started): end it here
            try:
                self.store.transition(job_id, JobState.CANCELLED, "cancelled by the user")
            except IllegalTransitionError:
                pass

    def inject_fault(self, kind: str, **kw) -> None:
        """Fault injection for tests and drills (`tests/chaos`). Kinds:

        - ``short_host`` (worker_id): that host of the next slices registers half its chips,
          so the job's workers cannot all be placed; ``clear`` undoes it.
        """
        if kind == "short_host":
            self.provider.short_hosts.add(int(kw["worker_id"]))
        elif kind == "clear":
            self.provider.short_hosts.clear()
        else:
            raise ValueError(f"unknown fault {kind!r}")

    def current_generation(self, job_id: str) -> int:
        return self.store.job(job_id).generation

    def report(self, job_id: str, generation: int, rank: int, kind: str, payload: dict) -> None:
        """Heartbeats, metrics and log lines from workers; those of an old generation are dropped."""
        with self._lock:
            run = self._runs.get(job_id)
        if run is None or generation != run.generation:
            return
        lines = payload.pop("lines", [])
        if lines:
            with open(self.home.job_dir(job_id) / "job.log", "a") as f:
                f.writelines(f"[host-{rank}] {line}\n" for line in lines)
        run.last_progress = time.monotonic()
        if kind == "ready" and rank == 0 and not run.started:
            run.started = True
            self._transition(job_id, JobState.RUNNING, "all hosts joined the runtime",
                             data={"init_s": round(payload["init_s"], 3), "generation": generation})
        elif kind == "timings" and rank == 0:
            restored = payload.get("restored_step")
            what = f"restored step {restored}" if restored is not None else "started from scratch"
            self.store.add_event(job_id, "restore", f"{what}; compile took {payload['compile_s']:.1f} s",
                                 data={k: v for k, v in payload.items()})
        elif kind == "step" and rank == 0:
            self.store.record_steps(job_id, generation, [(payload["step"], payload["loss"],
                                                          payload.get("tokens_per_s"), payload.get("step_time_s"))])

    def shutdown(self) -> None:
        """Cancel every active job and release every slice (before the cluster stops)."""
        with self._lock:
            runs = list(self._runs.items())
        for job_id, run in runs:
            self.cancel(job_id)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(not self.store.job(j).state.terminal for j, _ in runs):
            time.sleep(0.2)
        for s in self.provider.list():
            self.provider.release(s.name)

    # -- driving a job --------------------------------------------------------------

    def _start_thread(self, job_id: str) -> None:
        with self._lock:
            self._runs[job_id] = _Run()
        threading.Thread(target=self._drive, args=(job_id,), name=f"job-{job_id}", daemon=True).start()

    def _drive(self, job_id: str) -> None:
        try:
            while not self.store.job(job_id).state.terminal:
                outcome = self._attempt(job_id)
                self._after(job_id, outcome)
        except Exception as e:  # a bug of ours: end the job visibly rather than leave it hanging
            log.exception("job %s: controller error", job_id)
            self._transition(job_id, JobState.FAILED, f"controller error: {type(e).__name__}: {e}")
        finally:
            with self._lock:
                self._runs.pop(job_id, None)

    def _after(self, job_id: str, outcome: Outcome) -> None:
        job = self.store.job(job_id)
        rec = job.spec["recovery"]
        k = outcome.kind
        if k is OutcomeKind.SUCCEEDED:
            self._transition(job_id, JobState.SUCCEEDED, outcome.reason)
        elif k is OutcomeKind.CANCELLED:
            self._transition(job_id, JobState.CANCELLED, outcome.reason)
        elif k is OutcomeKind.PROVISION_FAILED and not outcome.transient:
            self._transition(job_id, JobState.FAILED, f"could not provision: {outcome.reason}")
        elif outcome.counts_as_preemption:
            n = job.preemptions + 1
            self.store.update_job(job_id, preemptions=n)
            if n > rec["max_preemptions"]:
                self._transition(job_id, JobState.FAILED,
                                 f"{n} preemptions or host losses, more than max_preemptions="
                                 f"{rec['max_preemptions']}; last: {outcome.reason}")
            else:
                self._recover(job_id, outcome, f"preemption {n} of at most {rec['max_preemptions']}")
        else:  # APP_FAILED, or a transient provisioning failure (no capacity now, workers did not start)
            n = job.failures + 1
            self.store.update_job(job_id, failures=n, error=outcome.traceback)
            if n > rec["max_failures"]:
                self._transition(job_id, JobState.FAILED, f"the job's code failed {n} times "
                                 f"(max_failures={rec['max_failures']}): {outcome.reason}")
            else:
                self._recover(job_id, outcome, f"failure {n} of at most {rec['max_failures']}")

    def _recover(self, job_id: str, outcome: Outcome, budget: str) -> None:
        self._transition(job_id, JobState.RECOVERING, f"{outcome.reason} ({budget})",
                         data={"outcome": outcome.kind.value})
        if outcome.kind is OutcomeKind.PROVISION_FAILED:  # back off before asking again
            job = self.store.job(job_id)
            with self._lock:
                run = self._runs.get(job_id)
            delay = min(60.0, 2.0 ** job.failures)
            if run is not None:
                run.cancel.wait(delay)

    def _attempt(self, job_id: str) -> Outcome:
        job = self.store.job(job_id)
        with self._lock:
            run = self._runs[job_id]
        spec = JobSpec.model_validate({k: v for k, v in job.spec.items() if not k.startswith("_")})
        if job.cancel_requested or run.cancel.is_set():
            return Outcome(OutcomeKind.CANCELLED, "cancelled by the user")
        self._transition(job_id, JobState.PROVISIONING, f"requesting {spec.accelerator} ({spec.tier.value})")
        name = f"{job_id}-{job.generation + 1}"
        t0 = time.monotonic()
        try:
            self.provider.request(SliceRequest(job_id, name, spec.tpu_type, spec.tier, spec.zone))
            run.slice = self.provider.wait_ready(name, timeout_s=spec.recovery.start_timeout_s)
        except ProvisioningError as e:
            self.provider.release(name)  # idempotent; frees whatever part of the slice started
            return Outcome(OutcomeKind.PROVISION_FAILED, str(e), transient=e.transient)
        provision_s = time.monotonic() - t0
        try:
            if run.cancel.is_set():
                return Outcome(OutcomeKind.CANCELLED, "cancelled by the user")
            generation = self.store.bump_generation(job_id)
            run.generation, run.started = generation, False
            self._transition(job_id, JobState.STARTING,
                             f"slice {name} ready after {provision_s:.1f} s; starting generation {generation}",
                             data={"provision_s": round(provision_s, 3), "slice": name})
            return self._launch_and_watch(job_id, job.spec, spec, run)
        finally:
            self._teardown(run)

    def _launch_and_watch(self, job_id: str, raw_spec: dict, spec: JobSpec, run: _Run) -> Outcome:
        s = run.slice
        t = s.tpu_type
        bundles = [{"TPU": float(t.chips_per_host), h.resource: 1.0} for h in s.hosts]
        pg = placement_group(bundles, strategy="STRICT_SPREAD", name=f"{s.name}-g{run.generation}")
        run.pg = pg
        timeout = spec.recovery.start_timeout_s
        try:
            ray.get(pg.ready(), timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            return Outcome(OutcomeKind.PROVISION_FAILED,
                           f"the {t.hosts} workers of slice {s.name} could not all be placed within {timeout:.0f} s "
                           f"(each needs {t.chips_per_host} TPU chips on its own host)", transient=True)
        actor = ray.remote(HostWorker)
        run.workers = [
            actor.options(num_cpus=0, resources={"TPU": float(t.chips_per_host)}, max_concurrency=4,
                          scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
                          name=f"{s.name}-g{run.generation}-w{i}", namespace=cluster.NAMESPACE)
            .remote(job_id=job_id, generation=run.generation, rank=i, num_hosts=t.hosts,
                    devices_per_host=t.chips_per_host, platform="cpu",
                    compile_cache_dir=str(self.home.compile_cache),
                    controller=(cluster.CONTROLLER_NAME, cluster.NAMESPACE))
            for i in range(t.hosts)
        ]
        placed = ray.get([w.info.remote() for w in run.workers], timeout=timeout)
        self.store.add_event(job_id, "launched", f"{t.hosts} workers of generation {run.generation} on slice {s.name}",
                             data={"slice": s.name, "nodes": [p["node_id"] for p in placed],
                                   "generation": run.generation})
        coordinator = ray.get(run.workers[0].coordinator_address.remote(), timeout=120) if t.hosts > 1 else None
        workload = _workload(raw_spec, spec, t.chips, t.hosts)
        refs = [w.run.remote(coordinator, workload) for w in run.workers]
        run.last_progress = time.monotonic()
        return self._watch(job_id, spec, run, refs)

    def _watch(self, job_id: str, spec: JobSpec, run: _Run, refs: list) -> Outcome:
        pending, results = list(refs), {}
        hang_limit = spec.recovery.heartbeat_timeout_s
        while True:
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=POLL_S)
            for ref in done:
                rank = refs.index(ref)
                try:
                    results[rank] = ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    return Outcome(OutcomeKind.INFRA_LOST, f"worker {rank} died: {type(e).__name__}")
            failed = [r for r in results.values() if r["outcome"] == "failed"]
            if failed:
                return self._classify_failure(run, failed[0])
            if not pending:
                stopped = [r for r in results.values() if r["outcome"] == "stopped"]
                if stopped:
                    return Outcome(OutcomeKind.PREEMPTED, f"stopped at step {stopped[0].get('steps')} on notice")
                return Outcome(OutcomeKind.SUCCEEDED, "training finished")
            if run.cancel.is_set() or self.store.job(job_id).cancel_requested:
                return Outcome(OutcomeKind.CANCELLED, "cancelled by the user")
            for ev in self.provider.poll_events():
                if ev.slice_name == run.slice.name:
                    kind = OutcomeKind.PREEMPTED if ev.kind in (SliceEventKind.RECLAIMED,
                                                                SliceEventKind.PREEMPTION_NOTICE) else OutcomeKind.INFRA_LOST
                    return Outcome(kind, ev.reason)
            if run.started and time.monotonic() - run.last_progress > hang_limit:
                return Outcome(OutcomeKind.INFRA_LOST, f"no progress for {hang_limit:.0f} s (hung)")

    def _classify_failure(self, run: _Run, failure: dict) -> Outcome:
        """A worker raised: the user's code failed only if every host is still healthy.

        When a host dies, the others fail in their collectives within seconds; those
        failures are the loss of the host, not a bug in the job.
        """
        time.sleep(1.0)  # let a dying host finish dying before asking
        lost = [e for e in self.provider.poll_events() if e.slice_name == run.slice.name]
        if lost:
            return Outcome(OutcomeKind.INFRA_LOST, lost[0].reason)
        try:
            ray.get([w.info.remote() for w in run.workers], timeout=10)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
            return Outcome(OutcomeKind.INFRA_LOST, f"a worker is unreachable ({type(e).__name__})")
        return Outcome(OutcomeKind.APP_FAILED, f"host {failure['rank']}: {failure['error']}",
                       traceback=failure.get("traceback"))

    def _teardown(self, run: _Run) -> None:
        for w in run.workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception:
                pass
        run.workers = []
        pg = run.pg
        if pg is not None:
            try:
                remove_placement_group(pg)
            except Exception:
                pass
            run.pg = None
        if run.slice is not None:
            self.provider.release(run.slice.name)
            run.slice = None

    # -- bookkeeping -----------------------------------------------------------------

    def _transition(self, job_id: str, target: JobState, reason: str, *, data: dict | None = None) -> None:
        try:
            self.store.transition(job_id, target, reason, data=data)
        except IllegalTransitionError as e:
            log.warning("job %s: %s", job_id, e)

    def _save_slice(self, s: Slice, pgids: list[int]) -> None:
        self.store.add_event(s.job_id, "slice", f"slice {s.name} {s.state.value}",
                             data={"name": s.name, "accelerator": s.tpu_type.name, "chips": s.tpu_type.chips,
                                   "tier": s.tier.value, "state": s.state.value,
                                   "usd_per_hour": s.tpu_type.usd_per_hour(s.tier)})
        self.store.put_slice(s.name, s.job_id, s.provider, s.tpu_type.name, s.tier.value, s.state.value,
                             {"pgids": pgids, "hosts": [h.resource for h in s.hosts]})

    def _reconcile(self) -> None:
        """After a restart: release what the old controller left running and go on with each job."""
        for rec in self.store.slices(live_only=True):
            for pgid in rec["data"].get("pgids", []):
                cluster.stop_group(pgid)
            self.store.put_slice(rec["name"], rec["job_id"], rec["provider"], rec["accelerator"], rec["tier"],
                                 SliceState.RELEASED.value, rec["data"])
        for job in self.store.jobs(active_only=True):
            if job.state is not JobState.PENDING:
                self._transition(job.id, JobState.RECOVERING, "the controller restarted; relaunching")
            self._start_thread(job.id)


def _workload(raw_spec: dict, spec: JobSpec, devices: int, hosts: int) -> dict:
    w = spec.workload
    ckpt = raw_spec["checkpoint"]["directory"]
    if isinstance(w, EntrypointWorkload):
        return {"type": "entrypoint", "entrypoint": w.entrypoint, "args": w.args, "checkpoint_dir": ckpt,
                "workdir": raw_spec.get("_workdir")}
    assert isinstance(w, LmWorkload)
    m = w.model
    plan = plan_mesh(num_devices=devices, num_hosts=hosts, wishes=w.mesh.model_dump(),
                     dims=ModelDims(m.d_model, m.n_heads, m.kv_heads, m.d_ff, m.vocab_size),
                     global_batch_size=w.global_batch_size)
    cfg = TrainConfig(
        model=ModelShape(m.d_model, m.n_layers, m.n_heads, m.kv_heads, m.d_ff, m.vocab_size),
        seq_len=w.seq_len, global_batch_size=w.global_batch_size, steps=w.steps, seed=w.seed,
        lr_peak=w.learning_rate.peak, lr_end=w.learning_rate.end, warmup_steps=w.learning_rate.warmup_steps,
        weight_decay=w.learning_rate.weight_decay, mesh_shape=plan.shape, checkpoint_dir=ckpt,
        checkpoint_interval=spec.checkpoint.interval_steps, checkpoint_keep=spec.checkpoint.keep)
    return {"type": "lm", "config": cfg.to_dict()}


def _log_to(path: Path) -> None:
    root = logging.getLogger()
    if any(getattr(h, "_orchestrator", False) for h in root.handlers):
        return
    h = logging.FileHandler(path)
    h._orchestrator = True
    h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(h)
    root.setLevel(logging.INFO)
