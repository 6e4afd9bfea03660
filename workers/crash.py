"""What a worker process that died wrote last to its stderr, read on its own host.

A native abort (an XLA `Check failed`, a segfault in a kernel, the OOM killer) ends a
worker's process without a Python exception: nothing reaches the controller but Ray's
"the actor died". The process's stderr is a file in its node's Ray log folder
(``worker-<id>-<job>-<pid>.err``); the controller runs `stderr_tail` as a task on that
host, which also proves the host is up (`orchestrator.control.job.watch`).
"""

from __future__ import annotations

import os
from pathlib import Path

TAIL_BYTES = 16384
# How far back the lines that say what happened are looked for: Python's fatal-error dump of every thread's
# stack comes after them, and a Ray worker's threads can fill more than the tail.
SCAN_BYTES = 4 * 2**20


def stderr_tail(pid: int, max_bytes: int = TAIL_BYTES, scan_bytes: int = SCAN_BYTES) -> str | None:
    """The last `max_bytes` that worker process `pid` of this node wrote to its stderr ("" if nothing),
    after the lines before them, up to `scan_bytes` back, that say what happened
    (`policies.decisions.recovery.is_telling`: a C++ exception's what(), gloo's enforce failure, the
    signal); None when this node has no such file. Runs as a task on the node: its own stderr is a
    file of the same folder."""
    from policies.decisions.recovery import is_telling

    try:
        logs = Path(os.readlink("/proc/self/fd/2")).parent
    except OSError:
        return None
    files = sorted(logs.glob(f"worker-*-{int(pid)}.err"), key=lambda p: p.stat().st_mtime)
    if not files:
        return None
    with open(files[-1], "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - max(scan_bytes, max_bytes)))
        text = f.read().decode("utf-8", errors="replace")
    before, tail = text[:-max_bytes], text[-max_bytes:]
    said = [line for line in before.splitlines() if is_telling(line)]
    return "".join(f"{line}\n" for line in said) + tail
