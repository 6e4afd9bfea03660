"""The controller's side of the hosts' memory (`workers.memory`): a keeper per host of a multi-slice
job's slices, the step the survivors of a lost slice can all restore, and the keepers' end with their slice.

A keeper lives as long as its slice is held, across the generations of workers on it; it
goes when the slice is released (`Placement.teardown`), and with its host when the host goes.
"""

from __future__ import annotations

import logging
import time

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from orchestrator import cluster
from orchestrator.providers.base import Slice
from workers.memory import HostMemory, keeper_name

log = logging.getLogger(__name__)

ASK_S = 10.0  # how long a keeper has to say what it holds
SETTLE_S = 3.0  # how long the survivors' copies of the last step done may take to reach their keepers


def keepers(s: Slice, runtime_env: dict | None) -> list:
    """The keeper of each host of `s` (made on its host where there is none yet)."""
    out = []
    actor = ray.remote(HostMemory)
    for h in s.hosts:
        name = keeper_name(s.name, h.worker_id)
        try:
            out.append(ray.get_actor(name, namespace=cluster.NAMESPACE))
            continue
        except ValueError:
            pass
        if h.node_id is None:
            raise RuntimeError(f"host {h.worker_id} of slice {s.name} has not joined the cluster")
        out.append(actor.options(  # type: ignore[arg-type]  # ray types .remote() of an actor class as the handle or the class
            name=name, namespace=cluster.NAMESPACE, lifetime="detached", num_cpus=0, runtime_env=runtime_env,
            scheduling_strategy=NodeAffinitySchedulingStrategy(h.node_id, soft=False), get_if_exists=True).remote())
    return out


def common_step(slices: list[Slice], *, expect: int | None = None,
                settle_s: float = SETTLE_S) -> tuple[int | None, str]:
    """The newest step every host of `slices` holds in one layout, or None and why not. `expect`: the step
    they should hold (the last one done that the cadence copies); until they all do, asked again for up to
    `settle_s`. A copy goes to its keeper after its step is reported, and a loss seen at once (a worker's death
    wakes its driver) can be seen while the survivors' copy of the last step is still on its way: read then,
    the job restored one step back and did it again."""
    deadline = time.monotonic() + settle_s
    while True:
        step, why = _common_step(slices)
        if step is None or expect is None or step >= expect or time.monotonic() >= deadline:
            return step, why
        time.sleep(0.05)


def _common_step(slices: list[Slice]) -> tuple[int | None, str]:
    held: list[dict[int, str]] = []
    for s in slices:
        for h in s.hosts:
            try:
                keeper = ray.get_actor(keeper_name(s.name, h.worker_id), namespace=cluster.NAMESPACE)
                steps: dict[int, str] = ray.get(keeper.steps.remote(), timeout=ASK_S)  # type: ignore[assignment]
                held.append(steps)
            except Exception as e:  # noqa: BLE001 -- gone or not answering, however: this host holds nothing usable
                return None, f"host {h.worker_id} of slice {s.name} holds no copy ({type(e).__name__})"
    if not held:
        return None, "no host"
    shared = set(held[0].items())
    for other in held[1:]:
        shared &= set(other.items())
    if not shared:
        return None, "the hosts hold no step in common"
    return max(step for step, _ in shared), ""


def drop_keepers(s: Slice) -> None:
    """End the keepers of `s` (its copies go with them); idempotent."""
    if not ray.is_initialized():
        return
    for h in s.hosts:
        try:
            ray.kill(ray.get_actor(keeper_name(s.name, h.worker_id), namespace=cluster.NAMESPACE), no_restart=True)
        except Exception as e:  # noqa: BLE001 -- none, or gone with its host: nothing left to end
            log.debug("no keeper %s to end: %s", keeper_name(s.name, h.worker_id), e)
