"""Recovery rules: how an attempt ended (a typed outcome), and what the job does next.

Pure: the controller gathers the facts (workers' results, the provider's events, the
job's counts and budgets) and asks; these functions answer with a typed outcome or a
decision and its reason, and are table-tested without Ray.

How each way of ending counts is one table, `RULES`: the budget it spends and whether the
job is tried again. Preemptions and host losses spend `max_preemptions` and go on at once;
a worker process that died on a live host (a native abort) spends `max_aborts`; the job's
code raising, or hanging with every worker answering, spends `max_failures`, after a backoff.
What would end the same way on any slice is not tried again: an entrypoint that cannot be
imported, a full or read-only disk, a program that exited with status 0 before its last
step, hosts without the TPU chips their slice claims. Workers say what happened
(`failure_cause`); a timeout decides only when none could.
Waiting for capacity spends nothing (`orchestrator.control.queue`).
"""

from __future__ import annotations

import enum
import errno
import re
import time
from dataclasses import dataclass, field
from typing import Protocol, Sequence


class OutcomeKind(str, enum.Enum):
    SUCCEEDED = "succeeded"
    PREEMPTED = "preempted"  # the provider took hosts back, with or without notice
    INFRA_LOST = "infra_lost"  # a host went: the provider said so, or its worker stopped answering
    WORKER_ABORTED = "worker_aborted"  # a worker process died on a host that is still up (a native abort, a crash)
    HUNG = "hung"  # no step for the heartbeat timeout, while every worker answers and none said why
    APP_FAILED = "app_failed"  # the user's code raised on healthy hosts
    USER_EXIT = "user_exit"  # the user's code called sys.exit() (raised SystemExit) before its last step
    IMPORT_ERROR = "import_error"  # the entrypoint (or a module it imports) could not be imported
    STORAGE_FAILED = "storage_failed"  # a write failed on a full or read-only disk (checkpoints, mostly)
    PLATFORM_FAILED = "platform_failed"  # a host lacks the TPU chips its slice claims (before the job's code ran)
    FOLDER_TAKEN = "folder_taken"  # another job (another controller's) took the checkpoint folder's fence
    PROVISION_FAILED = "provision_failed"  # no slice, or its workers could not all start
    CANCELLED = "cancelled"
    RESIZED = "resized"  # stopped on purpose at a committed checkpoint, to go on on another slice size
    BUDGET_SPENT = "budget_spent"  # stopped at a committed checkpoint (or not started): budget_usd would be passed


@dataclass(frozen=True)
class Outcome:
    kind: OutcomeKind
    reason: str
    traceback: str | None = None
    transient: bool = True  # may a retry (later, elsewhere) work? (PROVISION_FAILED, USER_EXIT)
    at: float = field(default_factory=time.time)  # when the controller knew (before tearing the group down)

    @property
    def counts_as_preemption(self) -> bool:
        rule = RULES.get(self.kind)
        return rule is not None and rule.spends is Budget.PREEMPTIONS


# -- classifying an attempt ----------------------------------------------------------------

# How an INFRA_LOST outcome's reason begins when a worker, not its host, stopped answering,
# and how a HUNG one ends (`orchestrator.observe.timeline.disruption_cause` reads these).
WORKER_DIED = "a worker died"
WORKER_UNREACHABLE = "a worker is unreachable"
HUNG = "(hung)"


class FailureCause(str, enum.Enum):
    """What a worker says of how the job's code failed (`workers.protocol.WorkerResult.cause`)."""

    ERROR = "error"  # it raised
    EXIT = "exit"  # it called sys.exit() (raised SystemExit)
    IMPORT = "import"  # its entrypoint, or a module, could not be imported
    STORAGE = "storage"  # a write failed: the disk is full or read-only
    PLATFORM = "platform"  # before its code ran: the host's TPU did not start, or is not what the slice claims
    FOLDER_TAKEN = "folder_taken"  # at a save: the checkpoint folder's fence names another job


STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})
STORAGE_MESSAGES = ("no space left on device", "disk quota exceeded", "read-only file system")
IMPORT_ERRORS = frozenset({"ImportError", "ModuleNotFoundError"})


def failure_cause(chain: list[tuple[str, int | None, str]], *, importing: bool = False) -> FailureCause:
    """The cause of an exception out of the job's code, from its chain (the exception, then its
    `__cause__`/`__context__`s): each link's type name, errno (None if it has none) and message.

    `importing`: it came out of importing the entrypoint. An ImportError counts as raised, not
    as the context of another error (code that handles one and then fails is not an import
    error). A storage error is known by its errno anywhere in the chain or, where a library
    wrapped it (orbax, tensorstore), by the operating system's words.
    """
    if importing or (chain and chain[0][0] in IMPORT_ERRORS):  # an import that failed later: the same on any slice
        return FailureCause.IMPORT
    for _, err, message in chain:
        if err in STORAGE_ERRNOS or any(m in message.lower() for m in STORAGE_MESSAGES):
            return FailureCause.STORAGE
    return FailureCause.ERROR


_ABSL_FATAL = re.compile(r"^F\d{4} [\d:.]+ +\d+ (.+)$")  # F1125 12:00:00.000000 1234 file.cc:12] Check failed: ...
_SIGNAL = re.compile(r"\*\*\* (SIG[A-Z]+) received")
_PY_FATAL = re.compile(r"^Fatal Python error: (.+)$")
_NATIVE = ("terminate called", "Check failed", "Segmentation fault", "Aborted", "core dumped", "Killed")
# What a C++ exception said before it ended the process ("terminate called after throwing ..." then
# "  what():  ..."), and gloo's own enforce failures: the cause, where the lines above only say how it ended.
_WHAT = re.compile(r"^\s*what\(\):\s*(.+)$")
_ENFORCE = re.compile(r"(\[enforce fail at .+)$")


def native_lines(stderr_tail: str) -> list[str]:
    """A dead worker's stderr, without Ray's own header lines and its copies of what the process wrote."""
    lines = [ln.rstrip() for ln in stderr_tail.splitlines()]
    return [ln for ln in lines if ln and not ln.startswith((":job_id:", ":actor_name:", ":task_name:"))
            and "logging.cc:" not in ln]


def is_telling(line: str) -> bool:
    """Whether a line of a dead worker's stderr says what happened: an absl FATAL, a C++ exception and its
    what(), gloo's enforce failure, the signal, Python's fatal error."""
    return bool(_ABSL_FATAL.match(line) or _WHAT.match(line) or _ENFORCE.search(line) or _SIGNAL.search(line)
                or _PY_FATAL.match(line) or "terminate called" in line)


def telling_lines(stderr_tail: str, last: int = 40) -> list[str]:
    """What to keep of a dead worker's stderr for its log: the lines that say what happened (`is_telling`),
    then its last `last` lines. Python's fatal-error dump lists every thread's stack after them, which
    would push them out."""
    lines = native_lines(stderr_tail)
    return [ln for ln in lines[:-last] if is_telling(ln)] + lines[-last:]


def native_error(stderr_tail: str | None) -> str:
    """One line for the end of a worker process that died without an exception: the signal, and
    what the native code said last (an absl FATAL line, Python's fatal error, another telling line)."""
    lines = native_lines(stderr_tail or "")
    fatal = next((m.group(1) for ln in lines if (m := _ABSL_FATAL.match(ln))), None)
    signal_ = next((m.group(1) for ln in reversed(lines) if (m := _SIGNAL.search(ln))), None)
    py = next((m.group(1) for ln in lines if (m := _PY_FATAL.match(ln))), None)
    enforce = next((m.group(1).strip() for ln in lines if (m := _ENFORCE.search(ln))), None)
    thrown = next((ln.strip() for ln in lines if ln.startswith("terminate called")), None)
    what = next((m.group(1).strip() for ln in lines if (m := _WHAT.match(ln))), None)
    if thrown and what and what not in thrown:
        thrown = f"{thrown}: {what}"
    said = fatal or enforce or thrown or next((ln.strip() for ln in reversed(lines) if any(w in ln for w in _NATIVE)),
                                              None)
    if said is None and py is None and signal_ is None:
        return "no native error on its stderr (killed from outside? SIGKILL, the OOM killer)"
    parts = [p for p in (signal_, said, None if said else py and f"Fatal Python error: {py}") if p]
    return ": ".join(parts)


_CAUSE_KIND = {FailureCause.ERROR: OutcomeKind.APP_FAILED, FailureCause.EXIT: OutcomeKind.USER_EXIT,
               FailureCause.IMPORT: OutcomeKind.IMPORT_ERROR, FailureCause.STORAGE: OutcomeKind.STORAGE_FAILED,
               FailureCause.PLATFORM: OutcomeKind.PLATFORM_FAILED,
               FailureCause.FOLDER_TAKEN: OutcomeKind.FOLDER_TAKEN}
# When hosts fail together, the one that says most: the others often only fail in a collective after it.
_CAUSE_ORDER = [FailureCause.PLATFORM, FailureCause.FOLDER_TAKEN, FailureCause.IMPORT, FailureCause.STORAGE,
                FailureCause.EXIT, FailureCause.ERROR]


class HostResult(Protocol):
    """How one host's training ended (`workers.protocol.WorkerResult` is one)."""

    # Read-only (properties), as a frozen record's fields are.
    @property
    def ending(self) -> str: ...  # "succeeded", "stopped" (at an agreed step, checkpointed), "failed"
    @property
    def rank(self) -> int: ...
    @property
    def steps(self) -> int | None: ...
    @property
    def notice(self) -> str | None: ...
    @property
    def error(self) -> str | None: ...
    @property
    def traceback(self) -> str | None: ...
    @property
    def cause(self) -> str | None: ...  # a FailureCause value, for "failed"
    @property
    def exit_code(self) -> int | None: ...  # for FailureCause.EXIT


def results_outcome(results: Sequence[HostResult | None], *, resizing_to: str | None,
                    notice: str | None) -> Outcome | None:
    """What the workers' results say (None while any host still trains and none failed).

    A failure is returned by the cause its worker gave (APP_FAILED, USER_EXIT, IMPORT_ERROR,
    STORAGE_FAILED, PLATFORM_FAILED) for `classify_failure` to confirm: when a host dies, the
    others fail in their collectives within seconds, and that is no failure of the job's.
    A platform failure's error names its host within its slice itself.
    """
    failed = [r for r in results if r and r.ending == "failed"]
    if failed:
        def order(r: HostResult) -> int:
            cause = FailureCause(r.cause) if r.cause in FailureCause._value2member_map_ else FailureCause.ERROR
            return _CAUSE_ORDER.index(cause)

        f = min(failed, key=order)
        cause = _CAUSE_ORDER[order(f)]
        said = f.error if cause is FailureCause.PLATFORM and f.error else f"host {f.rank}: {f.error}"
        return Outcome(_CAUSE_KIND[cause], said, traceback=f.traceback,
                       transient=not (cause is FailureCause.EXIT and f.exit_code == 0))
    ended = [r for r in results if r is not None]
    if len(ended) < len(results):  # a host still trains
        return None
    stopped = [r for r in ended if r.ending == "stopped"]
    if stopped and resizing_to:
        return Outcome(OutcomeKind.RESIZED, f"checkpointed after step {stopped[0].steps} to resize to {resizing_to}")
    if stopped:
        return Outcome(OutcomeKind.PREEMPTED, f"preemption notice ({notice or stopped[0].notice}); stopped after "
                                              f"step {stopped[0].steps} with its checkpoint committed")
    return Outcome(OutcomeKind.SUCCEEDED, "training finished")


def classify_failure(failure: Outcome, *, host_lost: str | None, unreachable: str | None) -> Outcome:
    """A worker failed: the job's code failed only if every host is still healthy.

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
    max_aborts: int = 2


class Budget(str, enum.Enum):
    PREEMPTIONS = "max_preemptions"
    FAILURES = "max_failures"
    ABORTS = "max_aborts"


class Retry(str, enum.Enum):
    NOW = "now"  # provision again at once
    BACKOFF = "backoff"  # after `backoff_s`
    NEVER = "never"  # the same code, data and disk would end the same way on any slice
    IF_TRANSIENT = "if transient"  # BACKOFF when the outcome is transient, else NEVER


@dataclass(frozen=True)
class RecoveryRule:
    """How an attempt that ended one way counts: the budget it spends, whether it is tried again."""

    spends: Budget
    retry: Retry
    never_because: str = ""  # why it is not tried again, for Retry.NEVER and non-transient IF_TRANSIENT


RULES: dict[OutcomeKind, RecoveryRule] = {
    OutcomeKind.PREEMPTED: RecoveryRule(Budget.PREEMPTIONS, Retry.NOW),
    OutcomeKind.INFRA_LOST: RecoveryRule(Budget.PREEMPTIONS, Retry.NOW),
    OutcomeKind.WORKER_ABORTED: RecoveryRule(Budget.ABORTS, Retry.BACKOFF),
    OutcomeKind.HUNG: RecoveryRule(Budget.FAILURES, Retry.BACKOFF),
    OutcomeKind.APP_FAILED: RecoveryRule(Budget.FAILURES, Retry.BACKOFF),
    OutcomeKind.USER_EXIT: RecoveryRule(Budget.FAILURES, Retry.IF_TRANSIENT,
                                "the program ended itself with status 0; run again it would do the same"),
    OutcomeKind.IMPORT_ERROR: RecoveryRule(Budget.FAILURES, Retry.NEVER,
                                   "every slice would import the same code; fix it and submit again"),
    OutcomeKind.STORAGE_FAILED: RecoveryRule(Budget.FAILURES, Retry.NEVER,
                                     "the disk would refuse again; free space (or point checkpoint.directory "
                                     "elsewhere) and submit again: it goes on from the last committed step"),
    OutcomeKind.PLATFORM_FAILED: RecoveryRule(Budget.FAILURES, Retry.NEVER,
                                      "every launch on these hosts would find the same chips"),
    OutcomeKind.FOLDER_TAKEN: RecoveryRule(Budget.FAILURES, Retry.NEVER,
                                   "the folder's checkpoints are another job's now; give this job a checkpoint "
                                   "folder of its own and submit again"),
    OutcomeKind.PROVISION_FAILED: RecoveryRule(Budget.FAILURES, Retry.IF_TRANSIENT),
}


@dataclass(frozen=True)
class RecoveryDecision:
    next: Next
    reason: str
    preemptions: int  # the job's counts after this outcome
    failures: int
    backoff_s: float = 0.0  # to wait before provisioning again
    aborts: int = 0


MAX_BACKOFF_S = 60.0


def backoff_s(failures: int, jitter: float) -> float:
    """Before the next try after the `failures`-th failure: doubling from 2 s to 60 s, and
    `jitter` in [0, 1) takes up to half off, so jobs that failed together do not retry together."""
    return min(MAX_BACKOFF_S, 2.0 ** failures) * (1.0 - 0.5 * jitter)


_OVER_BUDGET = {  # the reason when max_failures is spent: what happened n times, the word for one and for more
    OutcomeKind.APP_FAILED: ("the job's code failed", "time", "times"),
    OutcomeKind.USER_EXIT: ("the job's code exited", "time", "times"),
    OutcomeKind.HUNG: ("the job hung", "time", "times"),
    OutcomeKind.PROVISION_FAILED: ("could not start after", "try", "tries"),
}


def after(outcome: Outcome, *, preemptions: int, failures: int, budgets: Budgets, jitter: float,
          aborts: int = 0) -> RecoveryDecision:
    """What the job does after an attempt ended with `outcome`, given its counts so far (see `RULES`)."""
    k = outcome.kind
    if k is OutcomeKind.SUCCEEDED:
        return RecoveryDecision(Next.SUCCEED, outcome.reason, preemptions, failures, aborts=aborts)
    if k is OutcomeKind.CANCELLED:
        return RecoveryDecision(Next.CANCEL, outcome.reason, preemptions, failures, aborts=aborts)
    if k is OutcomeKind.RESIZED:
        return RecoveryDecision(Next.RESIZE, outcome.reason, preemptions, failures, aborts=aborts)
    if k is OutcomeKind.BUDGET_SPENT:  # the user's cap: nothing to retry, no budget of failures spent
        return RecoveryDecision(Next.FAIL, outcome.reason, preemptions, failures, aborts=aborts)
    if k is OutcomeKind.PROVISION_FAILED and not outcome.transient:  # nothing of the job's ran: no budget spent
        return RecoveryDecision(Next.FAIL, f"could not provision: {outcome.reason}", preemptions, failures,
                                aborts=aborts)
    rule = RULES[k]
    counts = {Budget.PREEMPTIONS: preemptions, Budget.FAILURES: failures, Budget.ABORTS: aborts}
    n = counts[rule.spends] + 1
    counts[rule.spends] = n
    limit = getattr(budgets, rule.spends.value)

    def decide(next_: Next, reason: str, wait: float = 0.0) -> RecoveryDecision:
        return RecoveryDecision(next_, reason, counts[Budget.PREEMPTIONS], counts[Budget.FAILURES], wait,
                        counts[Budget.ABORTS])

    retry = rule.retry
    if retry is Retry.IF_TRANSIENT:
        retry = Retry.BACKOFF if outcome.transient else Retry.NEVER
    if retry is Retry.NEVER:
        return decide(Next.FAIL, f"{outcome.reason}; not tried again: {rule.never_because}")
    if n > limit:
        if rule.spends is Budget.PREEMPTIONS:
            return decide(Next.FAIL, f"{n} preemptions or host losses, more than max_preemptions={limit}; "
                                     f"last: {outcome.reason}")
        if rule.spends is Budget.ABORTS:
            return decide(Next.FAIL, f"{n} worker abort{'s' if n != 1 else ''}, more than max_aborts={limit}; "
                                     f"last: {outcome.reason}")
        what, one, more = _OVER_BUDGET[k]
        return decide(Next.FAIL, f"{what} {n} {one if n == 1 else more} (max_failures={limit}): {outcome.reason}")
    word = {Budget.PREEMPTIONS: "preemption", Budget.FAILURES: "failure", Budget.ABORTS: "abort"}[rule.spends]
    wait = backoff_s(n, jitter) if retry is Retry.BACKOFF else 0.0
    return decide(Next.RECOVER, f"{outcome.reason} ({word} {n} of at most {limit})", wait)
