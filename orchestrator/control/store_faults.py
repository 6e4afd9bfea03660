"""Going on through a state store that cannot be written (a full disk, a read-only or deleted `state.db`).

The store raises `StoreFaultError` for a write the file system refuses. Here is what the
controller does about it, so that no driver dies of it and no job is left RUNNING forever:

- `StoreHealth` is the controller's memory of the fault: its cause, since when, how many
  writes wait. `status` and `logs` read it from the controller's metrics endpoint (the
  store itself cannot say it), and its log lines are rate-limited: one when the fault
  begins or its cause changes, one a minute while it lasts, one when it ends.
- A job's driver thread writes through `HoldingStore`: a refused write is tried again with
  backoff (tenacity) until the store takes it, so the driver holds where it is, its
  workers train on (or stop at a committed step), and it picks up by itself.
- Workers' reports must not wait (they arrive on the controller's shared threads), so
  their writes go to `HeldWrites`, kept in order and written as soon as the store works.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import tenacity

from orchestrator.domain.shape import Shape
from orchestrator.errors import StoreFaultError
from orchestrator.state.events import EventKind, Payload, SliceChanged, StateChange
from orchestrator.state.protocol import JobStore
from orchestrator.state.states import JobState
from orchestrator.state.store import Event, JobRecord, SliceRow, StepMetric

log = logging.getLogger(__name__)

T = TypeVar("T")

REMIND_EVERY_S = 60.0  # while a fault lasts, how often it is logged again


@dataclass(frozen=True)
class StoreFault:
    """The store's fault as `status` shows it."""

    cause: str  # StoreFaultError.cause: "disk full", "read-only", "deleted", "replaced", ...
    message: str  # StoreFaultError's message: "state store not writable: disk full (PATH: ...)"
    since: float  # wall time of the first refused write
    held: int  # writes waiting to be written


class StoreHealth:
    """What the controller knows of its store: the fault now (None while writes go through)."""

    def __init__(self, *, on_change: Callable[[str, StoreFault | None], None] | None = None,
                 remind_every_s: float = REMIND_EVERY_S):
        self._lock = threading.Lock()
        self._fault: StoreFault | None = None
        self._logged_at = 0.0
        self._quiet: tuple[str, float] | None = None  # the cause of the fault that ended last, and until when
        self._quiet_fault = False  # the fault now began while that was quiet: it comes and goes, said once
        self._remind_every_s = remind_every_s
        self.held = 0  # set by HeldWrites
        # Told when a fault begins (the line) and ends (the line, and the fault that ended).
        self.on_change = on_change

    @property
    def fault(self) -> StoreFault | None:
        with self._lock:
            f = self._fault
        return None if f is None else StoreFault(f.cause, f.message, f.since, self.held)

    def failed(self, e: StoreFaultError) -> None:
        now = time.monotonic()
        with self._lock:
            new = self._fault is None or self._fault.cause != e.cause
            if new:
                self._fault = StoreFault(e.cause, str(e), time.time(), 0)
                # A fault back within the reminder interval with the same cause (a disk that is all but
                # full takes one write and refuses the next) is the same fault, said once a minute.
                self._quiet_fault = self._quiet is not None and self._quiet[0] == e.cause and now < self._quiet[1]
                new = not self._quiet_fault
            remind = not new and now - self._logged_at >= self._remind_every_s
            if new or remind:
                self._logged_at = now
            assert self._fault is not None  # set above, or already set (not new)
            since = self._fault.since
        if new:
            log.error("%s; jobs go on, their writes are held and retried until the store works again", e)
            if e.cause == "replaced":
                log.error("the state store %s was replaced while the cluster ran: `status`, `list` and `cancel` "
                          "read that path and cannot see the running jobs; put the cluster's own file back (the "
                          "controller goes on by itself) or stop the cluster with `orchestrator down`", e.path)
            self._tell(f"{e}; training goes on, its records are held until the store works again", None)
        elif remind:
            log.error("%s (for %.0f s now; %d writes held)", e, time.time() - since, self.held)

    def worked(self) -> None:
        with self._lock:
            ended, self._fault = self._fault, None
            if ended is None:
                return
            self._quiet = (ended.cause, time.monotonic() + self._remind_every_s)
            if self._quiet_fault:  # its beginning was not said either
                return
        line = (f"state store writable again after {time.time() - ended.since:.1f} s ({ended.cause}); "
                f"the held records are written")
        log.warning(line)
        self._tell(line, ended)

    def _tell(self, line: str, ended: StoreFault | None) -> None:
        if self.on_change is not None:
            try:
                self.on_change(line, ended)
            except Exception:  # the logs may be on the same full disk
                log.debug("could not put a store line in the jobs' logs", exc_info=True)


def write_through(health: StoreHealth, write: Callable[[], T], *, first_wait_s: float = 0.2,
                  max_wait_s: float = 10.0) -> T:
    """`write()`, tried again with backoff while the store refuses it; blocks until it is taken."""
    def refused(state: tenacity.RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome is not None else None
        if isinstance(error, StoreFaultError):  # the only error retried
            health.failed(error)

    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception_type(StoreFaultError),
        wait=tenacity.wait_exponential_jitter(initial=first_wait_s, max=max_wait_s),
        before_sleep=refused,
        reraise=True)
    result = retrying(write)
    health.worked()
    return result


class HeldWrites:
    """Writes that may not wait for the store (workers' reports): written in order, at once if the store
    takes them, else kept and written with the next write or `flush`."""

    def __init__(self, health: StoreHealth):
        self._health = health
        self._pending: deque[Callable[[], Any]] = deque()
        self._lock = threading.Lock()

    def add(self, write: Callable[[], Any]) -> None:
        with self._lock:
            self._pending.append(write)
            try:
                self._flush()
            except StoreFaultError as e:
                self._health.failed(e)

    def flush(self) -> None:
        """Write what is held, in order; StoreFaultError if the store still refuses (the rest stays held)."""
        with self._lock:
            self._flush()

    def _flush(self) -> None:
        try:
            while self._pending:
                try:
                    self._pending[0]()
                except StoreFaultError:
                    raise
                except Exception:  # a held write that can never be written (a bug of ours): not the store's fault
                    log.exception("a held store write failed; it is dropped")
                self._pending.popleft()
        finally:
            self._health.held = len(self._pending)
        self._health.worked()


class HoldingStore(JobStore):
    """The store as a job's driver thread writes it: reads as the store; a write waits until the store takes
    it (`write_through`), after the held writes before it, so the job's records keep their order.

    Each method of `JobStore` is written out here: a read passes through, a write goes through `_write`.
    A method added to the Protocol and not here is abstract to the type checker (no HoldingStore can be
    made), and `tests/unit/test_store_protocol.py` fails: it calls every write of the Protocol on a store
    that refuses it once and checks that the write was held and tried again.
    """

    def __init__(self, store: JobStore, health: StoreHealth, held: HeldWrites, *, first_wait_s: float = 0.2):
        self._store, self._health, self._held = store, health, held
        self._first_wait_s = first_wait_s

    def _write(self, write: Callable[[], T]) -> T:
        def once() -> T:
            self._held.flush()
            return write()
        return write_through(self._health, once, first_wait_s=self._first_wait_s)

    # -- reads: as the store answers them -------------------------------------------------------

    def job(self, job_id: str) -> JobRecord:
        return self._store.job(job_id)

    def jobs(self, *, active_only: bool = False) -> list[JobRecord]:
        return self._store.jobs(active_only=active_only)

    def find_job(self, prefix: str) -> JobRecord:
        return self._store.find_job(prefix)

    def job_using(self, folder: str) -> JobRecord | None:
        return self._store.job_using(folder)

    def events(self, job_id: str, *, after_seq: int = 0, kind: EventKind | None = None) -> list[Event]:
        return self._store.events(job_id, after_seq=after_seq, kind=kind)

    def last_event(self, job_id: str, kind: EventKind, *, to_state: JobState | None = None) -> Event | None:
        return self._store.last_event(job_id, kind, to_state=to_state)

    def slice_events(self, *, since: float, exclude_job: str | None = None, after_seq: int = 0) -> list[Event]:
        return self._store.slice_events(since=since, exclude_job=exclude_job, after_seq=after_seq)

    def steps(self, job_id: str) -> list[StepMetric]:
        return self._store.steps(job_id)

    def steps_written_after(self, job_id: str, row: int = 0) -> tuple[list[StepMetric], int]:
        return self._store.steps_written_after(job_id, row)

    def last_step(self, job_id: str) -> StepMetric | None:
        return self._store.last_step(job_id)

    def slices(self, *, job_id: str | None = None, live_only: bool = False) -> list[SliceRow]:
        return self._store.slices(job_id=job_id, live_only=live_only)

    def copy_to(self, dest: Path | str) -> None:
        self._store.copy_to(dest)

    def check_writable(self) -> None:
        self._store.check_writable()

    # -- writes: held until the store takes them ------------------------------------------------

    def create_job(self, job_id: str, name: str, spec: dict[str, Any], *, reason: str = "submitted",
                   at: float | None = None, folder: str | None = None) -> JobRecord:
        return self._write(lambda: self._store.create_job(job_id, name, spec, reason=reason, at=at, folder=folder))

    def transition(self, job_id: str, target: JobState, reason: str, *, data: StateChange | None = None,
                   at: float | None = None, **fields: Any) -> JobRecord:
        return self._write(lambda: self._store.transition(job_id, target, reason, data=data, at=at, **fields))

    def update_job(self, job_id: str, **fields: Any) -> None:
        self._write(lambda: self._store.update_job(job_id, **fields))

    def place(self, job_id: str, shape: Shape) -> None:
        self._write(lambda: self._store.place(job_id, shape))

    def bump_generation(self, job_id: str) -> int:
        return self._write(lambda: self._store.bump_generation(job_id))

    def add_event(self, job_id: str, event: Payload, reason: str, *, at: float | None = None) -> None:
        self._write(lambda: self._store.add_event(job_id, event, reason, at=at))

    def import_event(self, job_id: str, kind: EventKind | str, reason: str, data: dict[str, Any] | None = None, *,
                     at: float | None = None) -> None:
        self._write(lambda: self._store.import_event(job_id, kind, reason, data, at=at))

    def record_steps(self, job_id: str, generation: int, rows: list[tuple[Any, ...]], *,
                     at: float | None = None) -> None:
        self._write(lambda: self._store.record_steps(job_id, generation, rows, at=at))

    def put_slice(self, name: str, job_id: str, provider: str, accelerator: str, tier: str, state: str,
                  data: dict[str, Any], *, event: SliceChanged | None = None, reason: str | None = None) -> None:
        self._write(lambda: self._store.put_slice(name, job_id, provider, accelerator, tier, state, data,
                                                  event=event, reason=reason))


def os_fault(path: Path | str, e: OSError) -> StoreFaultError:
    """A file of the state directory that could not be written, as the store's fault."""
    cause = {errno.ENOSPC: "disk full", errno.EDQUOT: "disk full", errno.EROFS: "read-only",
             errno.EACCES: "read-only", errno.EPERM: "read-only"}.get(e.errno or 0, "I/O error")
    return StoreFaultError(path, cause, e.strerror or str(e))
