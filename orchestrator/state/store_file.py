"""The store's file as the file system has it: orphaned write-ahead logs set aside, the file's identity, which
SQLite errors are the file system refusing a write, and the lock this process's writers take turns on."""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from pathlib import Path

from orchestrator.errors import StoreFaultError

log = logging.getLogger(__name__)

_WRITERS: dict[Path, threading.RLock] = {}
_WRITERS_LOCK = threading.Lock()


def writers(path: Path) -> threading.RLock:
    """The lock this process's writers of the store at `path` take turns on (every `Store` of it shares one)."""
    with _WRITERS_LOCK:
        return _WRITERS.setdefault(path.resolve(), threading.RLock())


def set_aside_orphans(path: Path) -> None:
    """A write-ahead log (``-wal``) and its index (``-shm``) with no database beside them are what a
    store deleted under a running controller leaves (it holds them open). SQLite would take them
    for the new store's and fail every open with "disk I/O error", `down` included; they hold
    nothing a store can use (the controller wrote what it had to ``.rescued``), so they go aside."""
    if path.exists():
        return
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    for suffix in ("-wal", "-shm"):
        orphan = path.with_name(path.name + suffix)
        if orphan.exists():
            aside = orphan.with_name(f"{orphan.name}.orphaned-{stamp}")
            os.replace(orphan, aside)
            log.warning("%s has no database beside it (the store was deleted): moved to %s", orphan, aside)


def connect(path: Path) -> sqlite3.Connection:
    """A connection to the store (one a thread): WAL, commits synced at checkpoints, 30 s for SQLite's lock."""
    conn = sqlite3.connect(path, timeout=30, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute("PRAGMA busy_timeout=30000")
    conn.row_factory = sqlite3.Row
    return conn


def identity(path: Path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


# SQLite's primary result codes (an extended code's low byte) that mean the file system refused a write.
FAULTS = {13: "disk full", 8: "read-only", 10: "I/O error", 14: "cannot open"}


def fault(path: Path, e: sqlite3.Error) -> StoreFaultError | None:
    cause = FAULTS.get((getattr(e, "sqlite_errorcode", None) or 0) & 0xFF)
    return StoreFaultError(path, cause, str(e)) if cause else None


def check_writable(path: Path, opened: tuple[int, int]) -> None:
    """StoreFaultError unless `path` still names the file opened as `opened` (`identity`) and may be written."""
    try:
        now = identity(path)
    except FileNotFoundError:
        raise StoreFaultError(path, "deleted", "the file was removed while the cluster had it open; "
                                               "writes to it would reach no reader") from None
    if now != opened:
        raise StoreFaultError(path, "replaced", f"another file is at this path now (inode {now[1]}, "
                                                f"opened as inode {opened[1]})")
    if not os.access(path, os.W_OK):
        raise StoreFaultError(path, "read-only", "permission to write the file is denied")
