"""Admission: which waiting job may take hosts next, and where each one stands in line.

Jobs that share a pool of hosts (the local cluster's) wait in one line: higher
`priority` first, then the earlier submission. The line is strict: a job starts only
when it is first and its slice fits in the free hosts, so a large job is never passed
over forever by small ones behind it. Pure: a snapshot in, a decision out.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WaitingJob:
    """A job that waits for hosts (or is about to ask for them)."""

    job_id: str
    priority: int
    submitted_at: float
    hosts: int  # hosts its next slice needs


@dataclass(frozen=True)
class Admission:
    admit: bool
    position: int  # 1 = first in line
    reason: str


def line(waiting: list[WaitingJob]) -> list[WaitingJob]:
    """The waiting jobs in the order they are served."""
    return sorted(waiting, key=lambda w: (-w.priority, w.submitted_at, w.job_id))


def admit(waiting: list[WaitingJob], job_id: str, *, free_hosts: int, total_hosts: int) -> Admission:
    """Whether `job_id` (one of `waiting`) may ask for its slice now, with its place in line.

    `free_hosts`: hosts no slice holds now; `total_hosts`: all the pool has.
    """
    order = line(waiting)
    position = next(i for i, w in enumerate(order, 1) if w.job_id == job_id)
    me = order[position - 1]
    if me.hosts > total_hosts:  # waiting cannot help: let it ask, and the provider refuses it saying why
        return Admission(True, position, f"needs {_hosts(me.hosts)}, more than the {total_hosts} there are")
    if position > 1:
        first = order[0]
        return Admission(False, position, f"position {position} in the queue, behind {first.job_id} "
                                          f"(priority {first.priority}); {free_hosts} of {total_hosts} hosts free")
    if me.hosts > free_hosts:
        return Admission(False, 1, f"first in the queue; needs {_hosts(me.hosts)}, {free_hosts} of {total_hosts} "
                                   "free (the others are held by running jobs)")
    return Admission(True, 1, f"{_hosts(me.hosts)} of {free_hosts} free")


def _hosts(n: int) -> str:
    return f"{n} host" + ("" if n == 1 else "s")


def retry_after(refusals: int, jitter: float) -> float:
    """Seconds before asking a cloud again after its `refusals`-th refusal in a row.

    Doubles from 15 s to at most 5 minutes; `jitter` in [0, 1) takes up to half off, so
    jobs refused together do not come back together.
    """
    base = min(300.0, 15.0 * 2.0 ** max(0, refusals - 1))
    return base * (1.0 - 0.5 * jitter)
