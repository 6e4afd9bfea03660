"""Watching a running attempt until it ends, and saying how it ended (`policies.recovery`).

Every poll: the provider's events for the slice (a host gone, a notice, a reclaim), the
workers' results, the user's cancel, the heartbeat. A notice or a cancel asks every host to
stop after the same step with that step's checkpoint committed, within the grace period.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import ray

from orchestrator.control.attempt import Attempt
from orchestrator.providers.base import SliceEventKind
from orchestrator.state.store import Store
from orchestrator.user.spec import JobSpec
from policies.recovery import HUNG, WORKER_DIED, Outcome, OutcomeKind, classify_failure, results_outcome

log = logging.getLogger(__name__)

POLL_S = 0.25
SETTLE_S = 1.0  # how long a failure waits for word that a host died (the others fail within seconds of it)


def watch(store: Store, job_id: str, spec: JobSpec, att: Attempt, *, on_poll: Callable[[], None]) -> Outcome:
    """Block until the attempt ends; `on_poll` runs once a poll (the autoscaler's chance to move the job)."""
    hang_limit, grace = spec.recovery.heartbeat_timeout_s, spec.recovery.grace_period_s
    stop_sent = False
    while True:
        if (ended := _provider_says(att)) is not None:
            return ended
        try:
            results = ray.get([w.result.remote() for w in att.workers], timeout=0.5)
        except ray.exceptions.RayActorError as e:
            return Outcome(OutcomeKind.INFRA_LOST, f"{WORKER_DIED} ({type(e).__name__})")
        except ray.exceptions.GetTimeoutError:
            results = None  # slow to answer; the heartbeat timeout below decides whether it hangs
        if results is not None:
            outcome = results_outcome(results, resizing_to=att.resize_to, notice=att.notice)
            if outcome is not None and outcome.kind is OutcomeKind.APP_FAILED:
                return _confirm_failure(att, outcome)
            if outcome is not None:
                if outcome.kind is OutcomeKind.SUCCEEDED:
                    store.update_job(job_id, result={"steps": results[0].steps, "param_sums": results[0].param_sums})
                return outcome
        if att.cancel.is_set() or store.job(job_id).cancel_requested:
            stop_for_cancel(att, stop_sent, grace)
            return Outcome(OutcomeKind.CANCELLED, "cancelled by the user")
        if att.notice is not None:
            if not stop_sent:  # every host stops after the same step, with a committed checkpoint
                for w in att.workers:
                    w.request_stop.remote(att.notice)
                stop_sent = True
            if time.monotonic() - att.notice_at > grace:
                return Outcome(OutcomeKind.PREEMPTED, f"preemption notice ({att.notice}); no checkpoint within "
                                                      f"the {grace:.0f} s grace window")
        if att.started and time.monotonic() - att.last_progress > hang_limit:
            return Outcome(OutcomeKind.INFRA_LOST, f"no progress for {hang_limit:.0f} s {HUNG}")
        on_poll()
        time.sleep(POLL_S)


def _provider_says(att: Attempt) -> Outcome | None:
    """The provider sees a host go within a poll; a notice only marks the attempt."""
    for ev in att.provider.poll_events(slices=[att.slice.name]):  # other slices' events stay for their own drivers
        if ev.kind is SliceEventKind.PREEMPTION_NOTICE:
            att.stop_requested(ev.reason)
        else:
            kind = OutcomeKind.PREEMPTED if ev.kind is SliceEventKind.RECLAIMED else OutcomeKind.INFRA_LOST
            return Outcome(kind, ev.reason)
    return None


def _confirm_failure(att: Attempt, failure: Outcome) -> Outcome:
    """Gather what `classify_failure` needs: did a host die (waiting up to SETTLE_S for the word), does every worker answer."""
    deadline = time.monotonic() + SETTLE_S
    host_lost = None
    while host_lost is None and time.monotonic() < deadline:
        lost = att.provider.poll_events(slices=[att.slice.name])
        host_lost = lost[0].reason if lost else None
        if host_lost is None:
            time.sleep(0.1)
    unreachable = None
    if host_lost is None:
        try:
            ray.get([w.info.remote() for w in att.workers], timeout=10)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
            unreachable = type(e).__name__
    return classify_failure(failure, host_lost=host_lost, unreachable=unreachable)


def stop_for_cancel(att: Attempt, stop_sent: bool, grace: float) -> None:
    """Stop every host after the same step with that step's checkpoint committed, as a notice would.

    So a cancelled job loses nothing: resubmitted with the same checkpoint directory, it
    goes on from the step it reached. Hosts that do not stop within the grace period are
    killed like any others.
    """
    if not att.started:
        return
    if not stop_sent:
        att.stop_requested("cancelled by the user")  # the hosts' own "notice" reports are this stop
        for w in att.workers:
            w.request_stop.remote("cancelled by the user")
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            if all(ray.get([w.result.remote() for w in att.workers], timeout=1.0)):
                return
        except ray.exceptions.GetTimeoutError:
            pass
        except ray.exceptions.RayActorError:  # a host went meanwhile: nothing more to wait for
            return
        time.sleep(POLL_S)
