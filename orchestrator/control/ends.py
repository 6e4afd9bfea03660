"""How a launch's workers ended, without asking each of them every look (`RayWorkerGroup.results`).

Each worker is asked once to answer when it ends (`HostWorker.wait_result`, for at most `END_WAIT_S`; then it is
asked again, so no call outlives a controller that went by long). A driver's look reads what has come back and
costs no call, and an answer (an end, or a worker gone) wakes the driver at once. A driver used to ask every
worker for its result each look, about 1.3 times a second: at a thousand jobs, thousands of actor calls a second
for nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import ray

from workers.protocol import WorkerResult

if TYPE_CHECKING:
    from ray.actor import ActorHandle

END_WAIT_S = 30.0  # the longest one call waits for its worker's end before it answers None and is made again


class WorkerEnds:
    """The outstanding `wait_result` call of each worker of a launch (rank order), and the ends come back."""

    def __init__(self, workers: list[ActorHandle], wake: threading.Event | None):
        self._workers, self._wake = workers, wake
        self._calls: list[Any] = [self._ask(w) for w in workers]
        self._ended: list[WorkerResult | None] = [None] * len(workers)

    @staticmethod
    def can_wait(workers: Sequence[ActorHandle | None]) -> bool:
        """Whether every worker can be asked to answer when it ends (a worker of an older version cannot; an
        adopted one found gone is None)."""
        return bool(workers) and all(w is not None and hasattr(w, "wait_result") for w in workers)

    def results(self) -> list[WorkerResult | None]:
        """Each worker's result, None for one still training; RayActorError if one is gone."""
        pending = [c for c, e in zip(self._calls, self._ended, strict=True) if e is None]
        if not pending:
            return list(self._ended)
        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=0)
        for call in ready:
            rank = self._calls.index(call)
            result = ray.get(call, timeout=0)  # a worker gone raises here, as a plain get would
            if result is None:  # still training after END_WAIT_S: asked again
                self._calls[rank] = self._ask(self._workers[rank])
            else:
                self._ended[rank] = result
        return list(self._ended)

    def _ask(self, worker: ActorHandle) -> Any:
        call: Any = worker.wait_result.remote(END_WAIT_S)
        if self._wake is not None:
            call.future().add_done_callback(lambda _answer, wake=self._wake: wake.set())
        return call
