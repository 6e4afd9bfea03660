"""Every process a job's code starts on a host ends with the job's worker there.

A daemon that forks twice and leaves its session is reached by no process group or
session kill, and once its parent is gone it belongs to no one. So `guard`, before the
job's code runs:

- makes the worker a child subreaper (Linux `PR_SET_CHILD_SUBREAPER`): an orphan of
  anything the job's code starts is handed to the worker, not to init, so every such
  process stays a descendant of the worker however it forked;
- puts a mark of the worker's own in its environment (`JOB_MARK_ENV`), which every
  program the job's code executes inherits (a process that only forks keeps the
  environment it was exec'd with: for it, the first point is what counts);
- starts a watcher beside the worker, in a session of its own and without the mark.
  It notes the worker's descendants twice a second; once the worker's process is gone
  (the job ended, was torn down, or the process died) it ends those it noted and every
  process that carries the mark (SIGTERM, then SIGKILL), then exits itself.

What escapes both (a process forked in the last half second that never executes a
program) still carries the node mark, which `orchestrator down` ends.

Stdlib only: the watcher runs as `python reaper.py PID START MARK`, outside Ray.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable

JOB_MARK_ENV = "ORCHESTRATOR_JOB_MARK"
POLL_S = 0.5
GRACE_S = 3.0
PR_SET_CHILD_SUBREAPER = 36


def _start_time(pid: int) -> str | None:
    """The process's start time (field 22 of /proc/PID/stat), which tells it from a later process of the same id."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _stat(pid: str) -> tuple[int, str] | None:
    """(parent id, start time) of a process, from /proc/PID/stat."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[1]), fields[19]
    except (OSError, IndexError, ValueError):
        return None


def descendants(pid: int) -> dict[int, str]:
    """The live descendants of process `pid`, each with its start time."""
    children: dict[int, list[tuple[int, str]]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (st := _stat(name)) is not None:
            children.setdefault(st[0], []).append((int(name), st[1]))
    out, todo = {}, [pid]
    while todo:
        for child, started in children.get(todo.pop(), []):
            if child not in out:
                out[child] = started
                todo.append(child)
    return out


def carrying(entry: bytes) -> list[int]:
    """The live processes of this host (readable by this user), other than this one, whose environment
    holds `entry` (``b"NAME=value"``)."""
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if entry in f.read().split(b"\0"):
                    pids.append(int(name))
        except OSError:
            continue
    return pids


def marked(mark: str) -> list[int]:
    """The live processes of this host (readable by this user) that carry `mark` in their environment."""
    return carrying(f"{JOB_MARK_ENV}={mark}".encode())


def terminate(left: Callable[[], list[int]], grace_s: float) -> list[int]:
    """SIGTERM the processes `left()` names, then SIGKILL those it still names after `grace_s`.
    Returns the ids first signalled."""
    pids = left()
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError:
            pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and left():
        time.sleep(0.1)
    for pid in left():
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return pids


def end(noted: dict[int, str], mark: str, grace_s: float = GRACE_S) -> list[int]:
    """SIGTERM the `noted` processes that are still those (same start time) and every process carrying
    `mark`; SIGKILL those left after `grace_s`. Returns the ids signalled."""
    return terminate(lambda: sorted({p for p, started in noted.items() if _start_time(p) == started}
                                    | set(marked(mark))), grace_s)


def guard(name: str) -> str | None:
    """Mark this process (what it starts from now on inherits the mark) and start the watcher that
    ends the marked processes once this one is gone. Returns the mark; None where there is no /proc."""
    started = _start_time(os.getpid())
    if started is None:
        return None
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the mark still reaches what the job's code executes
        pass
    mark = f"{name}-{secrets.token_hex(6)}"
    os.environ[JOB_MARK_ENV] = mark
    env = {k: v for k, v in os.environ.items() if k != JOB_MARK_ENV}
    try:
        subprocess.Popen([sys.executable, os.path.abspath(__file__), str(os.getpid()), started, mark], env=env,
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True, close_fds=True)
    except OSError:  # no watcher: the job's processes still end with `orchestrator down` (the node mark)
        return None
    return mark


def watch(pid: int, started: str, mark: str) -> None:
    """Note the descendants of worker `pid` until it is gone, then end them and the marked processes."""
    noted: dict[int, str] = {}
    while True:
        seen = descendants(pid)
        seen.pop(os.getpid(), None)  # the watcher is the worker's child too
        if _start_time(pid) != started:  # gone: what was seen this time may already be orphans of another
            break
        noted = {p: t for p, t in noted.items() if _start_time(p) == t} | seen
        time.sleep(POLL_S)
    end(noted, mark)


if __name__ == "__main__":
    watch(int(sys.argv[1]), sys.argv[2], sys.argv[3])
