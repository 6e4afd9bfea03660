"""A shape: what a job runs on, as one value (accelerator type, tier, and how many slices of it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    accelerator: str  # a catalog name, e.g. "v4-32"
    tier: str  # "spot" or "on-demand"
    count: int = 1  # slices of `accelerator`, data parallel across them

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError(f"Shape.count must be at least 1, got {self.count=}")

    @property
    def label(self) -> str:
        """How events and logs name it: "v4-32 spot", or "2xv4-16 spot" for several slices."""
        return f"{self.accelerator} {self.tier}" if self.count == 1 else f"{self.count}x{self.accelerator} {self.tier}"

    @property
    def key(self) -> tuple[str, str, int]:
        """As the cost policy takes it (`orchestrator.control.autoscaler.Key`)."""
        return self.accelerator, self.tier, self.count
