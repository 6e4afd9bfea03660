"""Recovery rules: how an attempt ended (a typed outcome), and what the job does next.

Pure: the controller gathers the facts (workers' results, the provider's events, the
job's counts and budgets) and asks; these functions answer with a typed outcome or a
decision and its reason, and are table-tested without Ray. Preemptions and host losses
spend `max_preemptions`; failures of the job's own code (and slices whose workers could
not start) spend `max_failures`; waiting for capacity spends neither (`orchestrator.control.queue`).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Protocol


class OutcomeKind(str, enum.Enum):
    SUCCEEDED = "succeeded"
    PREEMPTED = "preempted"  # the provider took hosts back, with or without notice
    INFRA_LOST = "infra_lost"  # a host or worker process died, or hung past the heartbeat timeout
    APP_FAILED = "app_failed"  # the user's code raised (or exited non-zero) on healthy hosts
    PROVISION_FAILED = "provision_failed"  # no slice, or its workers could not all start
    CANCELLED = "cancelled"
    RESIZED = "resized"  # stopped on purpose at a committed checkpoint, to go on on another slice size


@dataclass(frozen=True)
class Outcome:
    kind: OutcomeKind
    reason: str
    traceback: str | None = None
    transient: bool = True  # for PROVISION_FAILED: may a retry (later, elsewhere) work?
    at: float = field(default_factory=time.time)  # when the controller knew (before tearing the group down)

    @property
    def counts_as_preemption(self) -> bool:
        return self.kind in (OutcomeKind.PREEMPTED, OutcomeKind.INFRA_LOST)


# -- classifying an attempt ----------------------------------------------------------------

# How an INFRA_LOST outcome's reason begins or ends when a worker, not its host, went
# (`orchestrator.observe.timeline.disruption_cause` tells them apart by these).
WORKER_DIED = "a worker died"
WORKER_UNREACHABLE = "a worker is unreachable"
HUNG = "(hung)"


class HostResult(Protocol):
    """How one host's training ended (`workers.protocol.WorkerResult` is one)."""

    ending: str  # "succeeded", "stopped" (at an agreed step, checkpointed), "failed"
    rank: int
    steps: int | None
    notice: str | None
    error: str | None
    traceback: str | None


def results_outcome(results: list[HostResult | None], *, resizing_to: str | None,
                    notice: str | None) -> Outcome | None:
    """What the workers' results say (None while any host still trains and none failed).

    A failure is returned as APP_FAILED for `classify_failure` to confirm: when a host
    dies, the others fail in their collectives within seconds, and that is no bug of the job.
    """
    failed = [r for r in results if r and r.ending == "failed"]
    if failed:
        f = failed[0]
        return Outcome(OutcomeKind.APP_FAILED, f"host {f.rank}: {f.error}", traceback=f.traceback)
    if not all(results):
        return None
    stopped = [r for r in results if r.ending == "stopped"]
    if stopped and resizing_to:
        return Outcome(OutcomeKind.RESIZED, f"checkpointed after step {stopped[0].steps} to resize to {resizing_to}")
    if stopped:
        return Outcome(OutcomeKind.PREEMPTED, f"preemption notice ({notice or stopped[0].notice}); stopped after "
                                              f"step {stopped[0].steps} with its checkpoint committed")
    return Outcome(OutcomeKind.SUCCEEDED, "training finished")


def classify_failure(failure: Outcome, *, host_lost: str | None, unreachable: str | None) -> Outcome:
    """A worker raised: the job's code failed only if every host is still healthy.

    `host_lost`: the provider's word that a host of the slice went (its reason), if it
    said so; `unreachable`: why a worker did not answer a ping, if one did not.
    """
    if host_lost is not None:
        return Outcome(OutcomeKind.INFRA_LOST, host_lost, at=failure.at)
    if unreachable is not None:
        return Outcome(OutcomeKind.INFRA_LOST, f"{WORKER_UNREACHABLE} ({unreachable})", at=failure.at)
    return failure


# -- deciding what comes next ----------------------------------------------------------------


class Next(str, enum.Enum):
    SUCCEED = "succeed"
    CANCEL = "cancel"
    FAIL = "fail"
    RECOVER = "recover"  # provision again and restore the last committed checkpoint
    RESIZE = "resize"  # the same, on the slice the job was moved to


@dataclass(frozen=True)
class Budgets:
    max_preemptions: int
    max_failures: int


@dataclass(frozen=True)
class Decision:
    next: Next
    reason: str
    preemptions: int  # the job's counts after this outcome
    failures: int
    backoff_s: float = 0.0  # to wait before provisioning again


MAX_BACKOFF_S = 60.0


def backoff_s(failures: int, jitter: float) -> float:
    """Before the next try after the `failures`-th failure: doubling from 2 s to 60 s, and
    `jitter` in [0, 1) takes up to half off, so jobs that failed together do not retry together."""
    return min(MAX_BACKOFF_S, 2.0 ** failures) * (1.0 - 0.5 * jitter)


def after(outcome: Outcome, *, preemptions: int, failures: int, budgets: Budgets, jitter: float) -> Decision:
    """What the job does after an attempt ended with `outcome`, given its counts so far."""
    k = outcome.kind
    if k is OutcomeKind.SUCCEEDED:
        return Decision(Next.SUCCEED, outcome.reason, preemptions, failures)
    if k is OutcomeKind.CANCELLED:
        return Decision(Next.CANCEL, outcome.reason, preemptions, failures)
    if k is OutcomeKind.RESIZED:
        return Decision(Next.RESIZE, outcome.reason, preemptions, failures)
    if k is OutcomeKind.PROVISION_FAILED and not outcome.transient:
        return Decision(Next.FAIL, f"could not provision: {outcome.reason}", preemptions, failures)
    if outcome.counts_as_preemption:
        n = preemptions + 1
        if n > budgets.max_preemptions:
            return Decision(Next.FAIL, f"{n} preemptions or host losses, more than max_preemptions="
                                       f"{budgets.max_preemptions}; last: {outcome.reason}", n, failures)
        return Decision(Next.RECOVER, f"{outcome.reason} (preemption {n} of at most {budgets.max_preemptions})",
                        n, failures)
    n = failures + 1  # APP_FAILED, or a transient provisioning failure (workers that did not start)
    if n > budgets.max_failures:
        what = ("the job's code failed" if k is OutcomeKind.APP_FAILED else "could not start after")
        tail = "times" if k is OutcomeKind.APP_FAILED else "tries"
        return Decision(Next.FAIL, f"{what} {n} {tail} (max_failures={budgets.max_failures}): {outcome.reason}",
                        preemptions, n)
    return Decision(Next.RECOVER, f"{outcome.reason} (failure {n} of at most {budgets.max_failures})",
                    preemptions, n, backoff_s(n, jitter))
