"""A launch as the modules outside the job's loop read it: the budget and deadline (`limits`), profile
captures (`captures`) and compiling ahead (`compile_ahead`).

`Attempt` is a snapshot the driver makes when they ask (`JobDriver.view`); the one thing they may do
to the job is ask it to stop at a committed step (`stop_requested`, a notice-like stop request). The
job's live state has its own owners (`orchestrator.control.job`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from orchestrator.providers.base import Slice

if TYPE_CHECKING:
    from orchestrator.control.waiting import Waiting
    from workers.profiling import CaptureRequest


class CaptureHosts(Protocol):
    """What a snapshot's readers ask of the launch's workers (`captures`): a `group.WorkerGroup` is one. Named
    here, not imported, so the snapshot sits below the group in the imports."""

    hosts: int

    def request_profile(self, request: CaptureRequest) -> None: ...


@dataclass
class Attempt:
    generation: int = 0
    started: bool = False  # every host joined the runtime
    group: CaptureHosts | None = None  # the workers of `generation`, once launched
    notice: str | None = None  # why the workers were asked to stop, if they were
    resize_to: str | None = None  # where a planned relaunch goes (a resize, a move, a release, a regrow)
    slice: Slice | None = None  # the first (or only) slice
    others: list[Slice] = field(default_factory=list)  # a multi-slice job's other slices, in slice order
    waiting: Waiting | None = None  # a request waiting beside the slices
    last_step: int = -1  # newest step reported by worker 0 in this generation
    on_stop: Callable[[str], None] | None = None  # the driver's: a stop request

    @property
    def slices(self) -> list[Slice]:
        """Every slice the launch holds, in slice order (slice-major process ids)."""
        return [self.slice, *self.others] if self.slice is not None else []

    def stop_requested(self, reason: str) -> None:
        """Ask the workers to stop at a committed step (the first stop asked stands)."""
        if self.notice is None:
            self.notice = reason
            if self.on_stop is not None:
                self.on_stop(reason)
