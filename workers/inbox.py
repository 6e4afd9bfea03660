"""Where hosts send their reports: a small actor beside the controller, whose class the hosts can load.

A TPU VM has only the shipped packages (`workers`, `kernels`, `policies`). Ray gives a
process a usable handle to an actor only if it can import the actor's class, and the
controller's class lives in `orchestrator`, which hosts never get: a handle to it there
knows none of its methods. So hosts report to an `Inbox` (this module is shipped), which
runs on the controller's node and hands each report on to the controller by name. It is
detached and outlives a restarting controller; a report that finds no controller is
dropped, as it would be without the inbox (workers repeat their state with every step,
and a restarted controller reads their history).
"""

from __future__ import annotations

import ray

NAME = "inbox"


class Inbox:
    def __init__(self, controller: tuple[str, str]):
        self._name, self._namespace = controller
        self._controller: ray.actor.ActorHandle | None = None

    def report(self, job_id: str, generation: int, rank: int, report, lines: list[str]) -> None:
        """Hand a host's report to the controller and wait until it has taken it."""
        try:
            if self._controller is None:
                self._controller = ray.get_actor(self._name, namespace=self._namespace)
            ray.get(self._controller.report.remote(job_id, generation, rank, report, lines), timeout=30)
        except (ValueError, ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            self._controller = None  # restarting: look it up again for the next report

    def ping(self) -> str:
        return "ok"


def start(namespace: str, controller_name: str, node_id: str):
    """The inbox of the cluster's controller (created once, detached, on the controller's node)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return ray.remote(Inbox).options(
        name=NAME, namespace=namespace, lifetime="detached", get_if_exists=True, num_cpus=0, max_concurrency=64,
        max_restarts=-1, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote((controller_name, namespace))
