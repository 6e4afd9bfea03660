"""One driver per job: a thread that runs attempts until one ends the job.

Its loop reads plainly: wait for a turn in the queue, provision a slice, launch the
workers, watch them until the attempt ends with a typed outcome, tear down, and ask
`policies.decisions.recovery.after` what comes next (recover, resize, succeed, fail, cancel).
Workers' reports reach the driver through the controller (`report`). A move the cost
policy asks for is made before break (`orchestrator.control.moves`): the next attempt
starts on a slice that became READY while the last one trained.

A store that cannot be written does not stop the driver (`orchestrator.control.store_faults`):
its own writes wait until the store takes them, and what its workers report is held and
written in order once it does; meanwhile the workers train on.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import tenacity

from orchestrator.control.attempt import Attempt
from orchestrator.control.autoscaler import with_checkpoint_interval
from orchestrator.control.captures import Captures
from orchestrator.control.compile_ahead import ProgramsAhead
from orchestrator.control.group import RayWorkerGroup, WorkerGroup
from orchestrator.control.launch import write_fence
from orchestrator.control.limits import Limits
from orchestrator.control.memory import drop_keepers
from orchestrator.control.moves import AutoscalingMixin
from orchestrator.control.reports import ReportsMixin
from orchestrator.control.slices import SlicesMixin
from orchestrator.control.store_faults import HoldingStore
from orchestrator.control.waiting import Look, Waiting, clock_for, look, release, request
from orchestrator.control.watch import watch
from orchestrator.domain.spec import JobSpec
from orchestrator.errors import IllegalTransitionError, ProvisioningError
from orchestrator.providers.base import CapacityError, Slice
from orchestrator.providers.capacity import TraceClock
from orchestrator.state.events import (
    Disrupted,
    EventKind,
    StateChange,
)
from orchestrator.state.states import FailedBecause, JobState, SliceState
from orchestrator.state.store import Store
from policies.decisions.recovery import Budgets, Next, Outcome, OutcomeKind, after

if TYPE_CHECKING:
    from orchestrator.control.controller import Controller

log = logging.getLogger(__name__)

# How a job that fails after an attempt ended one way is named (FAILED_SETUP, FAILED_BUDGET, ...).
FAILED_BECAUSE: dict[OutcomeKind, FailedBecause] = {
    OutcomeKind.IMPORT_ERROR: FailedBecause.SETUP,
    OutcomeKind.PLATFORM_FAILED: FailedBecause.SETUP,
    OutcomeKind.APP_FAILED: FailedBecause.USER_CODE,
    OutcomeKind.HUNG: FailedBecause.USER_CODE,
    OutcomeKind.USER_EXIT: FailedBecause.USER_EXIT,
    OutcomeKind.STORAGE_FAILED: FailedBecause.STORAGE,
    OutcomeKind.FOLDER_TAKEN: FailedBecause.STORAGE,
    OutcomeKind.PROVISION_FAILED: FailedBecause.NO_RESOURCE,
    OutcomeKind.PREEMPTED: FailedBecause.PREEMPTIONS,
    OutcomeKind.INFRA_LOST: FailedBecause.PREEMPTIONS,
    OutcomeKind.WORKER_ABORTED: FailedBecause.WORKER_ABORTS,
    OutcomeKind.BUDGET_SPENT: FailedBecause.BUDGET,
}


def ray_group(driver: JobDriver, spec: JobSpec) -> WorkerGroup:
    """The real group: one `HostWorker` actor per host of the attempt's slice."""
    return RayWorkerGroup(driver.store, driver.plane.home, driver.job_id, spec, driver.att)


class JobDriver(AutoscalingMixin, SlicesMixin, ReportsMixin):
    """The job's state machine: each attempt goes QUEUED/PROVISIONING -> STARTING -> RUNNING and ends with an
    `Outcome`, from which `policies.decisions.recovery.after` names the next state. A transition the store
    refuses is a bug of ours: it ends the driver's loop loudly (the job FAILED_CONTROLLER), never silently."""

    def __init__(self, plane: "Controller", job_id: str, attempt: Attempt | None = None, *,
                 groups: Callable[[JobDriver, JobSpec], WorkerGroup] = ray_group):
        self.plane, self.job_id, self.groups = plane, job_id, groups
        # The store as the driver writes it: a write waits out a store fault (it reads and writes as a Store).
        self.store = cast(Store, HoldingStore(plane.store, plane.store_health, plane.held))
        self.att = attempt or Attempt()
        self._rng = random.Random()
        self._log_failed_at = -1e9
        self.captures = Captures(self.store, job_id)  # `orchestrator profile`
        self.limits = Limits(self.store, job_id)  # budget_usd and deadline
        self.programs = ProgramsAhead(plane.home, job_id, self.store)  # the step for the next shapes, off the hosts

    def start(self, on_exit) -> None:
        threading.Thread(target=self._main, args=(on_exit,), name=f"job-{self.job_id}", daemon=True).start()

    def spec(self) -> JobSpec:
        return self.store.job(self.job_id).spec

    # -- the loop ---------------------------------------------------------------------

    def _main(self, on_exit) -> None:
        att = self.att
        try:
            if att.adopted:  # a group started by the previous controller: watch it to its end first
                try:
                    outcome = watch(self.store, self.job_id, self.spec(), att, on_poll=self._on_poll)
                    self.catch_up(outcome)
                finally:
                    att.teardown()
                self._after(outcome)
            elif (finished := self._finished_at_submit()) is not None:  # nothing to provision, nothing to restore
                steps, why = finished
                self.store.update_job(self.job_id, result={"steps": steps})
                self.transition(JobState.SUCCEEDED, why)
            while not self.store.job(self.job_id).state.terminal:
                self._after(self._attempt())
        except Exception as e:  # a bug of ours: end the job visibly rather than leave it hanging
            log.exception("job %s: controller error", self.job_id)
            att.teardown()
            try:
                self.transition(JobState.FAILED, f"controller error: {type(e).__name__}: {e}",
                                cause=FailedBecause.CONTROLLER)
            except IllegalTransitionError:  # it ended meanwhile (its state says how)
                log.exception("job %s: could not record the controller error", self.job_id)
        finally:
            self._release_requests("the job is over")
            on_exit(self.job_id)

    def _release_requests(self, why: str) -> None:
        """Give back a request waiting beside the slice, and a slice READY for a switch not made."""
        att = self.att
        for s in [att.next_slice, *att.next_others]:
            if s is not None:
                drop_keepers(s)
        self._drop_request(why)

    def _attempt(self) -> Outcome:
        att, job_id = self.att, self.job_id
        refused, refusals, queued_since = None, 0, None
        t0 = time.monotonic()
        while att.next_slice is None:  # until a slice is ready: a request refused for capacity goes back to the queue
            job = self.store.job(job_id)
            spec = self.spec()
            if job.cancel_requested or att.cancel.is_set():
                return Outcome(OutcomeKind.CANCELLED, "cancelled by the user")
            if spec.autoscaling is not None:
                spec = self._autoscale_before_provisioning(spec)
            if (spent := self.limits.before_start(spec)) is not None:
                return spent
            ended = self.plane.queue.wait_turn(job_id, spec, att.cancel, refused=refused, refusals=refusals,
                                               since=queued_since, limit_s=self._user_queue_limit_s(spec))
            if ended is not None:
                return ended
            self.transition(JobState.PROVISIONING, f"requesting {spec.accelerator} ({spec.tier.value})")
            t0 = time.monotonic()
            att.provider = self.plane.provider_for(spec)
            try:
                self._provision_all(spec, job.generation + 1, refusals)
            except CapacityError as e:  # waiting never spends max_failures
                refused, refusals = str(e), refusals + 1
                queued_since = queued_since or t0
                if spec.autoscaling is not None:  # a capacity fact for the policy, which is asked again at once
                    refused = None
            except ProvisioningError as e:
                return Outcome(OutcomeKind.PROVISION_FAILED, str(e), transient=e.transient)
        att.slice, att.next_slice, att.others, att.next_others = att.next_slice, None, att.next_others, []
        provision_s, overlap = time.monotonic() - t0, ""
        spec = self._on_slice(att.slice)
        if att.shrunk_from is not None:  # the survivors of a lost slice go on, from their memory if they can
            n = len(att.slices)
            from_where = (f"restoring step {att.memory_step} from their memory" if att.memory_step is not None
                          else "restoring from storage")
            self.transition(JobState.PROVISIONING, f"going on on the {n} surviving slice{'s' if n > 1 else ''} "
                            f"of {att.shrunk_from} ({', '.join(s.name for s in att.slices)}), {from_where}")
            provision_s, att.shrunk_from = 0.0, None
        elif att.next_ready_at is not None:  # a move made before break: the new slice waited beside the old one
            provision_s = att.next_provision_s
            overlap = f"; it overlapped the old slice for {time.time() - att.next_ready_at:.1f} s"
            self.transition(JobState.PROVISIONING, f"slice {att.slice.name} ({spec.accelerator} {spec.tier.value}), "
                            "requested beside the old one, is ready")
        try:
            if att.cancel.is_set():
                return Outcome(OutcomeKind.CANCELLED, "cancelled by the user")
            att.begin(self.store.bump_generation(job_id))
            self.limits.new_attempt()
            att.next_decision = time.monotonic() + 30.0 / self._clock(spec).scale  # let it measure its speed first
            write_fence(spec, att.generation, job_id)
            self.transition(JobState.STARTING, f"slice {att.slice.name} ready after {provision_s:.1f} s{overlap}; "
                            f"starting generation {att.generation}",
                            data=StateChange(provision_s=round(provision_s, 3), slice=att.slice.name,
                                             overlap_s=(round(time.time() - att.next_ready_at, 3)
                                                        if att.next_ready_at is not None else None)))
            att.next_ready_at = None
            att.group = self.groups(self, spec)
            failed = att.group.launch()
            att.memory_step = None
            if failed is not None:
                return failed
            att.last_progress = time.monotonic()
            outcome = watch(self.store, job_id, spec, att, on_poll=self._on_poll)
            self.catch_up(outcome)
            self._keep_survivors(outcome, spec)
            return outcome
        finally:
            att.teardown()

    def _on_slice(self, s: Slice) -> JobSpec:
        """The spec the launch on `s` uses: the stored one, moved to `s`'s type and tier if it differs
        (and for an autoscaled job, to the count of slices it goes on: the policy's, or the survivors')."""
        job = self.store.job(self.job_id)
        count = len(self.att.slices) if job.spec.autoscaling is not None else job.spec.slices
        if (s.tpu_type.name, s.tier, count) != (job.spec.accelerator, job.spec.tier, job.spec.slices):
            self.store.update_spec(self.job_id, job.spec.moved(s.tpu_type.name, s.tier.value, slices=count))
        spec = self.spec()
        return with_checkpoint_interval(spec, self._choice) if self._choice is not None else spec

    def _on_poll(self) -> None:
        """Once a poll of a running attempt: the budget and deadline, then the autoscaler."""
        self.limits.check(self.att, self.spec)
        self._autoscale_while_running()
        self._regrow()
        self.programs.poll(self.spec, self.att)

    def _after(self, outcome: Outcome) -> None:
        """Record how the attempt ended, and do what the recovery rules say comes next."""
        att, job = self.att, self.store.job(self.job_id)
        outcome = self.limits.outcome(outcome)
        self.captures.attempt_ended(att.generation, outcome.reason)
        k = outcome.kind
        if k is OutcomeKind.SUCCEEDED and (finished := self._finished_before()) is not None:
            outcome = dataclasses.replace(outcome, reason=finished)
        if k not in (OutcomeKind.SUCCEEDED, OutcomeKind.CANCELLED, OutcomeKind.PROVISION_FAILED, OutcomeKind.RESIZED,
                     OutcomeKind.BUDGET_SPENT):
            steps_done = max(att.last_step + 1, att.restored_step or 0)  # a generation lost before its first step
            att.disrupted_at, att.disrupted_step, att.resumed = outcome.at, steps_done, False  # stood where it began
            self.store.add_event(self.job_id, Disrupted(k.value, steps_done - 1, outcome.reason, att.generation,
                                                        time.time() - outcome.at),
                                 f"{k.value}: {outcome.reason} (after step {steps_done})", at=outcome.at)
        rec = job.spec.recovery
        aborts = self.aborts() - (k is OutcomeKind.WORKER_ABORTED)  # the disruption just recorded is this one
        d = after(outcome, preemptions=job.preemptions, failures=job.failures, aborts=aborts,
                  budgets=Budgets(rec.max_preemptions, rec.max_failures, rec.max_aborts),
                  jitter=self._rng.random())
        if d.preemptions != job.preemptions:
            self.store.update_job(self.job_id, preemptions=d.preemptions)
        if d.failures != job.failures or d.aborts != aborts:  # the job's error: a traceback, or a native one
            self.store.update_job(self.job_id, failures=d.failures, error=outcome.traceback or outcome.reason)
        if d.next is Next.SUCCEED:
            self.transition(JobState.SUCCEEDED, d.reason)
        elif d.next is Next.CANCEL:
            self.transition(JobState.CANCELLED, d.reason)
        elif d.next is Next.FAIL:
            self.transition(JobState.FAILED, d.reason, cause=FAILED_BECAUSE.get(k))
        elif d.next is Next.RESIZE:
            assert att.resize_to is not None, "a resize names its accelerator (JobDriver.resize, the moves)"
            self.store.update_spec(self.job_id, job.spec.moved(att.resize_to, att.resize_tier or job.spec.tier.value))
            self.transition(JobState.RESIZING, d.reason, data=StateChange(to=att.resize_to))
            att.resize_to, att.disrupted_step = None, att.last_step + 1
            att.disrupted_at, att.resumed = time.time(), False
        else:
            self.transition(JobState.RECOVERING, d.reason, data=StateChange(outcome=k.value))
            att.cancel.wait(d.backoff_s)

    def _finished_at_submit(self) -> tuple[int, str] | None:
        """(its last step, why) for a new job that resumed its folder as the same run and found that run's last
        step committed there already (`ownership`'s claim at submit lists the folder's committed steps)."""
        total = self.spec().workload.steps
        if total is None or self.store.last_step(self.job_id) is not None or self.store.job(self.job_id).generation:
            return None
        claimed = next((e.data for e in self.store.events(self.job_id) if e.kind is EventKind.FOLDER), None) or {}
        last = claimed.get("last_step")
        if claimed.get("action") not in ("resume", "resume-anyway") or last is None or last < total:
            return None
        return last, self._nothing_to_train(last, total)

    def _nothing_to_train(self, committed: int, total: int) -> str:
        where = self.spec().checkpoint.directory
        if committed == total:
            return (f"resumed a finished run: step {total} of {total} was already committed in {where}; nothing to "
                    "train (to train again from step 0, submit with --fresh)")
        return (f"resumed a finished run: the checkpoints in {where} reach step {committed}, past this job's {total} "
                "steps; nothing to train (to train again from step 0, submit with --fresh)")

    def _finished_before(self) -> str | None:
        """Why a job that succeeded trained no step of its own: its folder held a run that had already finished."""
        job = self.store.job(self.job_id)
        committed, total = (job.result or {}).get("steps"), self.spec().workload.steps
        if self.store.last_step(self.job_id) is not None or committed is None or total is None or committed < total:
            return None
        return self._nothing_to_train(committed, total)

    def lost_with_the_cluster(self, generation: int) -> None:
        """The job's workers went with the whole cluster (the restarted controller found none to adopt):
        a host loss like any other. It is recorded and counted, and the steps after the last committed
        checkpoint are counted as lost work when the job restores."""
        last = self.store.last_step(self.job_id)
        self.att.generation, self.att.last_step = generation, last.step if last else -1
        self._after(Outcome(OutcomeKind.INFRA_LOST, "the cluster went down while the job ran; the restarted "
                                                    "controller found none of its workers",
                            at=last.at if last else time.time()))  # its last sign of life

    def aborts(self) -> int:
        """Worker aborts so far (they spend `max_aborts`; counted from the job's disruption events)."""
        return sum(1 for e in self.store.events(self.job_id)
                   if e.kind is EventKind.DISRUPTION and (e.data or {}).get("kind") == OutcomeKind.WORKER_ABORTED.value)

    def _provision(self, spec: JobSpec, attempt: int, *, round_: int = 0) -> Slice:
        """A ready slice, asking again (with backoff and jitter) while the failure is transient.

        A refusal for capacity is not retried here: the queue (and for autoscaled jobs the
        policy) decides what to ask for next. `round_` counts those refusals, so every
        request has a name of its own. A request still waiting from a move that the policy
        wants again is waited on rather than asked for anew.
        """
        provider = self.att.chosen_provider
        stem = f"{self.job_id}-{attempt}" + (f"q{round_}" if round_ else "")
        asked = self.att.waiting.name if self.att.waiting is not None else None
        names = iter(n for n in (f"{stem}{suffix}" for suffix in ["", "b", "c", "d"]) if n != asked)
        key = (spec.accelerator, spec.tier.value, spec.slices)

        def once() -> Slice:
            att = self.att
            if att.waiting is not None and att.waiting.key != key:
                self._drop_request("the policy asks for another slice")
            if att.waiting is None:
                att.waiting = dataclasses.replace(
                    request(provider, self.job_id, next(names), spec, spec.accelerator, spec.tier.value,
                            created_at=self.store.job(self.job_id).created_at, limit_s=self._queue_limit_s(spec)),
                    count=spec.slices)
            try:
                return self._wait_for(att.waiting, spec)
            finally:
                att.waiting = None  # ready (the attempt's slice now), or released

        retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(3), wait=tenacity.wait_exponential_jitter(initial=1, max=20),
            retry=tenacity.retry_if_exception(
                lambda e: isinstance(e, ProvisioningError) and e.transient and not isinstance(e, CapacityError)),
            reraise=True)
        return retrying(once)

    def _wait_for(self, w: Waiting, spec: JobSpec) -> Slice:
        """Poll the request until READY; the job is QUEUED while it waits for capacity, and says so.

        Raises CapacityError when it is refused or expires (released, unbilled), and
        ProvisioningError when its hosts do not all start within `start_timeout_s`.
        """
        att, poll = self.att, spec.provider_facts.poll_interval_s
        started = time.monotonic()
        while True:
            if att.cancel.is_set() or self.store.job(self.job_id).cancel_requested:
                release(att.chosen_provider, w.name, "cancelled")
                raise CapacityError("cancelled while waiting for the slice", slice_name=w.name)
            kind, s, why = look(att.chosen_provider, w)
            if kind is Look.REFUSED:
                raise CapacityError(why, slice_name=w.name)
            assert s is not None, "a request not refused has its slice"
            if kind is Look.READY:
                if self.store.job(self.job_id).state is JobState.QUEUED:  # capacity came and hosts joined between looks
                    self.transition(JobState.PROVISIONING, f"capacity came for slice {w.name}; its hosts joined")
                return s
            if not self._still_wanted(spec):
                release(att.chosen_provider, w.name, "the policy no longer wants it")
                raise CapacityError(f"the policy no longer wants {w.accelerator} {w.tier}", slice_name=w.name)
            job = self.store.job(self.job_id)
            if s.state in (SliceState.REQUESTED, SliceState.WAITING):
                started = time.monotonic()  # the start timeout counts from when capacity came
                if s.state is SliceState.WAITING and job.state is JobState.PROVISIONING:
                    limit = "while the policy wants it" if w.limit_s is None else f"up to {w.limit_s:.0f} s"
                    self.transition(JobState.QUEUED, f"waiting for capacity: {w.accelerator} {w.tier} ({limit})",
                                    data=StateChange(outcome="no_capacity", slice=w.name))
            elif job.state is JobState.QUEUED:
                self.transition(JobState.PROVISIONING, f"capacity came for slice {w.name}; starting its hosts")
            if time.monotonic() - started > spec.recovery.start_timeout_s:
                release(att.chosen_provider, w.name, "its hosts did not join in time")
                raise ProvisioningError(f"slice {w.name}: its hosts did not all join the cluster within "
                                        f"{spec.recovery.start_timeout_s:.0f} s", slice_name=w.name, transient=True)
            att.cancel.wait(poll)

    def _clock(self, spec: JobSpec) -> TraceClock:
        return clock_for(spec, self.store.job(self.job_id).created_at)

    def _user_queue_limit_s(self, spec: JobSpec) -> float | None:
        """The spec's `queue_timeout` on the job's clock (wall seconds), or None: no limit."""
        return self._clock(spec).wall_seconds(spec.queue_timeout.total_seconds()) if spec.queue_timeout else None

    def _queue_limit_s(self, spec: JobSpec) -> float | None:
        """How long (wall seconds) a request may wait for capacity before it expires: an
        autoscaled job's waits while the policy wants it (asked every decision interval);
        any other job's up to its `queue_timeout` (None: no limit)."""
        if spec.autoscaling is not None:
            return None
        return self._user_queue_limit_s(spec)

    def transition(self, target: JobState, reason: str, *, data: StateChange | None = None,
                   cause: FailedBecause | None = None, at: float | None = None) -> None:
        """Move the job to `target`; raises IllegalTransitionError if the store refuses (see the class)."""
        fields: dict[str, Any] = {} if cause is None else {"cause": cause.value}
        self.store.transition(self.job_id, target, reason, data=data, at=at, **fields)

    # -- requests from the controller ---------------------------------------------------

    def cancel(self) -> None:
        self.att.cancel.set()

    def resize(self, accelerator: str, tier: str, reason: str) -> None:
        """Stop at the current step (checkpointed) and go on on `accelerator` `tier`."""
        att = self.att
        att.resize_to, att.resize_tier = accelerator, tier
        att.stop_requested(f"resize to {accelerator}: {reason}")
