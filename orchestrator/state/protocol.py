"""The job store's interface, as its users call it: what it reads and what it writes.

`orchestrator.state.store.Store` (SQLite) is the one implementation that keeps anything;
`orchestrator.control.store_faults.HoldingStore` wraps it for a job's driver thread, holding
each write until the store takes it. Both are a `JobStore`. The split into `StoreReads` and
`StoreWrites` is what the wrapper needs: a write waits out a store that cannot be written,
a read does not. `WRITES` and `READS` name the members of each, taken from the classes, so
no list kept by hand can drift from them (`tests/unit/test_store_protocol.py` checks that
every public method of `Store` is one of the two and that `HoldingStore` holds every write).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from orchestrator.domain.shape import Shape
from orchestrator.state.events import EventKind, Payload, SliceChanged, StateChange
from orchestrator.state.states import JobState
from orchestrator.state.store import Event, JobRecord, SliceRow, StepMetric, Store


class StoreReads(Protocol):
    """What a store answers without writing; a store that cannot be written still answers these."""

    def job(self, job_id: str) -> JobRecord: ...

    def jobs(self, *, active_only: bool = False) -> list[JobRecord]: ...

    def find_job(self, prefix: str) -> JobRecord: ...

    def job_using(self, folder: str) -> JobRecord | None: ...

    def events(self, job_id: str, *, after_seq: int = 0, kind: EventKind | None = None) -> list[Event]: ...

    def last_event(self, job_id: str, kind: EventKind, *, to_state: JobState | None = None) -> Event | None: ...

    def slice_events(self, *, since: float, exclude_job: str | None = None, after_seq: int = 0) -> list[Event]: ...

    def steps(self, job_id: str) -> list[StepMetric]: ...

    def steps_written_after(self, job_id: str, row: int = 0) -> tuple[list[StepMetric], int]: ...

    def last_step(self, job_id: str) -> StepMetric | None: ...

    def slices(self, *, job_id: str | None = None, live_only: bool = False) -> list[SliceRow]: ...

    def copy_to(self, dest: Path | str) -> None:
        """A consistent copy elsewhere: a read of this store."""
        ...

    def check_writable(self) -> None:
        """StoreFaultError unless a write would be taken now: a question, so it is answered at once."""
        ...


class StoreWrites(Protocol):
    """What changes the store; each raises StoreFaultError while the file system refuses the write."""

    def create_job(self, job_id: str, name: str, spec: dict[str, Any], *, reason: str = "submitted",
                   at: float | None = None, folder: str | None = None) -> JobRecord: ...

    def transition(self, job_id: str, target: JobState, reason: str, *, data: StateChange | None = None,
                   at: float | None = None, **fields: Any) -> JobRecord: ...

    def update_job(self, job_id: str, **fields: Any) -> None: ...

    def place(self, job_id: str, shape: Shape) -> None: ...

    def bump_generation(self, job_id: str) -> int: ...

    def add_event(self, job_id: str, event: Payload, reason: str, *, at: float | None = None) -> None: ...

    def import_event(self, job_id: str, kind: EventKind | str, reason: str, data: dict[str, Any] | None = None, *,
                     at: float | None = None) -> None: ...

    def record_steps(self, job_id: str, generation: int, rows: list[tuple[Any, ...]], *,
                     at: float | None = None) -> None: ...

    def put_slice(self, name: str, job_id: str, provider: str, accelerator: str, tier: str, state: str,
                  data: dict[str, Any], *, event: SliceChanged | None = None, reason: str | None = None,
                  at: float | None = None) -> None: ...


class JobStore(StoreReads, StoreWrites, Protocol):
    """The whole store as its users see it."""


def _members(protocol: type) -> frozenset[str]:
    return frozenset(name for name, value in vars(protocol).items() if callable(value) and not name.startswith("_"))


READS: frozenset[str] = _members(StoreReads)
WRITES: frozenset[str] = _members(StoreWrites)


if TYPE_CHECKING:
    def _the_sqlite_store_is_one(store: Store) -> JobStore:  # the type checker holds Store to the Protocol
        return store
