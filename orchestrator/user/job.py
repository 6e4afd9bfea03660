"""A job as the Python API hands it out: `Job`, the handle, and `JobStatus`, its state at one moment.

Reading a job (status, events, metrics, logs) needs only the state directory, not Ray.
`orchestrator.user.client.Client` makes them.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol

from orchestrator.cluster import Home
from orchestrator.state.states import FailedBecause, JobState
from orchestrator.state.store import Event, JobRecord, StepMetric, Store


@dataclass(frozen=True)
class JobStatus:
    id: str
    name: str
    state: JobState
    reason: str
    accelerator: str
    tier: str
    step: int  # completed steps
    total_steps: int | None
    loss: float | None
    tokens_per_s: float | None
    preemptions: int
    failures: int
    error: str | None
    created_at: float
    updated_at: float
    queue_position: int | None = None  # place in the admission queue while QUEUED (1 = next)
    # The last step's other figures: mfu, tflops_per_chip, hbm_in_use_gib, hbm_peak_gib, the program's own.
    metrics: dict = dataclasses.field(default_factory=dict)
    cluster: str | None = None  # for a job not yet ended: "up", "gone" (nothing runs it), "remote" (unknown here)
    wall_s: float | None = None  # from submission to its end, or to now while it has not ended
    # What a move to another slice is doing now ("moving to v4-32 spot: waiting for capacity").
    moving: str | None = None
    cause: FailedBecause | None = None  # why a FAILED job failed
    warning: str | None = None  # what the job will miss at its measured speed ("will miss its deadline by 4 min")
    # While the controller cannot write the store: "state store not writable: disk full (...) since 12:03:04; ..."
    store_fault: str | None = None
    # The current generation's launch plan ("gen 3 on 2 x v4-16 spot, mesh (4,2,1), 2 microbatches, ...").
    plan: str | None = None

    @property
    def done(self) -> bool:
        return self.state.terminal

    @property
    def state_name(self) -> str:
        """The state as `status` and `list` show it: a failure with its cause (FAILED_SETUP, FAILED_BUDGET, ...)."""
        return self.cause.state_name() if self.state is JobState.FAILED and self.cause else self.state.value

    @property
    def stalled(self) -> str | None:
        """Why nothing moves this job although it has not ended (the local cluster is gone), or None."""
        if self.done or self.cluster != "gone":
            return None
        return CLUSTER_GONE


CLUSTER_GONE = ("the local cluster is not running (stopped or crashed), so nothing runs this job now; "
                "`orchestrator up` starts it again and resumes the job from its last committed checkpoint")


class JobsClient(Protocol):
    """What a job's handle and a profile capture reach of the client that made them
    (`orchestrator.user.client.Client` is one): named here so that neither imports the client back."""

    home: Home
    address: str | None
    store: Store

    def _status_of(self, job: JobRecord) -> JobStatus: ...

    def _ask(self, method: str, *args: Any, timeout_s: float = 60) -> Any: ...

    def cancel(self, job_id: str) -> None: ...


class Job:
    """A handle on one submitted job."""

    def __init__(self, client: JobsClient, job_id: str):
        self._client, self.id = client, job_id

    def __repr__(self) -> str:
        return f"Job({self.id!r})"

    def record(self) -> JobRecord:
        return self._client.store.job(self.id)

    def status(self) -> JobStatus:
        return self._client._status_of(self.record())

    def wait(self, *, timeout_s: float | None = None, poll_s: float = 0.5,
             on_update: Callable[[JobStatus], None] | None = None) -> JobStatus:
        """Block until the job ends (or `timeout_s` passes: then TimeoutError); returns the final status."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            st = self.status()
            if on_update:
                on_update(st)
            if st.done:
                return st
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {self.id} still {st.state.value} after {timeout_s} s")
            time.sleep(poll_s)

    def events(self) -> list[Event]:
        return self._client.store.events(self.id)

    def goodput(self):
        """Where the job's wall time and money went (`orchestrator.observe.goodput.Goodput`); kept after it ends."""
        from orchestrator.observe.goodput import goodput

        return goodput(self._client.store, self.id)

    def metrics(self) -> list[StepMetric]:
        """Per-step loss, tokens/s and step time (the newest generation's value for a recomputed step)."""
        return self._client.store.steps(self.id)

    def logs(self) -> str:
        path = self._client.home.job_dir(self.id) / "job.log"
        return path.read_text() if path.exists() else ""

    def follow_logs(self, *, poll_s: float = 0.5) -> Iterator[str | None]:
        """Yield log lines as they arrive, until the job ends.

        With ``poll_s=0`` it yields None whenever it has nothing new instead of sleeping,
        so a caller can interleave other work (a progress display).
        """
        path = self._client.home.job_dir(self.id) / "job.log"
        pos = 0
        while True:
            ended = self.status().done
            if path.exists():
                with open(path) as f:
                    f.seek(pos)
                    chunk = f.read()
                    pos = f.tell()
                yield from chunk.splitlines()
            if ended:
                return
            if poll_s:
                time.sleep(poll_s)
            else:
                yield None

    def cancel(self) -> None:
        self._client.cancel(self.id)


def _status(job: JobRecord, last: StepMetric | None) -> JobStatus:
    spec = job.placed_json  # shown as stored, where it runs now: a status never fails on a row it cannot parse
    return JobStatus(
        id=job.id, name=job.name, state=job.state, reason=job.reason, accelerator=spec.get("accelerator", "?"),
        # A job that trained no step of its own may have resumed a finished run: its result says where it stands.
        tier=spec.get("tier", "?"), step=(last.step + 1) if last else (job.result or {}).get("steps") or 0,
        total_steps=(spec.get("workload") or {}).get("steps"), loss=last.loss if last else None,
        tokens_per_s=last.tokens_per_s if last else None, preemptions=job.preemptions, failures=job.failures,
        error=job.error, created_at=job.created_at, updated_at=job.updated_at, metrics=last.metrics if last else {},
        cause=job.cause)
