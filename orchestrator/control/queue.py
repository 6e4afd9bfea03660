"""The admission queue: jobs wait here, QUEUED, until there are hosts (or capacity) for them.

Local jobs share the machine's hosts and wait in one line (`policies.decisions.admission`: higher
priority first, then the earlier submission; strict, so a large job is not passed over
forever). A cloud job waits for the cloud: after a refusal (no capacity in its zones) it
asks again after a jittered backoff. WaitingJob never spends `recovery.max_failures`; only
`queue_timeout` (from the job file) ends it, as FAILED with the reason. The line is read
from the store, so `status` shows a job's place without asking the controller.
"""

from __future__ import annotations

import logging
import random
import threading
import time

from orchestrator.domain.spec import JobSpec
from orchestrator.errors import IllegalTransitionError
from orchestrator.state.events import StateChange
from orchestrator.state.protocol import JobStore
from orchestrator.state.records import JobRecord
from orchestrator.state.states import JobState
from policies.decisions.admission import WaitingJob, admit, line, retry_after
from policies.decisions.recovery import Outcome, OutcomeKind

log = logging.getLogger(__name__)

POLL_S = 0.5


def _waiting(job: JobRecord) -> WaitingJob:
    return WaitingJob(job.id, job.spec.priority, job.created_at, job.spec.tpu_type.hosts * job.spec.slices)


def queue_position(store: JobStore, job: JobRecord) -> int | None:
    """The job's place in its line (1 = next), or None when it is not QUEUED (or no longer: `job` was read
    before the line, and it may have left it meanwhile, admitted or cancelled)."""
    if job.state is not JobState.QUEUED:
        return None
    return queue_positions(store.jobs(active_only=True)).get(job.id)


def queue_positions(jobs: list[JobRecord]) -> dict[str, int]:
    """Every QUEUED job's place in its line (1 = next), by job id, from one read of the jobs (the dashboard
    shows a page of them: a read of every job for each would make the page quadratic in the jobs)."""
    lines: dict[int, list[WaitingJob]] = {}  # one line per provider (its facts are one object each)
    for j in jobs:
        if j.state is JobState.QUEUED:
            lines.setdefault(id(j.spec.provider_facts), []).append(_waiting(j))
    return {w.job_id: i for same in lines.values() for i, w in enumerate(line(same), 1)}


class AdmissionQueue:
    def __init__(self, store: JobStore, local_provider):
        self.store, self.local = store, local_provider
        self._rng = random.Random()

    def wait_turn(self, job_id: str, spec: JobSpec, cancel: threading.Event, *,
                  refused: str | None = None, refusals: int = 0, since: float | None = None,
                  limit_s: float | None = None) -> Outcome | None:
        """Block until `job_id` may ask for its slice (then None), or return the outcome that
        ends its wait: cancelled, or waited past `queue_timeout`.

        `refused`: the provider just refused the job's request for lack of capacity (the
        `refusals`-th time in a row); the job enters the queue with that as the reason.
        `since`: when its wait for capacity began (monotonic), so the limit counts across
        refusals; `limit_s`: that limit in wall seconds, if not `queue_timeout` itself (a
        job replaying a capacity trace runs on a compressed clock).
        """
        entered = None
        if limit_s is None and spec.queue_timeout:
            limit_s = spec.queue_timeout.total_seconds()
        if refused is not None:
            entered = self._enter(job_id, f"no capacity: {refused}")
            entered = min(entered, since) if since is not None else entered
            if (ended := self._timed_out(limit_s, entered, f"no capacity: {refused}")) is not None:
                return ended
            if not spec.provider_facts.queues_capacity_locally:  # the cloud says when it has room only when asked
                wait = retry_after(refusals, self._rng.random())
                return self._sleep(job_id, cancel, entered, limit_s, wait, f"asking again in {wait:.0f} s")
        while True:
            job = self.store.job(job_id)  # once a poll: its cancel flag, its place, its reason
            if cancel.is_set() or job.cancel_requested:
                return Outcome(OutcomeKind.CANCELLED, "cancelled by the user")
            if not spec.provider_facts.queues_capacity_locally:
                return None  # a cloud job asks the cloud; only a refusal makes it wait
            decision = self._decide(job, spec)
            if decision.admit:
                return None
            if entered is None:
                entered = self._enter(job_id, decision.reason)
            elif job.reason != decision.reason:
                self.store.update_job(job_id, reason=decision.reason)
            if (ended := self._timed_out(limit_s, entered, decision.reason)) is not None:
                return ended
            cancel.wait(POLL_S)

    def _decide(self, job: JobRecord, spec: JobSpec):
        waiting = [_waiting(j) for j in self.store.jobs(active_only=True)
                   if j.state is JobState.QUEUED and j.spec.provider_facts.limited_by_local_hosts and j.id != job.id]
        me = WaitingJob(job.id, spec.priority, job.created_at, spec.tpu_type.hosts * spec.slices)
        total = self.local.max_hosts
        return admit([*waiting, me], job.id, free_hosts=total - self.local.hosts_in_use(), total_hosts=total)

    def _enter(self, job_id: str, reason: str) -> float:
        try:
            self.store.transition(job_id, JobState.QUEUED, reason, data=StateChange(outcome="no_capacity"))
        except IllegalTransitionError:  # QUEUED already (a controller that restarted)
            self.store.update_job(job_id, reason=reason)
        log.info("job %s queued: %s", job_id, reason)
        return time.monotonic()

    def _sleep(self, job_id: str, cancel: threading.Event, entered: float, limit_s: float | None, seconds: float,
               why: str) -> Outcome | None:
        """Wait `seconds` in the queue (a cloud's backoff), still ending on cancel or `queue_timeout`."""
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            if cancel.is_set() or self.store.job(job_id).cancel_requested:
                return Outcome(OutcomeKind.CANCELLED, "cancelled by the user")
            if (ended := self._timed_out(limit_s, entered, why)) is not None:
                return ended
            cancel.wait(min(POLL_S, max(0.0, until - time.monotonic())))
        return None

    @staticmethod
    def _timed_out(limit: float | None, entered: float, reason: str) -> Outcome | None:
        if limit is None or time.monotonic() - entered < limit:
            return None
        return Outcome(OutcomeKind.PROVISION_FAILED, f"waited {limit:.0f} s in the queue (queue_timeout); "
                       f"still {reason}", transient=False)
