"""Many writes in one transaction (`Store.batch`): what the batch holds, and the one statement its step rows take."""

from __future__ import annotations

import sqlite3
from typing import Any

from orchestrator.errors import FolderInUseError, IllegalTransitionError, JobNotFoundError

# What a write raises, by its own checks, before it has written anything: a batch it is part of stays good.
REFUSED_BEFORE_WRITING = (IllegalTransitionError, JobNotFoundError, FolderInUseError)
STEP_ROWS_A_STATEMENT = 1000  # 8 values a row: under SQLite's 32,766 bound parameters of one statement


class BatchSpoiled(Exception):
    """A write of a `Store.batch` failed after it may have written: nothing of the batch was committed."""


class Batch:
    """The transaction `Store.batch` holds open on one thread: the step rows written in it (put in by one
    statement before it commits) and whether a write in it failed after it may have written something."""

    def __init__(self) -> None:
        self.steps: list[tuple[Any, ...]] = []
        self.spoiled = False  # a write raised something other than REFUSED_BEFORE_WRITING: commit none of it


def insert_steps(db: sqlite3.Connection, values: list[tuple[Any, ...]] | Batch) -> None:
    """Step rows (a batch's, taken out of it) in as few statements as SQLite takes, in order: of one step written
    twice, the last row stays. One statement gives up Python's lock once, where one a row gave it up each time."""
    if isinstance(values, Batch):
        batch = values
        values, batch.steps = batch.steps, []
    for i in range(0, len(values), STEP_ROWS_A_STATEMENT):
        part = values[i:i + STEP_ROWS_A_STATEMENT]
        db.execute("INSERT OR REPLACE INTO steps (job_id, step, generation, loss, tokens_per_s, step_time_s, at, "
                   "metrics) VALUES " + ",".join(["(?,?,?,?,?,?,?,?)"] * len(part)), [v for row in part for v in row])
