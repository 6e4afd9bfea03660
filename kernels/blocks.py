"""Every op's block sizes in one record, as a job file sets them and the model passes them on.

A field left None takes its op's default for the chip generation (`kernels.generations`).
The model hands each field to its op's ``block_sizes=``; the ops fit the blocks to the
actual lengths, so one setting serves every shape. In a job file::

    workload:
      kernel_blocks:
        attention: {block_q: 1024, block_kv: 1024, block_q_bwd: 512, block_kv_bwd: 512}
        norm: {block_rows: 512}
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from kernels.attention import BlockSizes
from kernels.grouped_matmul import GroupedMatmulBlockSizes
from kernels.linear_scan import ScanBlockSizes
from kernels.norm import NormBlockSizes
from kernels.rope import RopeBlockSizes


@dataclasses.dataclass(frozen=True)
class KernelBlocks:
    """Block sizes per op; None: the generation's default."""

    attention: BlockSizes | None = None
    norm: NormBlockSizes | None = None
    rope: RopeBlockSizes | None = None
    scan: ScanBlockSizes | None = None
    moe: GroupedMatmulBlockSizes | None = None

    @classmethod
    def from_mapping(cls, mapping: Mapping | None) -> KernelBlocks:
        """From plain data (``{"attention": {"block_q": 1024}, ...}``), each op's omitted sizes at their defaults.

        Raises:
          ValueError: an unknown op or size, or a bad value, named by its path
            (``kernel_blocks.attention.block_q: ...``).
        """
        if not mapping:
            return cls()
        kinds = {f.name: _OP_CLASSES[f.name] for f in dataclasses.fields(cls)}
        values = {}
        for op, sizes in mapping.items():
            if op not in kinds:
                raise ValueError(f"kernel_blocks.{op}: unknown op; valid: {', '.join(kinds)}")
            if sizes is None:
                continue
            if not isinstance(sizes, Mapping):
                raise ValueError(f"kernel_blocks.{op}: expected a mapping of block sizes, got {sizes!r}")
            names = [f.name for f in dataclasses.fields(kinds[op])]
            for name in sizes:
                if name not in names:
                    raise ValueError(f"kernel_blocks.{op}.{name}: unknown block size; valid: {', '.join(names)}")
            try:
                values[op] = kinds[op](**sizes)
            except (TypeError, ValueError) as error:
                raise ValueError(f"kernel_blocks.{op}: {error}") from None
        return cls(**values)


_OP_CLASSES = {"attention": BlockSizes, "norm": NormBlockSizes, "rope": RopeBlockSizes, "scan": ScanBlockSizes,
               "moe": GroupedMatmulBlockSizes}
