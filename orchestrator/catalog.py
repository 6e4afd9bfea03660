"""The TPU accelerator catalog: the accelerator types a job may ask for, their shapes and list prices.

Vocabulary (as in Google's Cloud TPU docs):

- accelerator type: the name a user asks for, such as ``v4-32``. For v4 and v5p the
  number counts TensorCores (two per chip), so ``v4-32`` is 16 chips; for v5e
  (``v5litepod-N``) and v6e it counts chips.
- host: one TPU VM; multi-host slices have 4 chips per host.
- topology: the chips' physical arrangement, ``2x2x4`` for a v4-32.
- tier: ``spot`` (preemptible, cheapest), ``on-demand``, or ``reserved`` (capacity
  held by a reservation, billed at the on-demand rate unless a commitment applies).

The chips' hardware (TensorCores, HBM, peak bf16 FLOP/s) is the one table in
`kernels.hardware`, which the kernels read too; its docstring cites the sources. Prices: the
Cloud TPU pricing page, list prices as seen in 2026 for us-central regions. Spot prices vary
by region; where a range was listed we keep both ends and plan with the high end, so cost
estimates err on the expensive side.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kernels import hardware
from orchestrator.errors import UnknownAcceleratorError


class Tier(str, enum.Enum):
    SPOT = "spot"
    ON_DEMAND = "on-demand"
    RESERVED = "reserved"


@dataclass(frozen=True)
class Generation:
    """A chip generation as the catalog sells it: its hardware and its list prices."""

    chip: hardware.Chip
    ondemand_usd_per_chip_hour: float
    spot_usd_per_chip_hour: tuple[float, float]  # (low, high) across us-central regions
    counts_tensorcores: bool  # whether the number in the type name counts TensorCores


V4 = Generation(hardware.V4, 3.22, (0.92, 0.92), True)
V5E = Generation(hardware.V5E, 1.20, (0.21, 0.78), False)
V5P = Generation(hardware.V5P, 4.20, (1.35, 2.40), True)
V6E = Generation(hardware.V6E, 2.70, (0.65, 1.89), False)


@dataclass(frozen=True)
class TpuType:
    """One accelerator type: a slice shape that can be requested as a whole."""

    name: str
    generation: Generation
    chips: int
    hosts: int
    topology: str

    @property
    def chips_per_host(self) -> int:
        return self.chips // self.hosts

    @property
    def hbm_bytes_per_chip(self) -> int:
        return self.generation.chip.hbm_bytes

    @property
    def hbm_bytes(self) -> int:
        return self.chips * self.generation.chip.hbm_bytes

    @property
    def peak_bf16_flops_per_chip(self) -> float:
        """FLOP/s: the denominator of model FLOPs utilisation (MFU)."""
        return self.generation.chip.peak_bf16_tflops * 1e12

    @property
    def peak_bf16_tflops(self) -> float:
        return self.chips * self.generation.chip.peak_bf16_tflops

    def usd_per_chip_hour(self, tier: Tier | str) -> float:
        tier = Tier(tier)
        if tier is Tier.SPOT:
            return self.generation.spot_usd_per_chip_hour[1]
        return self.generation.ondemand_usd_per_chip_hour

    def usd_per_hour(self, tier: Tier | str) -> float:
        return self.chips * self.usd_per_chip_hour(tier)


def _t(name: str, gen: Generation, chips: int, hosts: int, topology: str) -> TpuType:
    return TpuType(name, gen, chips, hosts, topology)


CATALOG: dict[str, TpuType] = {
    t.name: t
    for t in [
        _t("v4-8", V4, 4, 1, "2x2x1"),
        _t("v4-16", V4, 8, 2, "2x2x2"),
        _t("v4-32", V4, 16, 4, "2x2x4"),
        _t("v4-64", V4, 32, 8, "2x4x4"),
        _t("v4-128", V4, 64, 16, "4x4x4"),
        _t("v5litepod-1", V5E, 1, 1, "1x1"),
        _t("v5litepod-4", V5E, 4, 1, "2x2"),
        _t("v5litepod-8", V5E, 8, 1, "2x4"),
        _t("v5litepod-16", V5E, 16, 4, "4x4"),
        _t("v5litepod-32", V5E, 32, 8, "4x8"),
        _t("v5litepod-64", V5E, 64, 16, "8x8"),
        _t("v5p-8", V5P, 4, 1, "2x2x1"),
        _t("v5p-16", V5P, 8, 2, "2x2x2"),
        _t("v5p-32", V5P, 16, 4, "2x2x4"),
        _t("v5p-64", V5P, 32, 8, "2x4x4"),
        _t("v5p-128", V5P, 64, 16, "4x4x4"),
        _t("v6e-1", V6E, 1, 1, "1x1"),
        _t("v6e-4", V6E, 4, 1, "2x2"),
        _t("v6e-8", V6E, 8, 1, "2x4"),
        _t("v6e-16", V6E, 16, 4, "4x4"),
        _t("v6e-32", V6E, 32, 8, "4x8"),
        _t("v6e-64", V6E, 64, 16, "8x8"),
    ]
}


def lookup(name: str) -> TpuType:
    """The catalog entry for `name`; an unknown name raises with the valid ones listed."""
    try:
        return CATALOG[name]
    except KeyError:
        raise UnknownAcceleratorError(name, list(CATALOG)) from None


def same_generation(t: TpuType) -> list[TpuType]:
    """Every type of `t`'s generation, smallest first (the sizes a job may move between)."""
    return sorted((x for x in CATALOG.values() if x.generation is t.generation), key=lambda x: x.chips)
