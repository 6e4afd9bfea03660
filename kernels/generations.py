"""TPU chip generations as the kernels see them: the chip's VMEM limit (`kernels.hardware`), default blocks.

Vocabulary: a *generation* is the chip (v4, v5e, v5p, v6e), read from the device kind of
the devices the program is compiled for (`kernels.dispatch.target`: "TPU v4", "TPU v5 lite",
...), so a program compiled for a v5e topology on a CPU machine gets v5e's; its hardware, VMEM and the
Pallas calls' VMEM limit included, is the one table in `kernels.hardware`. Bigger blocks mean
fewer grid steps and larger MXU tiles, until they no longer fit in VMEM.

The block defaults follow public measurements of flash attention on TPU (128x128 tiles
reach a few percent of peak, 512 and more do far better) and the VMEM each generation has;
they are starting points, not figures measured here.

`fit_block` is the one rule by which every op turns a requested block into one that tiles
its array: a whole short axis, else the aligned block in ``[block / 2, block]`` that pads
the axis least (a divisor pads nothing). The ops pad to that length and mask or discard
the padding, so any length runs.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Literal

from jax.experimental.pallas import tpu as pltpu

from kernels import dispatch, hardware

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class KernelGeneration:
    """One chip generation's hardware and the kernels' default blocks on it."""

    chip: hardware.Chip
    attention: tuple[int, int, int, int]  # block_q, block_kv, block_q_bwd, block_kv_bwd
    norm_rows: int
    rope_seq: int
    scan: tuple[int, int]  # block_time, block_dim
    grouped_matmul: tuple[int, int, int]  # block_rows, block_k, block_n


GENERATIONS = {
    g.chip.name: g for g in [
        KernelGeneration(hardware.V4, (512, 512, 256, 512), 256, 256, (256, 512), (128, 512, 512)),
        KernelGeneration(hardware.V5E, (512, 1024, 512, 512), 512, 512, (512, 512), (256, 512, 1024)),
        KernelGeneration(hardware.V5P, (512, 1024, 512, 512), 512, 512, (512, 512), (256, 512, 1024)),
        KernelGeneration(hardware.V6E, (512, 1024, 512, 1024), 512, 512, (512, 512), (256, 1024, 1024)),
    ]
}
DEFAULT = "v4"  # off TPU (interpret mode ignores the limit) and for unknown kinds: the project's slices


def from_device_kind(device_kind: str) -> KernelGeneration:
    """The generation of a ``device_kind``; the default one (logged) for kinds this table lacks."""
    chip = hardware.from_device_kind(device_kind)
    if chip is None:
        if device_kind.startswith("TPU"):
            logger.warning("Unknown TPU device kind %r: using the %s kernel settings", device_kind, DEFAULT)
        return GENERATIONS[DEFAULT]
    return GENERATIONS[chip.name]


def current() -> KernelGeneration:
    """The generation of the devices compiled for (`kernels.dispatch.target`) on TPU, else the default."""
    target = dispatch.target()
    if target.platform != "tpu":
        return GENERATIONS[DEFAULT]
    return from_device_kind(target.device_kind)


Semantics = Literal["parallel", "arbitrary"]  # of one grid dimension: independent, or accumulating
PARALLEL: Semantics = "parallel"
ARBITRARY: Semantics = "arbitrary"


def compiler_params(dimension_semantics: tuple[Semantics, ...]) -> pltpu.CompilerParams:
    """Mosaic parameters of a Pallas call: its grid's semantics and this generation's VMEM limit."""
    return pltpu.CompilerParams(dimension_semantics=dimension_semantics,
                                vmem_limit_bytes=current().chip.vmem_limit_bytes)


@dataclasses.dataclass(frozen=True)
class BlockFit:
    """A block that tiles an axis, and the axis's length padded to a whole number of blocks."""

    block: int
    padded: int


def fit_block(length: int, block: int, *, align: int = 8) -> BlockFit:
    """The block for an axis of ``length`` when ``block`` is asked for.

    A length up to ``block`` is one whole block (a full axis needs no alignment on TPU).
    Longer axes get the multiple of ``align`` in ``[block / 2, block]`` whose padded
    length is least, the larger block on ties: 384 rows with 256 asked -> 192, no
    padding; 200 tokens with 128 asked -> 104, padded to 208.

    Raises:
      ValueError: ``block`` is not a positive multiple of ``align`` (the caller's setting).
    """
    if length < 1:
        raise ValueError(f"length must be positive, got {length=}")
    if block < 1 or block % align:
        raise ValueError(f"{block=} must be a positive multiple of {align}")
    if length <= block:
        return BlockFit(length, length)
    low = max(align, (block // 2) // align * align)
    best = min(range(low, block + 1, align), key=lambda b: (-(-length // b) * b, -b))
    return BlockFit(best, -(-length // best) * best)


def lane_align(block: int) -> int:
    """Alignment for a block on a TPU's lane (last) axis: 128 where the block is a multiple of it, else 8
    (blocks under 128 only run in interpret mode or on tiny models, where Mosaic pads the lanes)."""
    return 128 if block % 128 == 0 else 8
