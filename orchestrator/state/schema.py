"""The store's SQLite schema, its version, and how a store of an older version is brought up to it."""

from __future__ import annotations

import sqlite3

SCHEMA_VERSION = 5  # 2: steps.metrics; 3: jobs.cause; 4: jobs.folder; 5: jobs.shape

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    spec TEXT NOT NULL,
    state TEXT NOT NULL,
    reason TEXT NOT NULL DEFAULT '',
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    generation INTEGER NOT NULL DEFAULT 0,
    preemptions INTEGER NOT NULL DEFAULT 0,
    failures INTEGER NOT NULL DEFAULT 0,
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    error TEXT,
    result TEXT,
    cause TEXT,
    folder TEXT,  -- the checkpoint folder's key (`orchestrator.control.ownership.folder_key`)
    shape TEXT  -- where the job runs now, [accelerator, tier, slices]; NULL: as submitted
);
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id TEXT NOT NULL,
    at REAL NOT NULL,
    kind TEXT NOT NULL,
    from_state TEXT,
    to_state TEXT,
    reason TEXT NOT NULL,
    data TEXT
);
CREATE INDEX IF NOT EXISTS events_job ON events (job_id, seq);
CREATE INDEX IF NOT EXISTS events_kind_at ON events (kind, at);
CREATE TABLE IF NOT EXISTS steps (
    job_id TEXT NOT NULL,
    step INTEGER NOT NULL,
    generation INTEGER NOT NULL,
    loss REAL NOT NULL,
    tokens_per_s REAL,
    step_time_s REAL,
    at REAL NOT NULL,
    metrics TEXT,
    PRIMARY KEY (job_id, step)
);
CREATE TABLE IF NOT EXISTS slices (
    name TEXT PRIMARY KEY,
    job_id TEXT NOT NULL,
    provider TEXT NOT NULL,
    accelerator TEXT NOT NULL,
    tier TEXT NOT NULL,
    state TEXT NOT NULL,
    data TEXT NOT NULL,
    updated_at REAL NOT NULL
);
"""


def upgrade(db: sqlite3.Connection) -> None:
    """Add to a store of an older schema version what it lacks (in the caller's transaction)."""
    columns = {c[1] for c in db.execute("PRAGMA table_info(steps)")}
    if "metrics" not in columns:
        db.execute("ALTER TABLE steps ADD COLUMN metrics TEXT")
    jobs = {c[1] for c in db.execute("PRAGMA table_info(jobs)")}
    if "cause" not in jobs:
        db.execute("ALTER TABLE jobs ADD COLUMN cause TEXT")
    if "folder" not in jobs:
        db.execute("ALTER TABLE jobs ADD COLUMN folder TEXT")  # older jobs: NULL, claim no folder
    if "shape" not in jobs:
        db.execute("ALTER TABLE jobs ADD COLUMN shape TEXT")  # older jobs: their spec was rewritten


def bring_up(db: sqlite3.Connection, path: object) -> None:
    """In a write transaction on a store with the tables: its version recorded, or what an older one lacks added
    (RuntimeError for a store of a newer version than this one reads)."""
    row = db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
    if row is None:
        db.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
    elif int(row[0]) > SCHEMA_VERSION:
        raise RuntimeError(f"{path} has schema version {row[0]}; this version reads {SCHEMA_VERSION}")
    elif int(row[0]) < SCHEMA_VERSION:  # a store of an older version: add what it lacks
        upgrade(db)
        db.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(SCHEMA_VERSION),))
    db.execute("CREATE INDEX IF NOT EXISTS jobs_folder ON jobs (folder)")
