"""What one generation of a job's workers was started with: a frozen record, made once per launch."""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.control.launch import LaunchPlan
from orchestrator.domain.shape import Shape
from orchestrator.providers.base import Slice


@dataclass(frozen=True)
class Launch:
    generation: int
    slices: tuple[Slice, ...]  # in slice order: process ids are slice-major
    shape: Shape  # what the spec said at launch (type, tier, slices it goes on)
    memory_step: int | None = None  # restored from the survivors' memory (None: from storage, or fresh)
    # What its hosts are handed, resolved once (`launch.launch_plan`); None: a group a restarted controller
    # adopted, which an earlier controller launched (its plan is in the store).
    plan: LaunchPlan | None = None

    def __post_init__(self) -> None:
        if not self.slices:
            raise ValueError(f"Launch.slices: generation {self.generation} is launched on no slice")
        if self.plan is not None and (self.plan.generation, self.plan.shape) != (self.generation, self.shape):
            raise ValueError(f"Launch.plan: generation {self.generation} on {self.shape.label} has the plan of "
                             f"generation {self.plan.generation} on {self.plan.shape.label}")

    @classmethod
    def of(cls, plan: LaunchPlan, slices: tuple[Slice, ...]) -> Launch:
        """The launch of `plan` on `slices`."""
        return cls(plan.generation, slices, plan.shape, plan.order.settings.memory_step, plan)

    @property
    def first(self) -> Slice:
        return self.slices[0]

    @property
    def hosts(self) -> int:
        return sum(s.tpu_type.hosts for s in self.slices)

    def slice_of(self, rank: int) -> str | None:
        """The name of the slice whose host `rank` is (ranks are slice-major)."""
        for s in self.slices:
            if rank < s.tpu_type.hosts:
                return s.name
            rank -= s.tpu_type.hosts
        return None
