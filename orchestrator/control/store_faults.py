"""Going on through a state store that cannot be written (a full disk, a read-only or deleted `state.db`).

The store raises `StoreFaultError` for a write the file system refuses. Here is what the
controller does about it, so that no driver dies of it and no job is left RUNNING forever:

- `StoreHealth` is the controller's memory of the fault: its cause, since when, how many
  writes wait. `status` and `logs` read it from the controller's metrics endpoint (the
  store itself cannot say it), and its log lines are rate-limited: one when the fault
  begins or its cause changes, one a minute while it lasts, one when it ends.
- Every write of the controller goes through `HeldWrites`, one writer thread that keeps them
  in order and tries a refused one again with backoff (tenacity) until the store takes it.
- A job's driver thread writes through `HoldingStore`, which waits for its write: the driver
  holds where it is, its workers train on (or stop at a committed step), and it picks up by
  itself. Workers' reports must not wait (they arrive on the controller's shared threads):
  their writes are put in the queue and written as soon as the store works.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import tenacity

from orchestrator.domain.shape import Shape
from orchestrator.errors import StoreFaultError
from orchestrator.state.batch import REFUSED_BEFORE_WRITING, BatchSpoiled
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


class _Write:
    """One write in the writer's queue: `done` is set once it is written (or failed) for a caller who waits."""

    __slots__ = ("write", "done", "result", "error")

    def __init__(self, write: Callable[[], Any], waited: bool):
        self.write = write
        self.done = threading.Event() if waited else None
        self.result: Any = None
        self.error: BaseException | None = None


class HeldWrites:
    """Every write of the controller's threads, in the order asked, by one writer thread of its own.

    `add` (a worker's report, which must not wait) puts a write in the queue and returns; `write` (a driver's)
    waits until its write is in the store and answers what it answered. The writer takes every write waiting
    and writes them in one transaction (`Store.batch`, when `batch` is given): at 1,000 jobs, one transaction
    a write was the controller's limit (about 200 a second, each driver waiting its turn behind every other
    job's step reports; `benchmarks/fleet.py`). A write the store refuses (`StoreFaultError`) stays first in
    the queue, with every write after it, and is tried again with backoff until the store takes it; its
    caller, if it waits, waits on. A write that fails otherwise (a refused transition, a bug of ours) fails
    alone: a waiting caller gets its error, and a report's is logged and dropped. The thread ends when the
    queue has been empty for `idle_s`, and starts again with the next write.
    """

    MOST_A_BATCH = 2000  # writes one transaction takes; the rest wait for the next

    def __init__(self, health: StoreHealth, batch: Callable[[], AbstractContextManager[Any]] | None = None, *,
                 first_wait_s: float = 0.2, max_wait_s: float = 10.0, idle_s: float = 2.0):
        self._health = health
        self._batch = batch
        self._first_wait_s, self._max_wait_s, self._idle_s = first_wait_s, max_wait_s, idle_s
        self._pending: deque[_Write] = deque()
        self._ready = threading.Condition()
        self._writer: threading.Thread | None = None

    def add(self, write: Callable[[], Any]) -> None:
        """Write `write()` after every write asked before it; at once, without waiting for it."""
        self._put(_Write(write, waited=False))

    def write(self, write: Callable[[], T]) -> T:
        """Write `write()` after every write asked before it, and answer what it answered (or raise what it
        raised); waits for as long as the store refuses it."""
        if threading.current_thread() is self._writer:  # a write made by a write: part of it
            return write()
        item = _Write(write, waited=True)
        self._put(item)
        assert item.done is not None
        item.done.wait()
        if item.error is not None:
            raise item.error
        answer: T = item.result
        return answer

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every write asked before this call is written (at most `timeout_s`); whether they are."""
        item = _Write(lambda: None, waited=True)
        self._put(item)
        assert item.done is not None
        return item.done.wait(timeout_s)

    def _put(self, item: _Write) -> None:
        with self._ready:
            self._pending.append(item)
            self._health.held = len(self._pending)
            if self._writer is None:
                self._writer = threading.Thread(target=self._run, name="store-writer", daemon=True)
                self._writer.start()
            self._ready.notify()

    def _run(self) -> None:
        while True:
            with self._ready:
                if not self._pending:
                    self._ready.wait(self._idle_s)
                if not self._pending:
                    self._writer = None
                    return
            try:  # a retrying loop only once the store refuses: making one each batch was a tenth of the process
                self._write_first()
            except StoreFaultError as e:
                self._health.failed(e)
                time.sleep(self._first_wait_s)  # then tried again, with backoff, until the store takes it
                write_through(self._health, self._write_first, first_wait_s=self._first_wait_s,
                              max_wait_s=self._max_wait_s)
            else:
                self._health.worked()

    def _write_first(self) -> None:
        """Write the first writes of the queue and take them out of it: all in one transaction if there is a
        batch and none of them fails after writing, else one at a time (each taken out once written).
        StoreFaultError if the store refuses one: it and those after it stay in the queue."""
        with self._ready:
            items = [self._pending[i] for i in range(min(len(self._pending), self.MOST_A_BATCH))]
        if self._batch is not None and len(items) > 1 and self._together(self._batch, items):
            self._taken(items)
            return
        for item in items:
            if self._batch is None:
                self._run_one(item)
            else:
                self._alone(self._batch, item)
            self._taken([item])

    def _together(self, batch: Callable[[], AbstractContextManager[Any]], items: list[_Write]) -> bool:
        """Whether `items` were written in one transaction (none failed after it may have written)."""
        try:
            with batch():
                for item in items:
                    self._run_one(item)
                    if item.error is not None and not isinstance(item.error, REFUSED_BEFORE_WRITING):
                        raise BatchSpoiled(item.error)
        except StoreFaultError:
            raise
        except Exception:  # noqa: BLE001 -- spoiled, or the transaction itself failed: one write at a time
            return False
        return True

    def _alone(self, batch: Callable[[], AbstractContextManager[Any]], item: _Write) -> None:
        """`item` in a transaction of its own: nothing of it is kept if it fails, as before the writer."""
        try:
            with batch():
                self._run_one(item)
                if item.error is not None:
                    raise BatchSpoiled(item.error)
        except BatchSpoiled:
            pass
        except StoreFaultError:
            raise
        except Exception as e:  # noqa: BLE001 -- its transaction failed (SQLite, not the disk): so did it
            item.error = e

    @staticmethod
    def _run_one(item: _Write) -> None:
        item.result, item.error = None, None
        try:
            item.result = item.write()
        except StoreFaultError:
            raise
        except Exception as e:  # noqa: BLE001 -- the write's own failure: its caller gets it, or it is logged
            item.error = e

    def _taken(self, items: list[_Write]) -> None:
        with self._ready:
            for _ in items:
                self._pending.popleft()
            self._health.held = len(self._pending)
        for item in items:
            if item.done is not None:
                item.done.set()
            elif item.error is not None:
                log.error("a held store write failed; it is dropped", exc_info=item.error)


class HoldingStore(JobStore):
    """The store as a job's driver thread writes it: reads as the store; a write waits until the store takes
    it (`HeldWrites.write`), after the writes held before it, so the job's records keep their order.

    Each method of `JobStore` is written out here: a read passes through, a write goes through `_write`.
    A method added to the Protocol and not here is abstract to the type checker (no HoldingStore can be
    made), and `tests/unit/test_store_protocol.py` fails: it calls every write of the Protocol on a store
    that refuses it once and checks that the write was held and tried again.
    """

    def __init__(self, store: JobStore, health: StoreHealth, held: HeldWrites):
        self._store, self._health, self._held = store, health, held

    def _write(self, write: Callable[[], T]) -> T:
        return self._held.write(write)

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
                  data: dict[str, Any], *, event: SliceChanged | None = None, reason: str | None = None,
                  at: float | None = None) -> None:
        self._write(lambda: self._store.put_slice(name, job_id, provider, accelerator, tier, state, data,
                                                  event=event, reason=reason, at=at))


def os_fault(path: Path | str, e: OSError) -> StoreFaultError:
    """A file of the state directory that could not be written, as the store's fault."""
    cause = {errno.ENOSPC: "disk full", errno.EDQUOT: "disk full", errno.EROFS: "read-only",
             errno.EACCES: "read-only", errno.EPERM: "read-only"}.get(e.errno or 0, "I/O error")
    return StoreFaultError(path, cause, e.strerror or str(e))
