"""The two lifecycles of the system, each an enum plus its table of allowed moves.

Only `orchestrator.state.store` performs a transition (a guarded update that also records
an event); everything else asks `check_*` or reads the tables.
"""

from __future__ import annotations

import enum

from orchestrator.errors import IllegalTransitionError


class JobState(str, enum.Enum):
    PENDING = "PENDING"
    QUEUED = "QUEUED"  # waits for hosts or capacity; never spends max_failures
    PROVISIONING = "PROVISIONING"
    STARTING = "STARTING"
    RUNNING = "RUNNING"
    RECOVERING = "RECOVERING"
    RESIZING = "RESIZING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def terminal(self) -> bool:
        return self in _JOB_TERMINAL


_JOB_TERMINAL = {JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED}


class FailedBecause(str, enum.Enum):
    """Why a job ended FAILED (`JobRecord.cause`): one word a script can branch on; the reason says the rest.

    `status` and `list` show the two together as one state, FAILED_SETUP, FAILED_BUDGET, ...
    """

    SETUP = "setup"  # the job cannot start: its entrypoint cannot be imported, or a host lacks its slice's TPU
    USER_CODE = "user_code"  # the job's code raised, or hung, more than max_failures times
    USER_EXIT = "user_exit"  # the job's code ended itself (sys.exit) before its last step
    STORAGE = "storage"  # a write failed on a full or read-only disk
    NO_RESOURCE = "no_resource"  # no slice: its hosts could not start, or it waited past queue_timeout
    PREEMPTIONS = "preemptions"  # more preemptions and host losses than max_preemptions
    WORKER_ABORTS = "worker_aborts"  # more worker processes died on live hosts than max_aborts
    BUDGET = "budget"  # stopped at a committed step before it would spend more than budget_usd
    CONTROLLER = "controller"  # a fault of the controller's own

    def state_name(self) -> str:
        return f"FAILED_{self.name}"

_J = JobState
JOB_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    # SUCCEEDED at once: its folder already holds the run's last step (a finished run submitted again).
    _J.PENDING: frozenset({_J.QUEUED, _J.PROVISIONING, _J.SUCCEEDED, _J.FAILED, _J.CANCELLED}),
    _J.QUEUED: frozenset({_J.PROVISIONING, _J.FAILED, _J.CANCELLED}),
    # PROVISIONING again: a request refused for capacity and another asked for at once (an autoscaled
    # job's policy names the next size or tier instead of queueing).
    _J.PROVISIONING: frozenset({_J.PROVISIONING, _J.QUEUED, _J.STARTING, _J.RECOVERING, _J.FAILED, _J.CANCELLED}),
    _J.STARTING: frozenset({_J.RUNNING, _J.RECOVERING, _J.SUCCEEDED, _J.FAILED, _J.CANCELLED}),
    _J.RUNNING: frozenset({_J.SUCCEEDED, _J.RECOVERING, _J.RESIZING, _J.FAILED, _J.CANCELLED}),
    _J.RECOVERING: frozenset({_J.QUEUED, _J.PROVISIONING, _J.FAILED, _J.CANCELLED}),
    _J.RESIZING: frozenset({_J.QUEUED, _J.PROVISIONING, _J.RECOVERING, _J.FAILED, _J.CANCELLED}),
    _J.SUCCEEDED: frozenset(),
    _J.FAILED: frozenset(),
    _J.CANCELLED: frozenset(),
}


class SliceState(str, enum.Enum):
    REQUESTED = "REQUESTED"
    WAITING = "WAITING"  # queued, no capacity yet
    PROVISIONING = "PROVISIONING"
    READY = "READY"
    PREEMPTING = "PREEMPTING"  # a notice arrived; hosts still up for the grace window
    GONE = "GONE"  # lost without being asked (preempted, host died)
    RELEASED = "RELEASED"  # given back by us

    @property
    def terminal(self) -> bool:
        return self in (SliceState.GONE, SliceState.RELEASED)


_S = SliceState
SLICE_TRANSITIONS: dict[SliceState, frozenset[SliceState]] = {
    _S.REQUESTED: frozenset({_S.WAITING, _S.PROVISIONING, _S.READY, _S.GONE, _S.RELEASED}),
    _S.WAITING: frozenset({_S.PROVISIONING, _S.GONE, _S.RELEASED}),
    # PREEMPTING from PROVISIONING: a reclaim notice can come before every host joined.
    _S.PROVISIONING: frozenset({_S.READY, _S.PREEMPTING, _S.GONE, _S.RELEASED}),
    _S.READY: frozenset({_S.PREEMPTING, _S.GONE, _S.RELEASED}),
    _S.PREEMPTING: frozenset({_S.GONE, _S.RELEASED}),
    _S.GONE: frozenset({_S.RELEASED}),
    _S.RELEASED: frozenset(),
}


def check_job(job_id: str, current: JobState, target: JobState) -> None:
    if target not in JOB_TRANSITIONS[current]:
        raise IllegalTransitionError("job", job_id, current.value, target.value)


def check_slice(name: str, current: SliceState, target: SliceState) -> None:
    if target not in SLICE_TRANSITIONS[current]:
        raise IllegalTransitionError("slice", name, current.value, target.value)
