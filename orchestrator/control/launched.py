"""What one generation of a job's workers was started with: a frozen record, made once per launch."""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.domain.shape import Shape
from orchestrator.providers.base import Slice


@dataclass(frozen=True)
class Launch:
    generation: int
    slices: tuple[Slice, ...]  # in slice order: process ids are slice-major
    shape: Shape  # what the spec said at launch (type, tier, slices it goes on)
    memory_step: int | None = None  # restored from the survivors' memory (None: from storage, or fresh)

    def __post_init__(self) -> None:
        if not self.slices:
            raise ValueError(f"Launch.slices: generation {self.generation} is launched on no slice")

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
