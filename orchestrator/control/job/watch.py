"""Watching a running attempt until it ends, and saying how it ended (`policies.decisions.recovery`).

Every poll: the provider's events for the slice (a host gone, a notice, a reclaim), a host
the liveness monitor found silent and unreachable (`orchestrator.control.liveness`), the
workers' results, the user's cancel, the heartbeat. A notice or a cancel asks every host to
stop after the same step with that step's checkpoint committed, within the grace period.

How it ended is asked of those who know before any timeout decides: a worker says how the
job's code failed (`policies.decisions.recovery.failure_cause`); a worker process that died is a host
loss only if its host is gone (the provider says so, its Ray node is dead, or a task cannot
run there), else a worker abort, with what the process last wrote to its stderr; no step
for the heartbeat timeout is a hang only while every worker still answers.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from orchestrator.control.group import PING_S, WorkerGone, WorkerGroup
from orchestrator.control.job.stop import StopRequest, Stops
from orchestrator.domain.spec import JobSpec
from orchestrator.providers.base import SliceEventKind
from orchestrator.state.protocol import JobStore
from policies.decisions.recovery import (
    HUNG,
    WORKER_UNREACHABLE,
    Outcome,
    OutcomeKind,
    classify_failure,
    results_outcome,
)

if TYPE_CHECKING:
    from orchestrator.control.job.placement import Placement
    from orchestrator.control.job.reports import ReportSink

log = logging.getLogger(__name__)

POLL_S = 0.25
# The longest a driver waits between two looks when its group says it can wait (`_wait_s`): its provider's
# events, the stop request's grace, the hang check and `on_poll`'s timers are looked at least this often. The gcp
# provider's zone listing is refreshed at most every `Polling.list_s` (1 s) anyway.
LOOK_S = 1.0
SETTLE_S = 1.0  # how long a failure waits for word that a host died (the others fail within seconds of it)


@dataclass(frozen=True)
class Watched:
    """What watching a launch reads (its group, slices, stop request, the user's cancel, its progress),
    and the two things it may do: mark a slice lost (`Placement.mark_lost`) and ask a stop (`Stops.ask`)."""

    group: WorkerGroup
    placement: Placement
    stops: Stops
    cancelled: threading.Event
    progress: ReportSink
    wake: threading.Event  # set when there is something to look at: a stop asked (a notice, ...), the user's cancel


def watch(store: JobStore, job_id: str, spec: JobSpec, run: Watched, *, on_poll: Callable[[], None]) -> Outcome:
    """Block until the attempt's group ends; `on_poll` runs once a poll (the autoscaler's chance to move the job).
    A multi-slice group that lost slices leaves the others ready to go on (`Placement.keep_survivors`), whether
    this controller launched it or adopted it."""
    outcome = _watch(store, job_id, spec, run, on_poll=on_poll)
    if outcome.kind in (OutcomeKind.INFRA_LOST, OutcomeKind.PREEMPTED):
        expect = run.progress.last_copied_step()
        run.placement.keep_survivors(spec, lambda slices: run.group.held_step(slices, expect))
    return outcome


def _watch(store: JobStore, job_id: str, spec: JobSpec, run: Watched, *, on_poll: Callable[[], None]) -> Outcome:
    group = run.group
    hang_limit, grace = spec.recovery.heartbeat_timeout_s, spec.recovery.grace_period_s
    stop_sent = False
    while True:
        run.wake.clear()  # what sets it from here on wakes the wait below
        if (ended := _provider_says(run)) is not None:
            return ended
        if (ended := group.silent_host()) is not None:  # its beats stopped and its node answers no probe
            return ended
        try:
            results = group.results(timeout_s=0.5)  # None: slow to answer; the heartbeat timeout decides
        except WorkerGone as e:
            return worker_died(store, job_id, run, e)
        if results is not None and (ended := _results_say(store, job_id, run, results)) is not None:
            return ended
        if run.cancelled.is_set() or store.job(job_id).cancel_requested:
            stop_for_cancel(run, stop_sent, grace)
            return Outcome(OutcomeKind.CANCELLED, "cancelled by the user")
        if (stop := run.stops.current) is not None:
            if not stop_sent:  # every host stops after the same step, with a committed checkpoint
                group.request_stop(stop.reason)
                stop_sent = True
            if time.monotonic() - stop.at > grace:
                return Outcome(OutcomeKind.PREEMPTED, f"preemption notice ({stop.reason}); no checkpoint within "
                                                      f"the {grace:.0f} s grace window")
        if run.progress.started and time.monotonic() - run.progress.last_progress > hang_limit:
            return _no_progress(store, job_id, run, hang_limit)
        on_poll()
        if run.progress.last_step_at is not None and (prepare := getattr(group, "prepare_next", None)) is not None:
            prepare()  # the next generation's spare workers (`orchestrator.control.spares`), once it has stepped
        run.wake.wait(_wait_s(group))


def _wait_s(group: WorkerGroup) -> float:
    """How long the loop may wait for a wake before it looks again: POLL_S, unless the group tells when it next
    has something to say (`quiet_s`, seconds) waits that long, at most LOOK_S; a stop asked or a cancel wakes
    the wait at once (`JobDriver.wake`), and so do a Ray group's workers ending or going (`control.ends`) and
    a host its liveness monitor finds lost. A group that does not say (0, or no `quiet_s`: workers of a
    version that cannot wait for their end) is looked at every POLL_S."""
    quiet_s = getattr(group, "quiet_s", None)
    return POLL_S if quiet_s is None else min(LOOK_S, max(POLL_S, quiet_s()))


def _results_say(store: JobStore, job_id: str, run: Watched, results: list) -> Outcome | None:
    """What the hosts' results (some may still be running: None) end the attempt with, if anything yet."""
    stop = run.stops.current
    outcome = results_outcome(results, notice=stop.reason if stop is not None else None,
                              resizing_to=stop.target.accelerator if stop and stop.target else None)
    if outcome is not None and outcome.kind in FAILURES:
        return _confirm_failure(store, job_id, run, outcome)
    if outcome is not None and outcome.kind is OutcomeKind.SUCCEEDED:
        first = results[0]
        assert first is not None, "every host has its result when the job succeeded"
        store.update_job(job_id, result={"steps": first.steps, "param_sums": first.param_sums})
    return outcome


def _provider_says(run: Watched) -> Outcome | None:
    """The provider sees a host go within a poll; a notice only marks the attempt."""
    # Other slices' events stay for their own drivers.
    for ev in run.placement.provider.poll_events(slices=[s.name for s in run.placement.slices]):
        run.placement.mark_lost(ev.slice_name)  # going (a notice) or gone: the others may go on without it
        if ev.kind is SliceEventKind.PREEMPTION_NOTICE:
            run.stops.ask(StopRequest.notice(ev.reason))
        else:
            kind = OutcomeKind.PREEMPTED if ev.kind is SliceEventKind.RECLAIMED else OutcomeKind.INFRA_LOST
            return Outcome(kind, ev.reason)
    return None


FAILURES = (OutcomeKind.APP_FAILED, OutcomeKind.USER_EXIT, OutcomeKind.IMPORT_ERROR, OutcomeKind.STORAGE_FAILED,
            OutcomeKind.PLATFORM_FAILED, OutcomeKind.FOLDER_TAKEN)


def _host_lost(run: Watched) -> str | None:
    """The provider's word that a host of the slice went, waiting up to SETTLE_S for it."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        lost = run.placement.provider.poll_events(slices=[s.name for s in run.placement.slices])
        if lost:
            for e in lost:
                run.placement.mark_lost(e.slice_name)
            return lost[0].reason
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.1)


def _no_progress(store: JobStore, job_id: str, run: Watched, hang_limit: float) -> Outcome:
    """No step for the heartbeat timeout: a host or worker gone if one is, else a hang."""
    at = time.time()
    died, silent = run.group.ping()
    if died is not None:
        return worker_died(store, job_id, run, died)
    if silent:
        return Outcome(OutcomeKind.INFRA_LOST, f"{WORKER_UNREACHABLE} (no answer within {PING_S:.0f} s, and no step "
                                               f"for {hang_limit:.0f} s)", at=at)
    return Outcome(OutcomeKind.HUNG, f"no step for {hang_limit:.0f} s while every worker answers {HUNG}", at=at)


def worker_died(store: JobStore, job_id: str, run: Watched, error: WorkerGone) -> Outcome:
    """A worker's process is gone: its host went (INFRA_LOST), or it died on a host still up (WORKER_ABORTED).

    The host went if the provider says so; then nothing more is asked of it. Otherwise the group
    finds out where the worker ran (`WorkerGroup.died`).
    """
    at = time.time()
    if (lost := _host_lost(run)) is not None:
        return Outcome(OutcomeKind.INFRA_LOST, lost, at=at)
    return run.group.died(error)


def _confirm_failure(store: JobStore, job_id: str, run: Watched, failure: Outcome) -> Outcome:
    """Gather what `classify_failure` needs: did a host die (waiting up to SETTLE_S for the word), does
    every worker answer. A worker whose process died meanwhile is asked about as `worker_died` does."""
    host_lost = _host_lost(run)
    unreachable = None
    if host_lost is None:
        died, silent = run.group.ping()
        if died is not None:
            return worker_died(store, job_id, run, died)
        if silent:
            unreachable = f"host {silent[0]} answered no ping within {PING_S:.0f} s"
    return classify_failure(failure, host_lost=host_lost, unreachable=unreachable)


def stop_for_cancel(run: Watched, stop_sent: bool, grace: float) -> None:
    """Stop every host after the same step with that step's checkpoint committed, as a notice would.

    So a cancelled job loses nothing: resubmitted with the same checkpoint directory, it
    goes on from the step it reached. Hosts that do not stop within the grace period are
    killed like any others.
    """
    if not run.progress.started:
        return
    group: WorkerGroup = run.group
    if not stop_sent:
        run.stops.ask(StopRequest.cancel())  # the hosts' own "notice" reports are this stop
        group.request_stop("cancelled by the user")
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            results = group.results(timeout_s=1.0)
        except WorkerGone:  # a host went meanwhile: nothing more to wait for
            return
        if results is not None and all(results):
            return
        time.sleep(POLL_S)
