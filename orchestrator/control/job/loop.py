"""The job's state machine, one attempt at a time: the driver's thread runs `main`.

An attempt: wait for a turn in the queue, hold READY slices (a provisioning, or what the last
attempt left ready: survivors, a move's or a regrow's slices), launch generation N on them, watch
it to its typed `Outcome`, tear down. `after` records the outcome and does what
`policies.decisions.recovery.after` names: succeed, fail, cancel, recover, or relaunch where the
stop request said (RESIZING).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable

from orchestrator.control.job.driver import JobDriver
from orchestrator.control.job.ending import (
    FAILED_BECAUSE,
    NOT_DISRUPTED,
    finished_at_submit,
    finished_before,
    worker_aborts,
)
from orchestrator.control.job.placement import Held
from orchestrator.control.job.watch import watch
from orchestrator.control.launch import write_fence
from orchestrator.domain.shape import Shape
from orchestrator.domain.spec import JobSpec
from orchestrator.errors import IllegalTransitionError, ProvisioningError
from orchestrator.providers.base import CapacityError, give_up_on
from orchestrator.state.events import Disrupted, StateChange
from orchestrator.state.states import FailedBecause, JobState
from policies.decisions.recovery import Budgets, Next, Outcome, OutcomeKind, after

log = logging.getLogger(__name__)


def start(d: JobDriver, on_exit: Callable[[str], None]) -> None:
    """Run the job's state machine on a thread of its own; `on_exit(job_id)` once the job is over."""
    threading.Thread(target=main, args=(d, on_exit), name=f"job-{d.job_id}", daemon=True).start()


def main(d: JobDriver, on_exit: Callable[[str], None]) -> None:
    give_up_on(d.cancelled)  # a request waiting its turn in the provider (a create pace) ends with a cancel
    try:
        if d.adopted:  # a group started by the previous controller: watch it to its end first
            try:
                outcome = watch(d.store, d.job_id, d.spec(), d.watched(), on_poll=d.on_poll)
                d.progress.catch_up(outcome, d.group)
            finally:
                d.teardown()
            after_attempt(d, outcome)
        elif (finished := finished_at_submit(d.store, d.job_id)) is not None:  # nothing to provision or restore
            steps, why = finished
            d.store.update_job(d.job_id, result={"steps": steps})
            d.transition(JobState.SUCCEEDED, why)
        while not d.store.job(d.job_id).state.terminal:
            after_attempt(d, attempt(d))
    except Exception as e:  # a bug of ours: end the job visibly rather than leave it hanging
        log.exception("job %s: controller error", d.job_id)
        d.teardown()
        try:
            d.transition(JobState.FAILED, f"controller error: {type(e).__name__}: {e}", cause=FailedBecause.CONTROLLER)
        except IllegalTransitionError:  # it ended meanwhile (its state says how)
            log.exception("job %s: could not record the controller error", d.job_id)
    finally:
        d.placement.release_all("the job is over")
        on_exit(d.job_id)


def attempt(d: JobDriver) -> Outcome:
    """One attempt: slices ready (queued, provisioned, or held from before), a launch on them, watched to its end."""
    ended, t0 = _until_ready(d)
    if ended is not None:
        return ended
    held = d.placement.hold_next()
    spec = d.on_slices(held.slices)
    provision_s, overlap = _announce(d, held, spec, time.monotonic() - t0)
    return _launch_and_watch(d, held, spec, provision_s, overlap)


def _until_ready(d: JobDriver) -> tuple[Outcome | None, float]:
    """Queue and provision until slices are ready (a request refused for capacity goes back to the queue), or
    the outcome that ends the attempt first; with when the last request was made."""
    job_id, placement = d.job_id, d.placement
    refused, refusals, queued_since = None, 0, None
    t0 = time.monotonic()
    while not placement.ready:
        job, spec = d.store.job(job_id), d.spec()
        if job.cancel_requested or d.cancelled.is_set():
            return Outcome(OutcomeKind.CANCELLED, "cancelled by the user"), t0
        if spec.autoscaling is not None:
            spec = d.moves.before_provisioning(spec)
        if (spent := d.limits.before_start(spec)) is not None:
            return spent, t0
        ended = d.plane.queue.wait_turn(job_id, spec, d.cancelled, refused=refused, refusals=refusals,
                                        since=queued_since, limit_s=d.user_queue_limit_s(spec))
        if ended is not None:
            return ended, t0
        d.transition(JobState.PROVISIONING, f"requesting {spec.accelerator} ({spec.tier.value})")
        t0 = time.monotonic()
        placement.use(d.plane.provider_for(spec))
        try:
            placement.provision(spec, job.generation + 1, refusals, limit_s=d.queue_limit_s(spec),
                                still_wanted=d.moves.still_wanted)
        except CapacityError as e:  # waiting never spends max_failures
            refused, refusals = str(e), refusals + 1
            queued_since = queued_since or t0
            if spec.autoscaling is not None:  # a capacity fact for the policy, which is asked again at once
                refused = None
        except ProvisioningError as e:
            return Outcome(OutcomeKind.PROVISION_FAILED, str(e), transient=e.transient), t0
    return None, t0


def _announce(d: JobDriver, held: Held, spec: JobSpec, provision_s: float) -> tuple[float, str]:
    """Say where the launch goes when it is not a fresh request's slices; the provisioning time it counts
    (0 for survivors, the request's own for a move made before break) and what overlapped."""
    names = ", ".join(s.name for s in held.slices)
    if held.survived_from is not None:  # the survivors of a lost slice go on, from their memory if they can
        n = len(held.slices)
        from_where = (f"restoring step {held.memory_step} from their memory" if held.memory_step is not None
                      else "restoring from storage")
        d.transition(JobState.PROVISIONING, f"going on on the {n} surviving slice{'s' if n > 1 else ''} "
                     f"of {held.survived_from} slices ({names}), {from_where}")
        return 0.0, ""
    if held.ready_at is not None:  # a move made before break: the new slice waited beside the old one
        d.transition(JobState.PROVISIONING, f"slice {held.slices[0].name} ({spec.accelerator} {spec.tier.value}), "
                     "requested beside the old one, is ready")
        return held.provision_s, f"; it overlapped the old slice for {time.time() - held.ready_at:.1f} s"
    return provision_s, ""


def _launch_and_watch(d: JobDriver, held: Held, spec: JobSpec, provision_s: float, overlap: str) -> Outcome:
    """Launch a generation on `held`, watch it to its outcome, keep the survivors of a loss; torn down after."""
    job_id = d.job_id
    try:
        if d.cancelled.is_set():
            return Outcome(OutcomeKind.CANCELLED, "cancelled by the user")
        launch = d.new_launch(held.slices, spec, held.memory_step)
        write_fence(spec, launch.generation, job_id)
        d.transition(JobState.STARTING, f"slice {launch.first.name} ready after {provision_s:.1f} s{overlap}; "
                     f"starting generation {launch.generation}",
                     data=StateChange(provision_s=round(provision_s, 3), slice=launch.first.name,
                                      overlap_s=(round(time.time() - held.ready_at, 3)
                                                 if held.ready_at is not None else None)))
        group = d.start_group(spec)
        if (failed := group.launch()) is not None:
            return failed
        d.progress.launched()
        outcome = watch(d.store, job_id, spec, d.watched(), on_poll=d.on_poll)
        d.progress.catch_up(outcome, group)  # the survivors of a lost slice were kept by `watch`
        return outcome
    finally:
        d.teardown()


def after_attempt(d: JobDriver, outcome: Outcome) -> None:
    """Record how the attempt ended, and do what the recovery rules say comes next."""
    job, progress = d.store.job(d.job_id), d.progress
    outcome = d.limits.outcome(outcome)
    d.captures.attempt_ended(progress.generation, outcome.reason)
    k = outcome.kind
    if k is OutcomeKind.SUCCEEDED and (finished := finished_before(d.store, d.job_id)) is not None:
        outcome = dataclasses.replace(outcome, reason=finished)
    if k not in NOT_DISRUPTED:
        steps_done = max(progress.last_step + 1, progress.restored_step or 0)  # lost before its first step
        progress.disrupted(progress.stood_since(outcome.at), steps_done)  # "resumed after" counts from the loss
        d.store.add_event(d.job_id, Disrupted(k.value, steps_done - 1, outcome.reason, progress.generation,
                                              time.time() - outcome.at),
                          f"{k.value}: {outcome.reason} (after step {steps_done})", at=outcome.at)
    rec = job.spec.recovery
    aborts = worker_aborts(d.store, d.job_id) - (k is OutcomeKind.WORKER_ABORTED)  # the one just recorded is this
    decided = after(outcome, preemptions=job.preemptions, failures=job.failures, aborts=aborts,
                    budgets=Budgets(rec.max_preemptions, rec.max_failures, rec.max_aborts), jitter=d.rng.random())
    if decided.preemptions != job.preemptions:
        d.store.update_job(d.job_id, preemptions=decided.preemptions)
    if decided.failures != job.failures or decided.aborts != aborts:  # the job's error: a traceback, or a native one
        d.store.update_job(d.job_id, failures=decided.failures, error=outcome.traceback or outcome.reason)
    if decided.next is Next.SUCCEED:
        d.transition(JobState.SUCCEEDED, decided.reason)
    elif decided.next is Next.CANCEL:
        d.transition(JobState.CANCELLED, decided.reason)
    elif decided.next is Next.FAIL:
        d.transition(JobState.FAILED, decided.reason, cause=FAILED_BECAUSE.get(k))
    elif decided.next is Next.RESIZE:
        stop = d.stops.current
        assert stop is not None and stop.target is not None, "a relaunch names its shape (the stop request)"
        d.store.place(d.job_id, Shape(stop.target.accelerator, stop.target.tier, job.shape.count))
        d.transition(JobState.RESIZING, decided.reason, data=StateChange(to=stop.target.accelerator))
        progress.disrupted(time.time(), progress.last_step + 1)
    else:
        d.transition(JobState.RECOVERING, decided.reason, data=StateChange(outcome=k.value))
        d.cancelled.wait(decided.backoff_s)


def lost_with_the_cluster(d: JobDriver, generation: int) -> None:
    """The job's workers went with the whole cluster (the restarted controller found none to adopt):
    a host loss like any other. It is recorded and counted, and the steps after the last committed
    checkpoint are counted as lost work when the job restores."""
    last = d.store.last_step(d.job_id)
    d.progress.lost_with_the_cluster(generation, last.step if last else -1)
    after_attempt(d, Outcome(OutcomeKind.INFRA_LOST, "the cluster went down while the job ran; the restarted "
                                                     "controller found none of its workers",
                             at=last.at if last else time.time()))  # its last sign of life
