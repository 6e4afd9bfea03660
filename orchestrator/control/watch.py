"""Watching a running attempt until it ends, and saying how it ended (`policies.decisions.recovery`).

Every poll: the provider's events for the slice (a host gone, a notice, a reclaim), the
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
import time
from collections.abc import Callable
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from orchestrator.cluster.home import Home
from orchestrator.control.attempt import Attempt
from orchestrator.domain.spec import JobSpec
from orchestrator.providers.base import SliceEventKind
from orchestrator.state.events import EventKind
from orchestrator.state.store import Store
from policies.decisions.recovery import (
    HUNG,
    WORKER_DIED,
    WORKER_UNREACHABLE,
    Outcome,
    OutcomeKind,
    classify_failure,
    native_error,
    results_outcome,
    telling_lines,
)
from workers.crash import stderr_tail
from workers.protocol import WorkerResult

log = logging.getLogger(__name__)

POLL_S = 0.25
SETTLE_S = 1.0  # how long a failure waits for word that a host died (the others fail within seconds of it)
PROBE_S = 30.0  # how long a dead worker's host has to run a task (the answer that it is up, and the stderr)
PING_S = 30.0  # how long workers have to answer a ping, or to be seen dead (a process that aborts takes a while to go)


def watch(store: Store, job_id: str, spec: JobSpec, att: Attempt, *, on_poll: Callable[[], None]) -> Outcome:
    """Block until the attempt ends; `on_poll` runs once a poll (the autoscaler's chance to move the job)."""
    hang_limit, grace = spec.recovery.heartbeat_timeout_s, spec.recovery.grace_period_s
    stop_sent = False
    while True:
        if (ended := _provider_says(att)) is not None:
            return ended
        try:
            results: list[WorkerResult | None] | None = ray.get([w.result.remote() for w in att.workers], timeout=0.5)
        except ray.exceptions.RayActorError as e:
            return worker_died(store, job_id, att, e)
        except ray.exceptions.GetTimeoutError:
            results = None  # slow to answer; the heartbeat timeout below decides whether it hangs
        if results is not None:
            outcome = results_outcome(results, resizing_to=att.resize_to, notice=att.notice)
            if outcome is not None and outcome.kind in FAILURES:
                return _confirm_failure(store, job_id, att, outcome)
            if outcome is not None:
                if outcome.kind is OutcomeKind.SUCCEEDED:
                    first = results[0]
                    assert first is not None, "every host has its result when the job succeeded"
                    store.update_job(job_id, result={"steps": first.steps, "param_sums": first.param_sums})
                return outcome
        if att.cancel.is_set() or store.job(job_id).cancel_requested:
            stop_for_cancel(att, stop_sent, grace)
            return Outcome(OutcomeKind.CANCELLED, "cancelled by the user")
        if att.notice is not None:
            if not stop_sent:  # every host stops after the same step, with a committed checkpoint
                for w in att.workers:
                    w.request_stop.remote(att.notice)
                stop_sent = True
            assert att.notice_at is not None, "set with the notice (Attempt.stop_requested)"
            if time.monotonic() - att.notice_at > grace:
                return Outcome(OutcomeKind.PREEMPTED, f"preemption notice ({att.notice}); no checkpoint within "
                                                      f"the {grace:.0f} s grace window")
        if att.started and time.monotonic() - att.last_progress > hang_limit:
            return _no_progress(store, job_id, att, hang_limit)
        on_poll()
        time.sleep(POLL_S)


def _provider_says(att: Attempt) -> Outcome | None:
    """The provider sees a host go within a poll; a notice only marks the attempt."""
    # Other slices' events stay for their own drivers.
    for ev in att.chosen_provider.poll_events(slices=[att.held_slice.name]):
        if ev.kind is SliceEventKind.PREEMPTION_NOTICE:
            att.stop_requested(ev.reason)
        else:
            kind = OutcomeKind.PREEMPTED if ev.kind is SliceEventKind.RECLAIMED else OutcomeKind.INFRA_LOST
            return Outcome(kind, ev.reason)
    return None


FAILURES = (OutcomeKind.APP_FAILED, OutcomeKind.USER_EXIT, OutcomeKind.IMPORT_ERROR, OutcomeKind.STORAGE_FAILED)


def _host_lost(att: Attempt) -> str | None:
    """The provider's word that a host of the slice went, waiting up to SETTLE_S for it."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        lost = att.chosen_provider.poll_events(slices=[att.held_slice.name])
        if lost:
            return lost[0].reason
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.1)


def _no_progress(store: Store, job_id: str, att: Attempt, hang_limit: float) -> Outcome:
    """No step for the heartbeat timeout: a host or worker gone if one is, else a hang."""
    at = time.time()
    died, silent = _ping(att)
    if died is not None:
        return worker_died(store, job_id, att, died)
    if silent:
        return Outcome(OutcomeKind.INFRA_LOST, f"{WORKER_UNREACHABLE} (no answer within {PING_S:.0f} s, and no step "
                                               f"for {hang_limit:.0f} s)", at=at)
    return Outcome(OutcomeKind.HUNG, f"no step for {hang_limit:.0f} s while every worker answers {HUNG}", at=at)


def worker_died(store: Store, job_id: str, att: Attempt, error: Exception) -> Outcome:
    """A worker's process is gone: its host went (INFRA_LOST), or it died on a host still up (WORKER_ABORTED).

    The host went if the provider says so, or its Ray node is dead, or a task cannot run
    there; then nothing more is asked of it. Otherwise its stderr's end is the native error:
    in the outcome's reason (one line) and traceback, and in the job's log.
    """
    at = time.time()
    if (lost := _host_lost(att)) is not None:
        return Outcome(OutcomeKind.INFRA_LOST, lost, at=at)
    placed = _placed(store, job_id, att)
    dead = [rank for rank, w in enumerate(att.workers) if not _answers(w)]
    alive_nodes = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    for rank in dead:
        if rank >= len(placed):
            break
        node, pid = placed[rank]
        if node not in alive_nodes:
            return Outcome(OutcomeKind.INFRA_LOST, f"host {rank} is gone (its Ray node {node[:12]} is dead)", at=at)
        try:
            tail = ray.get(ray.remote(num_cpus=0, max_retries=0)(stderr_tail).options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(pid), timeout=PROBE_S)
        except Exception as e:  # the host cannot run a task: it is as good as gone
            return Outcome(OutcomeKind.INFRA_LOST, f"{WORKER_UNREACHABLE} (host {rank} runs no task: "
                                                   f"{type(e).__name__})", at=at)
        said = telling_lines(tail or "")
        summary = native_error(tail) if tail is not None else "its stderr is not in its node's log folder"
        _log_lines(store, job_id, rank, [f"its worker process died: {summary}", *said])
        return Outcome(OutcomeKind.WORKER_ABORTED, f"host {rank}'s worker process died, its host still up: {summary}",
                       traceback="\n".join(said) or None, at=at)
    return Outcome(OutcomeKind.INFRA_LOST, f"{WORKER_DIED} ({type(error).__name__})", at=at)


def _ping(att: Attempt) -> tuple[Exception | None, list[int]]:
    """Ask every worker whether it is there: the error of one whose process is gone (as soon as it is
    known), else the ranks that neither answered nor died within PING_S.

    A worker that aborts (a native error) is not gone at once: it writes its stack dump and core
    first, on a loaded host for seconds. Waiting for it to be seen dead, rather than calling it
    unreachable early, is what tells a worker abort from a host loss.
    """
    refs: list[Any] = [w.info.remote() for w in att.workers]
    pending: list[Any] = list(refs)
    deadline = time.monotonic() + PING_S
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        try:
            ray.get(ready[0])
        except ray.exceptions.RayActorError as e:
            return e, []
    return None, [refs.index(r) for r in pending]


def _answers(worker) -> bool:
    try:
        ray.get(worker.info.remote(), timeout=10)
        return True
    except ray.exceptions.RayActorError:
        return False
    except ray.exceptions.GetTimeoutError:
        return True  # slow, not dead: the heartbeat decides


def _placed(store: Store, job_id: str, att: Attempt) -> list[tuple[str, int]]:
    """(Ray node id, process id) of each rank's worker of the current generation, from its launch event."""
    for e in reversed(store.events(job_id)):
        data = e.data or {}
        if e.kind is EventKind.LAUNCHED and data.get("generation") == att.generation:
            return list(zip(data.get("nodes") or [], data.get("pids") or []))
    return []


def _log_lines(store: Store, job_id: str, rank: int, lines: list[str]) -> None:
    """Lines into the job's log (`orchestrator logs`), as the host's own."""
    try:
        with open(Home(store.path.parent).job_dir(job_id) / "job.log", "a") as f:  # the store is in the home
            f.writelines(f"[host-{rank}] {line}\n" for line in lines)
    except OSError as e:
        log.warning("job %s: cannot write its log: %s", job_id, e)


def _confirm_failure(store: Store, job_id: str, att: Attempt, failure: Outcome) -> Outcome:
    """Gather what `classify_failure` needs: did a host die (waiting up to SETTLE_S for the word), does
    every worker answer. A worker whose process died meanwhile is asked about as `worker_died` does."""
    host_lost = _host_lost(att)
    unreachable = None
    if host_lost is None:
        died, silent = _ping(att)
        if died is not None:
            return worker_died(store, job_id, att, died)
        if silent:
            unreachable = f"host {silent[0]} answered no ping within {PING_S:.0f} s"
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
