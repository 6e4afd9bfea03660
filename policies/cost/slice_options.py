"""What a job can run on, and how fast: a slice type in a tier and zone, with its price
and this job's throughput on it.

Before the job has measured its speed on a slice, `ScalingModel` predicts it from the
model's training FLOPs per token (`policies.model.shape.ModelShape.flops_per_token`)
and the chips' peak; `estimate_tokens_per_s` scales what the job measured on one size
to the others.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

SPOT = "spot"
ON_DEMAND = "on-demand"
RESERVED = "reserved"


@dataclass(frozen=True)
class Option:
    """One thing the job can run on: a slice type in a tier and zone, with its speed and price."""

    name: str  # accelerator type, e.g. "v4-32"
    chips: int
    hosts: int
    tier: str  # SPOT, ON_DEMAND or RESERVED
    usd_per_hour: float  # for the whole slice
    tokens_per_s: float  # this job's throughput on this slice
    zone: str = "default"

    @property
    def preemptible(self) -> bool:
        return self.tier == SPOT

    @cached_property
    def usd_per_token(self) -> float:
        return self.usd_per_hour / 3600 / self.tokens_per_s

    @property
    def label(self) -> str:
        return f"{self.name} {self.tier}"


@dataclass(frozen=True)
class ScalingModel:
    """Throughput before the job has measured it: tokens/s = chips x peak x MFU / FLOPs per token.

    MFU starts at `mfu_one_host` and loses a factor `efficiency_per_doubling` each time
    the host count doubles (more of each step goes to cross-host communication).
    """

    flops_per_token: float  # training FLOPs: `ModelShape.flops_per_token`
    peak_flops_per_chip: float
    mfu_one_host: float = 0.50
    efficiency_per_doubling: float = 0.94

    def mfu(self, hosts: int) -> float:
        return self.mfu_one_host * self.efficiency_per_doubling ** math.log2(max(hosts, 1))

    def tokens_per_s(self, chips: int, hosts: int) -> float:
        return chips * self.peak_flops_per_chip * self.mfu(hosts) / self.flops_per_token


def estimate_tokens_per_s(
    model: ScalingModel, chips: int, hosts: int, measured: Mapping[tuple[int, int], float] | None = None
) -> float:
    """Throughput on (chips, hosts): measured if the job ran there, else the model scaled to
    the nearest measured size (so a job that is slower than the model is slower everywhere)."""
    measured = measured or {}
    if (chips, hosts) in measured:
        return measured[(chips, hosts)]
    if not measured:
        return model.tokens_per_s(chips, hosts)
    (c, h), seen = min(measured.items(), key=lambda kv: abs(math.log2(kv[0][0] / chips)))
    return seen * model.tokens_per_s(chips, hosts) / model.tokens_per_s(c, h)
