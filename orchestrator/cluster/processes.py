"""The processes of local nodes: each node is a session of its own, found, checked and stopped whole.

A node is started as a new session (its id is recorded); Ray gives each worker process a
process group of its own inside it, so the session, not the group, is what goes with a
host. Before anything is signalled, the session is checked to be ours (`session_is_ours`).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

from orchestrator.cluster.home import Home, node_mark
from orchestrator.errors import ClusterError
from workers.reaper import carrying, terminate

log = logging.getLogger(__name__)


def session_pids(sid: int) -> list[int]:
    """Every live process of a node's session.

    A node is started as a new session; Ray gives each worker process its own process
    group inside it, so the session, not the group, is what dies with a host.
    """
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        state, session = fields[0], int(fields[3])
        if session == sid and state != "Z":
            pids.append(int(entry))
    return pids


def group_alive(pgid: int) -> bool:
    """Whether any process of the node started as session `pgid` is still running."""
    return bool(session_pids(pgid))


# A process id written down earlier (in state.db or cluster.json) may belong to another
# program by now: after a crash or a reboot the kernel hands the number out again. So a
# recorded session is ours only while one of its processes carries this home's node mark
# in its environment: every node this tool starts gets it (the raylet, its agents and its
# workers inherit it), nothing else does, and a process cannot take it on later. The mark
# is derived from the cluster's token, so another state directory's nodes differ too.
MARK_ENV = "ORCHESTRATOR_NODE_MARK"


_NODE_MODULES = {b"orchestrator.raynode", b"orchestrator.cluster.raynode"}  # before and after it moved


def _is_node(pid: int, mark: bytes, home_entry: bytes) -> bool:
    """Whether process `pid` carries the node mark, or is a node process of the same state
    directory started before nodes carried one (its command line and ORCHESTRATOR_HOME say so)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
        if mark in env:
            return True
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return bool(_NODE_MODULES & set(f.read().split(b"\0"))) and home_entry in env
    except OSError:  # gone, or not ours to read
        return False


def marked_pids(home: Home) -> list[int]:
    """Every live process but this one (of this user: others' environments cannot be read) carrying
    `home`'s node mark."""
    if not home.token_file.is_file():  # no node was ever started from it: nothing carries its mark
        return []
    return carrying(f"{MARK_ENV}={node_mark(home)}".encode())


def stop_marked(home: Home, *, grace_s: float = 3.0) -> list[int]:
    """End every process still carrying `home`'s node mark once its nodes are stopped: what a job's code
    started and hid from the nodes' sessions (a daemon that forked twice and left the session). SIGTERM,
    then SIGKILL after `grace_s`. Returns the ids signalled."""
    pids = terminate(lambda: marked_pids(home), grace_s)
    if pids:
        log.warning("ended %d process(es) left behind by the cluster's nodes (they carried its node mark): %s",
                    len(pids), ", ".join(map(str, pids)))
    return pids


def leftover_nodes(root: str | Path) -> list[int]:
    """The live processes of nodes started from any state directory under `root` (those with a token),
    found by their node mark: on a shared machine another user's nodes, or another run's, are not among them."""
    pids = set()
    for token in Path(root).rglob("auth_token"):
        try:
            pids.update(marked_pids(Home(token.parent)))
        except ClusterError:  # a token no cluster would start from (a link, others may read it): no node has its mark
            continue
    return sorted(pids)


def session_is_ours(home: Home, sid: int) -> bool:
    """Whether session `sid` is alive and is a node of `home`'s cluster (see `node_mark`)."""
    mark, home_entry = f"{MARK_ENV}={node_mark(home)}".encode(), f"ORCHESTRATOR_HOME={home.root}".encode()
    return any(_is_node(pid, mark, home_entry) for pid in session_pids(sid))


def _signal_session(sid: int, sig: int) -> None:
    for pid in session_pids(sid):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def stop_group(home: Home, pgid: int, *, grace_s: float = 5.0, hard: bool = False) -> list[int]:
    """Stop every process of a node (its session): SIGTERM, then SIGKILL after `grace_s` (or at once).

    ``hard=True`` is a host vanishing: raylet, agents and workers get SIGKILL together.
    Returns the ids left alone, as `stop_groups` does.
    """
    return stop_groups(home, [pgid], grace_s=grace_s, hard=hard)


def stop_groups(home: Home, pgids: list[int], *, grace_s: float = 5.0, hard: bool = False) -> list[int]:
    """`stop_group` for several nodes at once: all are signalled first, then waited for together.

    Only sessions that are `home`'s nodes are signalled (`session_is_ours`); a recorded id
    whose processes are another program's now is left alone, logged, and returned.
    """
    ours, foreign = [], []
    for pgid in pgids:
        if session_is_ours(home, pgid):
            ours.append(pgid)
        elif group_alive(pgid):
            foreign.append(pgid)
    for pgid in foreign:
        log.warning("left process group %d alone: it is recorded as a node of ours, but its processes do not "
                    "carry this cluster's node mark (the id was reused by another program)", pgid)
    for pgid in ours:
        _signal_session(pgid, signal.SIGKILL if hard else signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(group_alive(p) for p in ours):
        for pgid in ours:
            _reap(pgid)
        time.sleep(0.1)
    for pgid in ours:
        if group_alive(pgid):
            _signal_session(pgid, signal.SIGKILL)
        _reap(pgid)
    return foreign


def kill_host(home: Home, pgid: int) -> None:
    """A host vanishing: every process of the node, SIGKILL, at once (fault injection; ours only)."""
    if not session_is_ours(home, pgid):
        raise ClusterError(f"process group {pgid} is not a node of the cluster in {home.root}")
    _signal_session(pgid, signal.SIGKILL)


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
