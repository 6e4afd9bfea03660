"""Why a launch's worker process died: its host gone, or the process itself aborted.

A worker whose process is gone is asked about where it ran (`why_died`). Its Ray node dead, or a
task that cannot run there, is a host loss. Otherwise the host is up, and the end of the
process's stderr, read there by a task, says how it aborted (`workers.crash`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from policies.decisions.recovery import (
    WORKER_DIED,
    WORKER_UNREACHABLE,
    Outcome,
    OutcomeKind,
    native_error,
    telling_lines,
)
from workers.crash import stderr_tail

PROBE_S = 30.0  # how long a dead worker's host has to run a task (the answer that it is up, and the stderr)
ANSWER_S = 10.0  # how long a worker has to answer before it is taken as slow, not dead


@dataclass(frozen=True)
class Verdict:
    """What `why_died` found: the outcome; the rank it is about (None: no dead worker answered for), whether
    that rank's host is lost, and lines for the job's log as that host's own."""

    outcome: Outcome
    rank: int | None = None
    host_lost: bool = False
    log_lines: list[str] = field(default_factory=list)


def why_died(workers: list[Any], placed: list[tuple[str, int]], error_type: str) -> Verdict:
    """Ask about each dead worker of `workers` (rank order) where it ran (`placed`: each rank's Ray node id and
    process id). A host gone first, whichever rank died first: when one host goes, the others' processes abort
    (their collectives fail), and one of those can be the first seen dead."""
    at = time.time()
    dead = [rank for rank, w in enumerate(workers) if not _answers(w) and rank < len(placed)]
    alive_nodes = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    for rank in dead:
        node, _ = placed[rank]
        if node not in alive_nodes:
            return Verdict(Outcome(OutcomeKind.INFRA_LOST, f"host {rank} is gone (its Ray node {node[:12]} is dead)",
                                   at=at), rank=rank, host_lost=True)
    for rank in dead:
        node, pid = placed[rank]
        try:
            tail = ray.get(ray.remote(num_cpus=0, max_retries=0)(stderr_tail).options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(pid), timeout=PROBE_S)
        except Exception as e:  # noqa: BLE001 -- a host that cannot run a task, however, is as good as gone
            return Verdict(Outcome(OutcomeKind.INFRA_LOST, f"{WORKER_UNREACHABLE} (host {rank} runs no task: "
                                                           f"{type(e).__name__})", at=at), rank=rank, host_lost=True)
        said = telling_lines(tail or "")
        summary = native_error(tail) if tail is not None else "its stderr is not in its node's log folder"
        return Verdict(Outcome(OutcomeKind.WORKER_ABORTED, f"host {rank}'s worker process died, its host still up: "
                                                           f"{summary}", traceback="\n".join(said) or None, at=at),
                       rank=rank, log_lines=[f"its worker process died: {summary}", *said])
    return Verdict(Outcome(OutcomeKind.INFRA_LOST, f"{WORKER_DIED} ({error_type})", at=at))


def _answers(worker: Any) -> bool:
    try:
        ray.get(worker.info.remote(), timeout=ANSWER_S)
        return True
    except ray.exceptions.RayActorError:
        return False
    except ray.exceptions.GetTimeoutError:
        return True  # slow, not dead: the heartbeat decides
