"""A generation's workers by name: what a controller, this one or one restarted, finds them by, where
its launch placed them, and how they are ended.

Workers and their placement group are detached actors named after their slice, generation and
rank (`orchestrator.control.group` launches them; `orchestrator.control.adoption` finds them again).
"""

from __future__ import annotations

import logging

import ray
from ray.util.placement_group import remove_placement_group

from orchestrator.state.events import EventKind
from orchestrator.state.store import Store

log = logging.getLogger(__name__)


def worker_name(slice_name: str, generation: int, rank: int) -> str:
    """The name a restarted controller finds a worker by (`orchestrator.control.adoption`)."""
    return f"{slice_name}-g{generation}-w{rank}"


def pg_name(slice_name: str, generation: int) -> str:
    """The name of a generation's placement group (after its first slice)."""
    return f"{slice_name}-g{generation}"


def kill_workers(workers: list, pg) -> None:
    """End `workers` (None: one already gone) and free `pg`, whatever is left of them."""
    for w in workers:
        if w is None:
            continue
        try:
            ray.kill(w, no_restart=True)
        except Exception as e:  # noqa: BLE001 -- already gone with its host: nothing left to end
            log.debug("worker already gone: %s", e)
    if pg is not None:
        try:
            remove_placement_group(pg)
        except Exception as e:  # noqa: BLE001 -- gone with the cluster or removed already: nothing left to free
            log.debug("placement group already gone: %s", e)


def where_placed(store: Store, job_id: str, generation: int) -> list[tuple[str, int]]:
    """(Ray node id, process id) of each rank's worker of `generation`, from its launch event."""
    for e in reversed(store.events(job_id)):
        data = e.data or {}
        if e.kind is EventKind.LAUNCHED and data.get("generation") == generation:
            # strict=False: a launch event of an older version may name nodes and no pids
            return list(zip(data.get("nodes") or [], data.get("pids") or [], strict=False))
    return []
