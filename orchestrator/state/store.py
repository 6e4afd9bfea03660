"""The durable store: jobs, their events, per-step metrics and slices, in SQLite (WAL).

The only module that writes SQL, with `schema` (the tables and their upgrades) and `batch` (a batch's step
rows); the frozen records it returns are in `records`. Each state change is one transaction: a guarded
UPDATE that succeeds only from an allowed previous state, plus its event row, so a crash never leaves a
state without its event or the reverse. Readers (`status`, `logs` from another shell) never block the
controller's writes. `batch` makes every write of one thread one transaction (the controller's writer).

A write the file system refuses (a full disk, a read-only file) raises `StoreFaultError` with its cause,
and leaves the connection as it was before the write, so the same write can be tried again once there is
room. Every write first checks that the path still names the file this store opened (device and inode): a
`state.db` deleted or replaced while the cluster runs would otherwise take the controller's writes into a
file no one can read any more, and a reader would see a different history.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from orchestrator.domain.shape import Shape
from orchestrator.errors import FolderInUseError, IllegalTransitionError, JobNotFoundError, StoreFaultError
from orchestrator.state import store_file
from orchestrator.state.batch import REFUSED_BEFORE_WRITING, Batch, BatchSpoiled, insert_steps
from orchestrator.state.events import EventKind, Payload, SliceChanged, StateChange
from orchestrator.state.records import Event, JobRecord, SliceRow, StepMetric, event_from_row, job_from_row
from orchestrator.state.schema import SCHEMA, SCHEMA_VERSION, bring_up
from orchestrator.state.states import JOB_TRANSITIONS, JobState, SliceState, check_slice

# The records themselves are in `state.records`.
__all__ = ["SCHEMA_VERSION", "Event", "JobRecord", "SliceRow", "StepMetric", "Store"]

log = logging.getLogger(__name__)


class Store:
    def __init__(self, path: Path | str, *, create: bool = True):
        """The store at `path`, made there if it is not (unless `create` is False: StoreFaultError, "deleted")."""
        self.path = Path(path)
        if not create and not self.path.exists():
            raise StoreFaultError(self.path, "deleted", "the running cluster's store is gone from its path")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        store_file.set_aside_orphans(self.path)
        self._local = threading.local()
        self._writer_turn = store_file.writers(self.path)
        self._last_read: dict[str, tuple[tuple[str, str | None], JobRecord]] = {}  # `_parsed_once`
        if self._schema_version() != SCHEMA_VERSION:  # a store that is current is only read: it may be read-only
            self._create_or_upgrade()
        self._identity = store_file.identity(self.path)

    def _schema_version(self) -> int | None:
        try:
            row = self._conn().execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        except sqlite3.OperationalError:  # no meta table: a new store
            return None
        return int(row[0]) if row else None

    def _create_or_upgrade(self) -> None:
        self._conn().executescript(SCHEMA)  # idempotent; executescript commits on its own
        with self._tx(check=False) as db:
            bring_up(db, self.path)

    def _conn(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = store_file.connect(self.path)
        return conn

    @contextmanager
    def batch(self) -> Iterator[Batch]:
        """Every write this thread makes inside is one transaction, committed at the end; StoreFaultError if
        the file system refuses it (nothing of it is written). A write that raises inside leaves the batch
        good if it raised one of REFUSED_BEFORE_WRITING, else `spoiled`: nothing of it is committed
        (BatchSpoiled, if the block does not raise on its own), and its writes are best written one by one.
        With many threads writing, a transaction a write cost more than the writes: each statement gives up
        Python's lock and must win it back from the busy threads (the fleet benchmark)."""
        if self._open_batch() is not None:
            raise RuntimeError("a batch is already open on this thread")
        with self._tx() as db:
            batch = self._local.batch = Batch()
            try:
                yield batch
                if batch.spoiled:
                    raise BatchSpoiled("a write of the batch failed after it may have written: not committed")
                insert_steps(db, batch)
            finally:
                self._local.batch = None

    def _open_batch(self) -> Batch | None:
        batch: Batch | None = getattr(self._local, "batch", None)
        return batch

    @contextmanager
    def _tx(self, *, check: bool = True) -> Iterator[sqlite3.Connection]:
        """One write transaction; StoreFaultError if the file system refuses it (nothing of it is written).
        Inside this thread's `batch`, the batch's transaction.

        The writers of one process take turns on a lock of their own (`_writers`) before SQLite's: a
        writer that finds SQLite's lock taken sleeps in its busy handler, up to 100 ms a try, and with
        hundreds of drivers writing, a job's transition waited seconds for its turn (fleet benchmark)."""
        if (batch := self._open_batch()) is not None:
            try:
                yield self._conn()
            except REFUSED_BEFORE_WRITING:
                raise
            except BaseException:
                batch.spoiled = True
                raise
            return
        if check:
            self.check_writable()
        db = self._conn()
        with self._writer_turn:
            try:
                db.execute("BEGIN IMMEDIATE")
                yield db
                db.execute("COMMIT")  # inside: a commit refused for want of space is rolled back like the rest
            except BaseException as e:
                self._roll_back(db)
                fault = store_file.fault(self.path, e) if isinstance(e, sqlite3.Error) else None
                if fault is not None:
                    raise fault from e
                raise

    def _roll_back(self, db: sqlite3.Connection) -> None:
        if not db.in_transaction:
            return
        try:
            db.execute("ROLLBACK")
        except sqlite3.Error:  # a connection stuck in its transaction would refuse every later write: drop it
            db.close()
            self._local.conn = None

    def copy_to(self, dest: Path | str) -> None:
        """A consistent copy of the store, as this process reads it, at `dest` (SQLite's online backup): read
        through this process's open connection, so it works for a file deleted meanwhile."""
        with contextlib.closing(sqlite3.connect(dest)) as target:
            self._conn().backup(target)

    def check_writable(self) -> None:
        """StoreFaultError unless the path still names the file this store opened and it may be written."""
        store_file.check_writable(self.path, self._identity)

    # -- jobs ------------------------------------------------------------------

    def create_job(self, job_id: str, name: str, spec: dict[str, Any], *, reason: str = "submitted",
                   at: float | None = None, folder: str | None = None) -> JobRecord:
        """Record a new PENDING job. With `folder` (its checkpoint folder's key), only if no job that has
        not ended has the same: else FolderInUseError, and nothing is written (one transaction, so of two
        submits at the same moment one gets the folder)."""
        now = time.time() if at is None else at
        with self._tx() as db:
            if folder is not None and (holder := self._job_using(db, folder)) is not None:
                raise FolderInUseError(folder, holder.id, holder.state.value)
            db.execute(
                "INSERT INTO jobs (id, name, spec, state, reason, created_at, updated_at, folder) "
                "VALUES (?,?,?,?,?,?,?,?)",
                (job_id, name, json.dumps(spec), JobState.PENDING.value, reason, now, now, folder),
            )
            self._event(db, job_id, EventKind.STATE, None, JobState.PENDING.value, reason, None, now)
        return self.job(job_id)

    def job_using(self, folder: str) -> JobRecord | None:
        """The job not yet ended whose checkpoint folder has the key `folder`, if any."""
        return self._job_using(self._conn(), folder)

    @staticmethod
    def _job_using(db: sqlite3.Connection, folder: str) -> JobRecord | None:
        ended = [s.value for s in JobState if s.terminal]
        row = db.execute(f"SELECT * FROM jobs WHERE folder=? AND state NOT IN ({','.join('?' * len(ended))}) "
                         "ORDER BY created_at LIMIT 1", (folder, *ended)).fetchone()
        return job_from_row(row) if row else None

    def transition(self, job_id: str, target: JobState, reason: str, *, data: StateChange | None = None,
                   at: float | None = None, **fields: Any) -> JobRecord:
        """Move a job to `target` if its current state allows it, with an event; `fields` update columns too."""
        allowed_from = [s.value for s, nxt in JOB_TRANSITIONS.items() if target in nxt]
        now = time.time() if at is None else at
        with self._tx() as db:
            row = db.execute("SELECT state FROM jobs WHERE id=?", (job_id,)).fetchone()
            if row is None:
                raise JobNotFoundError(job_id)
            sets, args = self._field_sets(fields)
            cur = db.execute(
                f"UPDATE jobs SET state=?, reason=?, updated_at=?{sets} WHERE id=? AND state IN "
                f"({','.join('?' * len(allowed_from))})",
                (target.value, reason, now, *args, job_id, *allowed_from),
            )
            if cur.rowcount != 1:
                raise IllegalTransitionError("job", job_id, row["state"], target.value)
            self._event(db, job_id, EventKind.STATE, row["state"], target.value, reason,
                        data.to_data() if data else None, now)
        return self.job(job_id)

    def update_job(self, job_id: str, **fields: Any) -> None:
        sets, args = self._field_sets(fields)
        with self._tx() as db:
            db.execute(f"UPDATE jobs SET updated_at=?{sets} WHERE id=?", (time.time(), *args, job_id))

    def place(self, job_id: str, shape: Shape) -> None:
        """Record where the job runs now (a move, resize or the policy's choice); the spec stays as submitted."""
        with self._tx() as db:
            db.execute("UPDATE jobs SET shape=?, updated_at=? WHERE id=?",
                       (json.dumps([shape.accelerator, shape.tier, shape.count]), time.time(), job_id))

    def bump_generation(self, job_id: str) -> int:
        with self._tx() as db:
            db.execute("UPDATE jobs SET generation = generation + 1 WHERE id=?", (job_id,))
            return int(db.execute("SELECT generation FROM jobs WHERE id=?", (job_id,)).fetchone()[0])

    @staticmethod
    def _field_sets(fields: dict[str, Any]) -> tuple[str, list[Any]]:
        allowed = {"generation", "preemptions", "failures", "cancel_requested", "error", "result", "reason", "cause"}
        bad = set(fields) - allowed
        if bad:
            raise ValueError(f"not job fields: {sorted(bad)}")
        args = [json.dumps(v) if k == "result" and v is not None else v for k, v in fields.items()]
        return "".join(f", {k}=?" for k in fields), args

    def job(self, job_id: str) -> JobRecord:
        row = self._conn().execute("SELECT * FROM jobs WHERE id=?", (job_id,)).fetchone()
        if row is None:
            raise JobNotFoundError(job_id)
        return self._parsed_once(row)

    def _parsed_once(self, row: sqlite3.Row) -> JobRecord:
        """The job of `row`, with the spec's JSON and typed spec of the last record of it read here if its stored
        spec and shape are the same text (specs are frozen): a driver reads its job several times a poll, and
        validating the spec each time was a tenth of the controller's time with hundreds of jobs (the fleet
        benchmark), parsing its JSON each time 5% at 1,000. Never validated here: a record whose spec is not
        read validates nothing, and one that cannot be validated fails where it is read, as before."""
        key = (row["spec"], row["shape"])
        last = self._last_read.get(row["id"])
        same = last is not None and last[0] == key
        job = job_from_row(row, same_spec_as=last[1] if last is not None and same else None)
        if last is not None and same and "spec" in vars(last[1]):
            vars(job)["spec"] = vars(last[1])["spec"]  # the cached_property's own slot
        else:
            self._last_read[row["id"]] = (key, job)
        return job

    def jobs(self, *, active_only: bool = False) -> list[JobRecord]:
        """Every job, oldest first; with `active_only`, those not ended (filtered in SQL: the queue asks often)."""
        q, args = "SELECT * FROM jobs", []
        if active_only:
            ended = [s.value for s in JobState if s.terminal]
            q, args = q + f" WHERE state NOT IN ({','.join('?' * len(ended))})", ended
        return [job_from_row(r) for r in self._conn().execute(q + " ORDER BY created_at", args).fetchall()]

    def find_job(self, prefix: str) -> JobRecord:
        """A job by id or unique id prefix or unique name (the most recent job of that name).

        The prefix is matched character for character (`_` and `%` are no wildcards here).
        """
        if not prefix:
            raise JobNotFoundError(prefix)
        db = self._conn()
        row = db.execute("SELECT * FROM jobs WHERE id=?", (prefix,)).fetchone()
        if row is None:
            rows = db.execute("SELECT * FROM jobs WHERE substr(id, 1, ?) = ? ORDER BY created_at",
                              (len(prefix), prefix)).fetchall()
            if len(rows) != 1:
                rows = db.execute("SELECT * FROM jobs WHERE name=? ORDER BY created_at", (prefix,)).fetchall()
            if not rows:
                raise JobNotFoundError(prefix)
            row = rows[-1]
        return job_from_row(row)

    # -- events and metrics ----------------------------------------------------

    def add_event(self, job_id: str, event: Payload, reason: str, *, at: float | None = None) -> None:
        """Record `event` (its kind is its record's) with a human reason."""
        with self._tx() as db:
            self._event(db, job_id, event.KIND, None, None, reason, event.to_data(), time.time() if at is None else at)

    def import_event(self, job_id: str, kind: EventKind | str, reason: str, data: dict[str, Any] | None = None, *,
                     at: float | None = None) -> None:
        """Record an event from its stored form (replaying a recorded history); the kind must be known."""
        with self._tx() as db:
            self._event(db, job_id, EventKind(kind), None, None, reason, data, time.time() if at is None else at)

    @staticmethod
    def _event(db: sqlite3.Connection, job_id: str, kind: EventKind, from_state: str | None, to_state: str | None,
               reason: str, data: dict[str, Any] | None, at: float) -> None:
        db.execute(
            "INSERT INTO events (job_id, at, kind, from_state, to_state, reason, data) VALUES (?,?,?,?,?,?,?)",
            (job_id, at, kind.value, from_state, to_state, reason, json.dumps(data) if data else None),
        )

    def events(self, job_id: str, *, after_seq: int = 0, kind: EventKind | None = None) -> list[Event]:
        """The job's events in order (only those of `kind`, if given)."""
        q, args = "SELECT * FROM events WHERE job_id=? AND seq>?", [job_id, after_seq]
        if kind is not None:
            q, args = q + " AND kind=?", [*args, kind.value]
        return [event_from_row(r) for r in self._conn().execute(q + " ORDER BY seq", args).fetchall()]

    def last_event(self, job_id: str, kind: EventKind, *, to_state: JobState | None = None) -> Event | None:
        """The job's newest event of `kind` (for state changes, into `to_state` if given), or None: one row read,
        where `events` reads them all (`orchestrator list` reads a few of these for every job)."""
        q, args = "SELECT * FROM events WHERE job_id=? AND kind=?", [job_id, kind.value]
        if to_state is not None:
            q, args = q + " AND to_state=?", [*args, to_state.value]
        row = self._conn().execute(q + " ORDER BY seq DESC LIMIT 1", args).fetchone()
        return event_from_row(row) if row is not None else None

    def slice_events(self, *, since: float, exclude_job: str | None = None, after_seq: int = 0) -> list[Event]:
        """Slice events of every job since `since` (but `exclude_job`'s; only those after `after_seq`), oldest
        first: the capacity memory pooled across jobs (slice events outlive their job)."""
        rows = self._conn().execute(
            "SELECT * FROM events WHERE kind=? AND at>=? AND job_id!=? AND seq>? ORDER BY at, seq",
            (EventKind.SLICE.value, since, exclude_job or "", after_seq)).fetchall()
        return [event_from_row(r) for r in rows]

    def record_steps(self, job_id: str, generation: int, rows: list[tuple[Any, ...]], *,
                     at: float | None = None) -> None:
        """Upsert (step, loss, tokens/s, step time[, at[, metrics]]) rows; a recomputed step keeps the newest
        generation's value. A row without its own time gets `at` (default now)."""
        now = time.time() if at is None else at
        values = []
        for row in rows:
            step, loss, tps, dt, row_at, metrics = (*row, None, None)[:6]
            values.append((job_id, step, generation, loss, tps, dt, now if row_at is None else row_at,
                           json.dumps(metrics) if metrics else None))
        if (batch := self._open_batch()) is not None:
            batch.steps.extend(values)  # with the batch's other rows, in one statement
        else:
            with self._tx() as db:
                insert_steps(db, values)

    def _written_steps(self) -> sqlite3.Connection:
        """The connection to read steps on, with this thread's batch's step rows put in first."""
        db = self._conn()
        if (batch := self._open_batch()) is not None and batch.steps:
            insert_steps(db, batch)
        return db

    def steps(self, job_id: str) -> list[StepMetric]:
        rows = self._written_steps().execute(
            "SELECT step, generation, loss, tokens_per_s, step_time_s, at, metrics FROM steps WHERE job_id=? "
            "ORDER BY step", (job_id,)).fetchall()
        return [StepMetric.from_row(r) for r in rows]

    def steps_written_after(self, job_id: str, row: int = 0) -> tuple[list[StepMetric], int]:
        """The job's step rows written after the write numbered `row` (0: all of them), in write order, and the
        number to pass next time. A step written again (a recomputed step, a missed one filled in later) is a
        new write: its row is deleted and inserted afresh, and SQLite numbers the new row above every row in
        the table (nothing is ever deleted from it otherwise), so a reader that keeps what it read before
        misses nothing (`orchestrator.observe.metrics` reads running jobs' steps so on every scrape)."""
        rows = self._written_steps().execute(
            "SELECT rowid, step, generation, loss, tokens_per_s, step_time_s, at, metrics FROM steps "
            "WHERE job_id=? AND rowid>? ORDER BY rowid", (job_id, row)).fetchall()
        return [StepMetric.from_row(tuple(r)[1:]) for r in rows], max([row, *(r["rowid"] for r in rows)])

    def last_step(self, job_id: str) -> StepMetric | None:
        row = self._written_steps().execute(
            "SELECT step, generation, loss, tokens_per_s, step_time_s, at, metrics FROM steps WHERE job_id=? "
            "ORDER BY step DESC LIMIT 1", (job_id,)).fetchone()
        return StepMetric.from_row(row) if row else None

    # -- slices ----------------------------------------------------------------

    def put_slice(self, name: str, job_id: str, provider: str, accelerator: str, tier: str, state: str,
                  data: dict[str, Any], *, event: SliceChanged | None = None, reason: str | None = None,
                  at: float | None = None) -> None:
        """Record a slice's state (and `event` about it, in the same transaction).

        The slice lifecycle is enforced here: a new slice starts REQUESTED (or is recorded
        RELEASED), and a change must be allowed by `SLICE_TRANSITIONS`, else
        IllegalTransitionError and nothing is written. The same state again updates `data`.
        `at`: when the provider saw it (default now; the controller writes it a moment later).
        """
        target = SliceState(state)
        now = time.time() if at is None else at
        with self._tx() as db:
            row = db.execute("SELECT state FROM slices WHERE name=?", (name,)).fetchone()
            if row is None and target not in (SliceState.REQUESTED, SliceState.RELEASED):
                raise IllegalTransitionError("slice", name, "(new)", target.value)
            if row is not None and row["state"] != target.value:
                check_slice(name, SliceState(row["state"]), target)
            db.execute("INSERT OR REPLACE INTO slices VALUES (?,?,?,?,?,?,?,?)",
                       (name, job_id, provider, accelerator, tier, state, json.dumps(data), now))
            if event is not None:
                self._event(db, job_id, event.KIND, None, None, reason or f"slice {name} {state}",
                            event.to_data(), now)

    def slices(self, *, job_id: str | None = None, live_only: bool = False) -> list[SliceRow]:
        q, args = "SELECT * FROM slices", []
        if job_id is not None:
            q, args = q + " WHERE job_id=?", [job_id]
        out = [SliceRow(r["name"], r["job_id"], r["provider"], r["accelerator"], r["tier"], SliceState(r["state"]),
                           json.loads(r["data"]), r["updated_at"]) for r in self._conn().execute(q, args).fetchall()]
        return [s for s in out if not s.state.terminal] if live_only else out
