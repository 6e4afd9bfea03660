"""The controller: a named, detached Ray actor that drives every job to an end.

For each job a thread runs attempts until one ends the job: provision a slice through
the provider, gang-launch one `HostWorker` per host (a placement group: all or none),
watch them (their results, the provider's events, heartbeats, notices, cancellation),
classify how the attempt ended (`outcomes`), and always release what it took.
Preemptions and host losses count against `recovery.max_preemptions`, failures of the
user's code against `recovery.max_failures`; the next attempt restores the last
committed checkpoint.

State lives in the store. Workers and their placement group are detached, so when the
controller dies the job trains on; the restarted controller adopts the running group
(`_reconcile`) instead of starting a second one. Each launch gets a new generation,
written to a fence file beside the checkpoints before the group starts; workers of an
older generation never write a checkpoint.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import ray
import tenacity
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from orchestrator import catalog, cluster
from orchestrator.errors import IllegalTransitionError, JobStateError, ProvisioningError
from orchestrator.control.outcomes import Outcome, OutcomeKind
from orchestrator.providers.base import CapacityError, Host, Slice, SliceEventKind, SliceRequest
from orchestrator.providers.local import LocalProvider, release_recorded
from orchestrator.control.queue import AdmissionQueue
from orchestrator.user.spec import EntrypointWorkload, JobSpec, LmWorkload
from orchestrator.state.states import JobState, SliceState
from orchestrator.state.store import Store
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
    provider: object = None  # the SliceProvider of the current slice
    slice: Slice | None = None
    workers: list = field(default_factory=list)
    pg: object = None
    started: bool = False
    accepting: bool = False  # whether reports of `generation` still count (not once its attempt ended)
    adopted: bool = False
    last_progress: float = field(default_factory=time.monotonic)
    last_step: int = -1  # newest step reported by worker 0 in this generation
    cancel: threading.Event = field(default_factory=threading.Event)
    notice: str | None = None
    notice_at: float | None = None
    disrupted_at: float | None = None  # wall time of the last disruption, for "resumed after"
    disrupted_step: int | None = None  # steps complete when it happened
    resumed: bool = True
    resize_to: str | None = None  # accelerator to move to once the current step is checkpointed
    resize_tier: str | None = None
    next_decision: float = 0.0  # monotonic time of the next autoscaling decision


class Controller:
    def __init__(self, home_root: str, address: str, *, max_hosts: int = 8):
        self.home = cluster.Home(Path(home_root)).ensure()
        _log_to(self.home.root / "logs" / "controller.log")
        self.store = Store(self.home.db)
        self.address = address
        self.provider = LocalProvider(self.home, address, max_hosts=max_hosts, on_change=self._save_slice)
        self.queue = AdmissionQueue(self.store, self.provider)
        self._gcp: dict[tuple, object] = {}  # GcpTpuProvider by (project, zones, endpoint)
        self._runs: dict[str, _Run] = {}
        self._lock = threading.Lock()
        self._metrics = self._serve_metrics()
        self._reconcile()

    def _serve_metrics(self):
        """Prometheus metrics of every job, on 127.0.0.1; the URL is recorded in the state directory."""
        import json

        from orchestrator.observe.metrics import serve_metrics

        server, port = serve_metrics(self.store, host="127.0.0.1", port=0)
        (self.home.root / "metrics.json").write_text(json.dumps({"url": f"http://127.0.0.1:{port}/metrics"}))
        log.info("metrics on http://127.0.0.1:%d/metrics", port)
        return server

    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self._metrics.port}/metrics"

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
        self._start_thread(job_id, _Run())
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

    def resize(self, job_id: str, accelerator: str, reason: str = "requested by the user",
               tier: str | None = None) -> None:
        """Move a running job to another slice size: checkpoint at the current step, release,
        provision `accelerator`, restore resharded onto the new mesh. The global batch and the
        learning-rate schedule stay the same, so the loss curve continues."""
        job = self.store.job(job_id)
        raw = dict(job.spec)
        with self._lock:
            run = self._runs.get(job_id)
        if run is None or job.state is not JobState.RUNNING:
            raise JobStateError(job_id, job.state.value, "resized", (JobState.RUNNING.value,))
        target = JobSpec.from_dict({**{k: v for k, v in raw.items() if not k.startswith("_")},
                                    "accelerator": accelerator, "tier": tier or raw["tier"]},
                                   source=f"resize of {job_id} to {accelerator}")  # SpecError if it does not fit
        if target.accelerator == raw["accelerator"] and target.tier.value == raw["tier"]:
            return
        run.resize_to, run.resize_tier = target.accelerator, target.tier.value
        run.notice, run.notice_at = f"resize to {accelerator}: {reason}", time.monotonic()
        self.store.add_event(job_id, "resize", f"resizing {raw['accelerator']} {raw['tier']} -> "
                             f"{accelerator} {target.tier.value}: {reason}",
                             data={"from": raw["accelerator"], "to": accelerator, "tier": target.tier.value,
                                   "reason": reason, "step": run.last_step + 1})

    def set_local_hosts(self, hosts: int) -> None:
        """How many local "TPU hosts" may run at once on this machine (default 8); jobs beyond wait QUEUED."""
        if hosts < 1:
            raise ValueError(f"local hosts must be at least 1, got {hosts}")
        self.provider.max_hosts = hosts

    def inject_fault(self, kind: str, **kw) -> None:
        """Fault injection for tests and drills. Kinds:

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
        if run is None or generation != run.generation or not run.accepting:
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
            self._record_restore(job_id, run, payload)
        elif kind == "step" and rank == 0:
            self._record_step(job_id, run, generation, payload)
        elif kind == "checkpoint" and rank == 0:
            self.store.add_event(job_id, "checkpoint", f"saved step {payload['step']}", data=payload)
        elif kind == "notice" and run.notice is None:
            run.notice, run.notice_at = f"host {rank}: {payload['reason']}", time.monotonic()
            self.store.add_event(job_id, "notice", f"preemption notice on host {rank} ({payload['reason']}) "
                                 f"after step {run.last_step + 1}", data={"rank": rank, "step": run.last_step + 1})

    def shutdown(self) -> None:
        """Cancel every active job and release every slice (before the cluster stops)."""
        with self._lock:
            runs = list(self._runs)
        for job_id in runs:
            self.cancel(job_id)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(not self.store.job(j).state.terminal for j in runs):
            time.sleep(0.2)
        # A cloud is asked only while the store says one of our slices may live there: a
        # cloud endpoint that is gone would otherwise hold shutdown for its whole retry budget.
        # (`orchestrator gc` looks for slices the store never heard of.)
        clouds = {rec["provider"] for rec in self.store.slices(live_only=True)}
        for provider in [self.provider, *(p for p in self._gcp.values() if p.name in clouds)]:
            try:
                for s in provider.list():
                    provider.release(s.name)
            except Exception:  # one unreachable cloud must not keep the others' slices alive
                log.exception("could not release the slices of provider %s", provider.name)

    def _provider_for(self, spec: JobSpec):
        if spec.provider == "local":
            return self.provider
        from orchestrator.providers.gcp import GcpTpuProvider
        from orchestrator.providers.startup import WorkerSetup

        g = spec.gcp
        key = (g.project, tuple(g.zones), g.endpoint)
        with self._lock:
            if key not in self._gcp:
                self._gcp[key] = GcpTpuProvider(
                    g.project, g.zones, endpoint=g.endpoint, node_service_account=g.service_account,
                    reservation=g.reservation,
                    worker_setup=WorkerSetup(g.head_address or self.address, ray_token_secret=g.ray_token_secret),
                    on_change=lambda s: self._save_slice(s, []))
            return self._gcp[key]

    # -- what workers report ----------------------------------------------------------

    def _record_step(self, job_id: str, run: _Run, generation: int, p: dict) -> None:
        run.last_step = p["step"]
        self.store.record_steps(job_id, generation, [(p["step"], p["loss"], p.get("tokens_per_s"),
                                                      p.get("step_time_s"))])
        if not run.resumed and run.disrupted_at is not None:
            run.resumed = True
            self.store.add_event(job_id, "resumed", f"resumed after {time.time() - run.disrupted_at:.1f} s "
                                 f"(first step done: {p['step'] + 1})",
                                 data={"seconds": time.time() - run.disrupted_at, "step": p["step"] + 1})

    def _record_missed(self, job_id: str, generation: int, history: list[dict]) -> int:
        """Record the steps of a worker's history that no report brought (reports are fire-and-forget)."""
        known = {m.step for m in self.store.steps(job_id)}
        missed = [(h["step"], h["loss"], h.get("tokens_per_s"), h.get("step_time_s"), h.get("at"))
                  for h in history if h["step"] not in known]
        self.store.record_steps(job_id, generation, missed)  # one transaction, each row at its own time
        return len(missed)

    def _catch_up(self, job_id: str, run: _Run, outcome: Outcome) -> None:
        """Before a group is torn down, record the steps whose reports are still in flight.

        Not after a host was lost: a dead host's worker may not answer, and recovery must not wait for it.
        """
        if not run.workers or not run.started or outcome.kind is OutcomeKind.INFRA_LOST:
            return
        try:
            history = ray.get(run.workers[0].history.remote(), timeout=5)
        except Exception as e:  # the worker went with its host after all: what is recorded is what there is
            log.warning("job %s: no step history from worker 0 (%s)", job_id, type(e).__name__)
            return
        run.accepting = False
        self._record_missed(job_id, run.generation, history)
        run.last_step = max([run.last_step, *(h["step"] for h in history)])

    def _record_restore(self, job_id: str, run: _Run, p: dict) -> None:
        restored, unreadable = p.get("restored_step"), p.get("unreadable") or []
        what = f"restored step {restored}" if restored is not None else "started from scratch"
        if unreadable:
            what += f" (fell back: checkpoint {', '.join(map(str, unreadable))} unreadable)"
        self.store.add_event(job_id, "restore", f"{what}; compile took {p['compile_s']:.1f} s", data=p)
        if run.disrupted_step is not None:
            lost = max(0, run.disrupted_step - (restored or 0))
            times = [m.step_time_s for m in self.store.steps(job_id) if m.step_time_s]
            mean = sum(times) / len(times) if times else 0.0
            self.store.add_event(job_id, "lost_work", f"lost {lost} steps (from step {run.disrupted_step} back to "
                                 f"{restored or 0})", data={"steps": lost, "seconds": lost * mean,
                                                             "from_step": run.disrupted_step,
                                                             "to_step": restored or 0})

    # -- driving a job --------------------------------------------------------------

    def _start_thread(self, job_id: str, run: _Run) -> None:
        with self._lock:
            self._runs[job_id] = run
        threading.Thread(target=self._drive, args=(job_id, run), name=f"job-{job_id}", daemon=True).start()

    def _drive(self, job_id: str, run: _Run) -> None:
        try:
            if run.adopted:  # a group started by the previous controller: watch it to its end first
                spec = self._spec(job_id)
                try:
                    outcome = self._watch(job_id, spec, run)
                    self._catch_up(job_id, run, outcome)
                finally:
                    self._teardown(run)
                self._after(job_id, run, outcome)
            while not self.store.job(job_id).state.terminal:
                outcome = self._attempt(job_id, run)
                self._after(job_id, run, outcome)
        except Exception as e:  # a bug of ours: end the job visibly rather than leave it hanging
            log.exception("job %s: controller error", job_id)
            self._teardown(run)
            self._transition(job_id, JobState.FAILED, f"controller error: {type(e).__name__}: {e}")
        finally:
            with self._lock:
                self._runs.pop(job_id, None)

    def _spec(self, job_id: str) -> JobSpec:
        return JobSpec.model_validate({k: v for k, v in self.store.job(job_id).spec.items() if not k.startswith("_")})

    def _after(self, job_id: str, run: _Run, outcome: Outcome) -> None:
        job = self.store.job(job_id)
        rec = job.spec["recovery"]
        k = outcome.kind
        if k is OutcomeKind.RESIZED:
            raw = dict(job.spec, accelerator=run.resize_to, tier=run.resize_tier or job.spec["tier"])
            self.store.update_spec(job_id, raw)
            self._transition(job_id, JobState.RESIZING, outcome.reason, data={"to": run.resize_to})
            run.resize_to, run.disrupted_step, run.disrupted_at, run.resumed = None, run.last_step + 1, time.time(), False
            return
        if k not in (OutcomeKind.SUCCEEDED, OutcomeKind.CANCELLED, OutcomeKind.PROVISION_FAILED):
            steps_done = run.last_step + 1
            run.disrupted_at, run.disrupted_step, run.resumed = outcome.at, steps_done, False
            self.store.add_event(job_id, "disruption", f"{k.value}: {outcome.reason} (after step {steps_done})",
                                 data={"kind": k.value, "step": run.last_step, "reason": outcome.reason,
                                       "generation": run.generation, "teardown_s": time.time() - outcome.at},
                                 at=outcome.at)
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
                self._recover(job_id, run, outcome, f"preemption {n} of at most {rec['max_preemptions']}")
        else:  # APP_FAILED, or a transient provisioning failure (no capacity now, workers did not start)
            n = job.failures + 1
            self.store.update_job(job_id, failures=n, error=outcome.traceback or outcome.reason)
            if n > rec["max_failures"]:
                self._transition(job_id, JobState.FAILED, f"the job's code failed {n} times "
                                 f"(max_failures={rec['max_failures']}): {outcome.reason}"
                                 if k is OutcomeKind.APP_FAILED else
                                 f"could not start after {n} tries (max_failures={rec['max_failures']}): "
                                 f"{outcome.reason}")
            else:
                self._recover(job_id, run, outcome, f"failure {n} of at most {rec['max_failures']}")

    def _recover(self, job_id: str, run: _Run, outcome: Outcome, budget: str) -> None:
        self._transition(job_id, JobState.RECOVERING, f"{outcome.reason} ({budget})",
                         data={"outcome": outcome.kind.value})
        if outcome.kind in (OutcomeKind.PROVISION_FAILED, OutcomeKind.APP_FAILED):  # back off before trying again
            run.cancel.wait(min(60.0, 2.0 ** self.store.job(job_id).failures))

    def _attempt(self, job_id: str, run: _Run) -> Outcome:
        refused, refusals = None, 0
        while True:  # until a slice is ready: a request refused for capacity goes back to the queue
            job = self.store.job(job_id)
            spec = self._spec(job_id)
            if job.cancel_requested or run.cancel.is_set():
                return Outcome(OutcomeKind.CANCELLED, "cancelled by the user")
            if spec.autoscaling is not None:
                spec = self._autoscale_before_provisioning(job_id, spec)
            ended = self.queue.wait_turn(job_id, spec, run.cancel, refused=refused, refusals=refusals)
            if ended is not None:
                return ended
            self._transition(job_id, JobState.PROVISIONING, f"requesting {spec.accelerator} ({spec.tier.value})")
            t0 = time.monotonic()
            run.provider = self._provider_for(spec)
            try:
                run.slice = self._provision(job_id, spec, job.generation + 1, run.provider, round_=refusals)
                break
            except CapacityError as e:  # waiting never spends max_failures
                refused, refusals = str(e), refusals + 1
            except ProvisioningError as e:
                return Outcome(OutcomeKind.PROVISION_FAILED, str(e), transient=e.transient)
        provision_s = time.monotonic() - t0
        try:
            if run.cancel.is_set():
                return Outcome(OutcomeKind.CANCELLED, "cancelled by the user")
            generation = self.store.bump_generation(job_id)
            run.generation, run.started, run.last_step, run.notice = generation, False, -1, None
            run.accepting = True
            run.next_decision = time.monotonic() + 30.0  # let it measure its speed first
            self._write_fence(job.spec, generation)
            self._transition(job_id, JobState.STARTING,
                             f"slice {run.slice.name} ready after {provision_s:.1f} s; starting generation "
                             f"{generation}", data={"provision_s": round(provision_s, 3), "slice": run.slice.name})
            outcome = self._launch(job_id, job.spec, spec, run) or self._watch(job_id, spec, run)
            self._catch_up(job_id, run, outcome)
            return outcome
        finally:
            self._teardown(run)

    def _spot_chips_available(self, spec: JobSpec) -> int:
        """The largest spot slice the job may ask for (the autoscaler takes off what the zone refused it lately)."""
        allowed = [catalog.lookup(a) for a in spec.autoscaling.accelerators]
        if spec.provider == "local":
            allowed = [t for t in allowed if t.hosts <= self.provider.max_hosts]
        return max((t.chips for t in allowed), default=0)

    def _autoscale_before_provisioning(self, job_id: str, spec: JobSpec) -> JobSpec:
        """Let the cost policy choose the slice type and tier of the next attempt."""
        from orchestrator.control.autoscaler import decide_for, with_checkpoint_interval

        choice = decide_for(self.store, job_id, now=time.time(), current=None,
                            spot_chips_available=self._spot_chips_available(spec))
        if choice is None:
            self.store.add_event(job_id, "autoscale", "the policy would wait for spot capacity; asking for "
                                 f"{spec.accelerator} {spec.tier.value} as the spec says (a queued request waits "
                                 "for capacity)")
            return spec
        d = choice.decision
        every = choice.checkpoint_interval_steps
        saving = f"; checkpoint every {every} steps" if every else ""
        self.store.add_event(job_id, "autoscale", f"run {choice.accelerator} {choice.tier}{saving}: {d.reason}",
                             data={"accelerator": choice.accelerator, "tier": choice.tier,
                                   "expected_cost_usd": d.expected_cost_usd, "reason": d.reason,
                                   "checkpoint_interval_steps": every})
        if (choice.accelerator, choice.tier) != (spec.accelerator, spec.tier.value):
            raw = dict(self.store.job(job_id).spec, accelerator=choice.accelerator, tier=choice.tier)
            self.store.update_spec(job_id, raw)
            spec = self._spec(job_id)
        return with_checkpoint_interval(spec, choice)

    def _autoscale_while_running(self, job_id: str, spec: JobSpec, run: _Run) -> None:
        """Every decision interval: ask the policy whether the running job should move."""
        from orchestrator.control.autoscaler import DECISION_INTERVAL_S, decide_for

        now = time.monotonic()
        if spec.autoscaling is None or not run.started or run.notice or now < run.next_decision:
            return
        run.next_decision = now + DECISION_INTERVAL_S
        current = (spec.accelerator, spec.tier.value)
        choice = decide_for(self.store, job_id, now=time.time(), current=current,
                            spot_chips_available=self._spot_chips_available(spec))
        if choice is None or (choice.accelerator, choice.tier) == current:
            return
        d = choice.decision
        self.store.add_event(job_id, "autoscale", f"move to {choice.accelerator} {choice.tier}: {d.reason}",
                             data={"accelerator": choice.accelerator, "tier": choice.tier,
                                   "expected_cost_usd": d.expected_cost_usd, "reason": d.reason})
        self.resize(job_id, choice.accelerator, f"cost policy: {d.reason}", tier=choice.tier)

    def _provision(self, job_id: str, spec: JobSpec, attempt: int, provider, *, round_: int = 0) -> Slice:
        """A ready slice, asking again (with backoff and jitter) while the failure is transient.

        A refusal for capacity is not retried here: the queue waits for capacity. `round_`
        counts those refusals, so every request has a name of its own.
        """
        stem = f"{job_id}-{attempt}" + (f"q{round_}" if round_ else "")
        names = iter(f"{stem}{suffix}" for suffix in ["", "b", "c", "d"])

        def once() -> Slice:
            name = next(names)
            try:
                provider.request(SliceRequest(job_id, name, spec.tpu_type, spec.tier, spec.zone))
                ready = provider.wait_ready(name, timeout_s=spec.recovery.start_timeout_s)
            except ProvisioningError:
                provider.release(name)  # idempotent; frees whatever part of the slice started
                raise
            return ready  # both providers record each state of their slices through `_save_slice`

        retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(3), wait=tenacity.wait_exponential_jitter(initial=1, max=20),
            retry=tenacity.retry_if_exception(
                lambda e: isinstance(e, ProvisioningError) and e.transient and not isinstance(e, CapacityError)),
            reraise=True)
        return retrying(once)

    def _launch(self, job_id: str, raw_spec: dict, spec: JobSpec, run: _Run) -> Outcome | None:
        s = run.slice
        t = s.tpu_type
        timeout = spec.recovery.start_timeout_s
        bundles = [{"TPU": float(t.chips_per_host), h.resource: 1.0} for h in s.hosts]
        run.pg = placement_group(bundles, strategy="STRICT_SPREAD", name=_pg_name(s.name, run.generation),
                                 lifetime="detached")
        try:
            ray.get(run.pg.ready(), timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            return Outcome(OutcomeKind.PROVISION_FAILED,
                           f"the {t.hosts} workers of slice {s.name} could not all be placed within {timeout:.0f} s "
                           f"(each needs {t.chips_per_host} TPU chips on its own host)", transient=True)
        actor = ray.remote(HostWorker)
        run.workers = [
            actor.options(num_cpus=0, resources={"TPU": float(t.chips_per_host)}, max_concurrency=8,
                          scheduling_strategy=PlacementGroupSchedulingStrategy(run.pg, placement_group_bundle_index=i),
                          name=_worker_name(s.name, run.generation, i), namespace=cluster.NAMESPACE,
                          lifetime="detached")
            .remote(job_id=job_id, generation=run.generation, rank=i, num_hosts=t.hosts,
                    devices_per_host=t.chips_per_host, platform="cpu",
                    compile_cache_dir=str(self.home.compile_cache),
                    controller=(cluster.CONTROLLER_NAME, cluster.NAMESPACE), workload_type=spec.workload.type)
            for i in range(t.hosts)
        ]
        placed = ray.get([w.info.remote() for w in run.workers], timeout=timeout)
        self.store.add_event(job_id, "launched", f"{t.hosts} workers of generation {run.generation} on slice {s.name}",
                             data={"slice": s.name, "nodes": [p["node_id"] for p in placed],
                                   "pids": [p["pid"] for p in placed], "generation": run.generation})
        coordinator = ray.get(run.workers[0].coordinator_address.remote(), timeout=120) if t.hosts > 1 else None
        workload = _workload(raw_spec, spec, t.chips, t.hosts)
        share_key = secrets.token_bytes(32)  # seals what hosts hand each other through the coordinator
        ray.get(run.workers[0].start.remote(coordinator, workload, share_key), timeout=120)
        if coordinator is not None:  # the others join once host 0 listens (an early one waits out a backoff)
            ray.get(run.workers[0].coordinator_listening.remote(coordinator, 10.0), timeout=30)
        ray.get([w.start.remote(coordinator, workload, share_key) for w in run.workers[1:]], timeout=120)
        run.last_progress = time.monotonic()
        return None

    def _watch(self, job_id: str, spec: JobSpec, run: _Run) -> Outcome:
        hang_limit, grace = spec.recovery.heartbeat_timeout_s, spec.recovery.grace_period_s
        stop_sent = False
        while True:
            for ev in run.provider.poll_events():  # the provider sees a host go within a poll
                if ev.slice_name != run.slice.name:
                    continue
                if ev.kind is SliceEventKind.PREEMPTION_NOTICE and run.notice is None:
                    run.notice, run.notice_at = ev.reason, time.monotonic()
                elif ev.kind is not SliceEventKind.PREEMPTION_NOTICE:
                    kind = OutcomeKind.PREEMPTED if ev.kind is SliceEventKind.RECLAIMED else OutcomeKind.INFRA_LOST
                    return Outcome(kind, ev.reason)
            try:
                results = ray.get([w.result.remote() for w in run.workers], timeout=0.5)
            except ray.exceptions.RayActorError as e:
                return Outcome(OutcomeKind.INFRA_LOST, f"a worker died ({type(e).__name__})")
            except ray.exceptions.GetTimeoutError:
                results = None  # slow to answer; the heartbeat timeout below decides whether it hangs
            if results is not None:
                failed = [r for r in results if r and r["outcome"] == "failed"]
                if failed:
                    return self._classify_failure(run, failed[0])
                if all(results):
                    stopped = [r for r in results if r["outcome"] == "stopped"]
                    if stopped and run.resize_to:
                        return Outcome(OutcomeKind.RESIZED, f"checkpointed after step {stopped[0]['steps']} to "
                                       f"resize to {run.resize_to}")
                    if stopped:
                        return Outcome(OutcomeKind.PREEMPTED,
                                       f"preemption notice ({run.notice or stopped[0]['notice']}); stopped after "
                                       f"step {stopped[0]['steps']} with its checkpoint committed")
                    self.store.update_job(job_id, result={"steps": results[0].get("steps"),
                                                          "param_sums": results[0].get("param_sums")})
                    return Outcome(OutcomeKind.SUCCEEDED, "training finished")
            if run.cancel.is_set() or self.store.job(job_id).cancel_requested:
                self._stop_for_cancel(run, stop_sent, grace)
                return Outcome(OutcomeKind.CANCELLED, "cancelled by the user")
            if run.notice is not None:
                if not stop_sent:  # every host stops after the same step, with a committed checkpoint
                    for w in run.workers:
                        w.request_stop.remote(run.notice)
                    stop_sent = True
                if time.monotonic() - run.notice_at > grace:
                    return Outcome(OutcomeKind.PREEMPTED, f"preemption notice ({run.notice}); no checkpoint within "
                                   f"the {grace:.0f} s grace window")
            if run.started and time.monotonic() - run.last_progress > hang_limit:
                return Outcome(OutcomeKind.INFRA_LOST, f"no progress for {hang_limit:.0f} s (hung)")
            self._autoscale_while_running(job_id, spec, run)
            time.sleep(POLL_S)

    def _stop_for_cancel(self, run: _Run, stop_sent: bool, grace: float) -> None:
        """Stop every host after the same step with that step's checkpoint committed, as a notice would.

        So a cancelled job loses nothing: resubmitted with the same checkpoint directory,
        it goes on from the step it reached, and every step it ran is recorded. Hosts that
        do not stop within the grace period are killed like any others.
        """
        if not run.started:
            return
        if not stop_sent:
            if run.notice is None:  # the hosts' own "notice" reports are this stop, not a preemption
                run.notice, run.notice_at = "cancelled by the user", time.monotonic()
            for w in run.workers:
                w.request_stop.remote("cancelled by the user")
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            try:
                if all(ray.get([w.result.remote() for w in run.workers], timeout=1.0)):
                    return
            except ray.exceptions.GetTimeoutError:
                pass
            except ray.exceptions.RayActorError:  # a host went meanwhile: nothing more to wait for
                return
            time.sleep(POLL_S)

    def _classify_failure(self, run: _Run, failure: dict) -> Outcome:
        """A worker raised: the user's code failed only if every host is still healthy.

        When a host dies, the others fail in their collectives within seconds; those
        failures are the loss of the host, not a bug in the job.
        """
        time.sleep(1.0)  # let a dying host finish dying before asking
        lost = [e for e in run.provider.poll_events() if e.slice_name == run.slice.name]
        if lost:
            return Outcome(OutcomeKind.INFRA_LOST, lost[0].reason)
        try:
            ray.get([w.info.remote() for w in run.workers], timeout=10)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
            return Outcome(OutcomeKind.INFRA_LOST, f"a worker is unreachable ({type(e).__name__})")
        return Outcome(OutcomeKind.APP_FAILED, f"host {failure['rank']}: {failure['error']}",
                       traceback=failure.get("traceback"))

    def _teardown(self, run: _Run) -> None:
        run.accepting = False  # a dying group's last words must not land after its disruption
        for w in run.workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception:  # already gone with its host
                pass
        run.workers = []
        if run.pg is not None:
            try:
                remove_placement_group(run.pg)
            except Exception:
                pass
            run.pg = None
        if run.slice is not None:
            run.provider.release(run.slice.name)
            run.slice = None

    # -- bookkeeping -----------------------------------------------------------------

    def _write_fence(self, raw_spec: dict, generation: int) -> None:
        """Record the current generation beside the checkpoints (atomically) before a group starts."""
        from etils import epath

        ckpt = raw_spec["checkpoint"]["directory"]
        d = epath.Path(ckpt)
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f".fence.tmp-{secrets.token_hex(4)}"
        tmp.write_text(str(generation))
        tmp.replace(d / ".fence")

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
        """After a restart: adopt each job's running worker group, or clean up and relaunch."""
        live = {}
        for rec in self.store.slices(live_only=True):
            live.setdefault(rec["job_id"], []).append(rec)
        for job in self.store.jobs(active_only=True):
            run = self._try_adopt(job, live.pop(job.id, []))
            if run is None and job.state not in (JobState.PENDING, JobState.QUEUED):
                self._transition(job.id, JobState.RECOVERING, "the controller restarted; relaunching")
            self._start_thread(job.id, run or _Run())
        for recs in live.values():  # slices of jobs that are over
            for rec in recs:
                self._release_record(rec)

    def _try_adopt(self, job, slices: list[dict]) -> _Run | None:
        """The job's running group as a `_Run`, or None after stopping whatever is left of it."""
        workers, pg = [], None
        if job.state in (JobState.STARTING, JobState.RUNNING) and len(slices) == 1 and slices[0]["provider"] == "local":
            rec = slices[0]
            t = catalog.lookup(rec["accelerator"])
            try:
                workers = [ray.get_actor(_worker_name(rec["name"], job.generation, i), namespace=cluster.NAMESPACE)
                           for i in range(t.hosts)]
                pg = ray.util.get_placement_group(_pg_name(rec["name"], job.generation))
                # Right after a restart Ray may answer "temporarily unavailable" while it resolves the actors.
                probe = tenacity.Retrying(
                    stop=tenacity.stop_after_delay(30), wait=tenacity.wait_fixed(1), reraise=True,
                    retry=tenacity.retry_if_exception_type(ray.exceptions.ActorUnavailableError))
                probe(lambda: ray.get([w.info.remote() for w in workers], timeout=30))
                history = probe(lambda: ray.get(workers[0].history.remote(), timeout=30))
            except Exception as e:  # some part is gone: relaunch
                log.warning("job %s: cannot adopt generation %d (%s)", job.id, job.generation, e)
            else:
                s = Slice(rec["name"], job.id, t, catalog.Tier(rec["tier"]), None, SliceState.READY,
                          tuple(Host(i, r) for i, r in enumerate(rec["data"]["hosts"])), "local")
                self.provider.adopt(s, rec["data"]["pgids"])
                missed = self._record_missed(job.id, job.generation, history)
                self.store.add_event(job.id, "adopted", f"the controller restarted and adopted the running "
                                     f"generation {job.generation} ({missed} missed steps recorded)")
                return _Run(generation=job.generation, provider=self.provider, slice=s, workers=workers, pg=pg,
                            started=True, adopted=True, accepting=True,
                            last_step=max((h["step"] for h in history), default=-1))
        for w in workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception:
                pass
        if pg is not None:
            remove_placement_group(pg)
        for rec in slices:
            self._release_record(rec)
        return None

    def _release_record(self, rec: dict) -> None:
        release_recorded(self.home, self.store, rec)
        if rec["provider"] == "gcp":  # delete the cloud resources, not only our record of them
            try:
                self._provider_for(self._spec(rec["job_id"])).release(rec["name"])
            except Exception:  # `orchestrator gc` finds it later; say so now
                log.exception("could not release gcp slice %s; run `orchestrator gc`", rec["name"])


def _worker_name(slice_name: str, generation: int, rank: int) -> str:
    return f"{slice_name}-g{generation}-w{rank}"


def _pg_name(slice_name: str, generation: int) -> str:
    return f"{slice_name}-g{generation}"


def _workload(raw_spec: dict, spec: JobSpec, devices: int, hosts: int) -> dict:
    w = spec.workload
    ckpt = raw_spec["checkpoint"]["directory"]
    common = {"fence_file": f"{ckpt}/.fence", "metadata_url": spec.recovery.metadata_url}
    if isinstance(w, EntrypointWorkload):
        return {"type": "entrypoint", "entrypoint": w.entrypoint, "args": w.args, "checkpoint_dir": ckpt,
                "workdir": raw_spec.get("_workdir"), **common}
    assert isinstance(w, LmWorkload)
    m = w.model
    plan = plan_mesh(num_devices=devices, num_hosts=hosts, wishes=w.mesh.model_dump(),
                     dims=ModelDims(m.d_model, m.n_heads, m.kv_heads, m.d_ff, m.vocab_size),
                     global_batch_size=w.global_batch_size)
    cfg = TrainConfig(
        model=ModelShape(m.d_model, m.n_layers, m.n_heads, m.kv_heads, m.d_ff, m.vocab_size,
                         moe_experts=m.moe_experts, moe_top_k=m.moe_top_k, scan_layer=m.scan_layer),
        seq_len=w.seq_len, global_batch_size=w.global_batch_size, steps=w.steps, seed=w.seed,
        lr_peak=w.learning_rate.peak, lr_end=w.learning_rate.end, warmup_steps=w.learning_rate.warmup_steps,
        weight_decay=w.learning_rate.weight_decay, mesh_shape=plan.shape, checkpoint_dir=ckpt,
        checkpoint_interval=spec.checkpoint.interval_steps, checkpoint_keep=spec.checkpoint.keep,
        implementation=w.kernels)
    return {"type": "lm", "config": cfg.to_dict(), **common}


def _log_to(path: Path) -> None:
    root = logging.getLogger()
    if any(getattr(h, "_orchestrator", False) for h in root.handlers):
        return
    h = logging.FileHandler(path)
    h._orchestrator = True
    h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(h)
    root.setLevel(logging.INFO)
