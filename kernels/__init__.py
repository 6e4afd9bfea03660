"""Compute kernels for the trainer: Pallas TPU kernels, their XLA paths and references, dispatch.

One module per op, each in the same order (block sizes, public function, Pallas path with
its custom VJP and kernel bodies, XLA path, plain ``jax.numpy`` reference):

- `attention` (+ `attention_flash`, its Pallas path; `attention_mask`; `attention_chunked`): flash
  attention, causal / sliding window / packed segments / grouped-query heads, forward and backward.
- `norm`: fused RMSNorm and LayerNorm.
- `rope`: rotary position embedding with in-kernel angles.
- `moe` (+ `grouped_matmul`): top-k routed experts, dropless or with a capacity.
- `linear_scan`: ``h_t = a_t * h_{t-1} + b_t``, blocked and carried.
- `dispatch`: which implementation runs for ``implementation=None``; `sharding`: the Pallas
  paths per device under ``shard_map``.
- `hardware`: the one table of TPU chip facts (HBM, peak FLOP/s, VMEM), which the
  orchestrator's catalog reads too; `generations`: each chip's default blocks, and the rule that
  fits a block to any length; `blocks.KernelBlocks`: every op's block sizes in one record
  (a job's ``workload.kernel_blocks``); `shapes.check_shape`: what no path can run.

Every public op takes ``implementation="pallas" | "xla" | None`` (attention also
``"cudnn"``), is differentiable and jit-able, and imports nothing but JAX and NumPy.

The names below load on first use (PEP 562), so that the control plane can read
`kernels.hardware` without importing JAX.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names as the type checker sees them; at run time `__getattr__` loads them
    from kernels.attention import BlockSizes, attention, reference_attention
    from kernels.blocks import KernelBlocks
    from kernels.grouped_matmul import GroupedMatmulBlockSizes, grouped_matmul
    from kernels.linear_scan import ScanBlockSizes, linear_scan
    from kernels.moe import moe_ffn
    from kernels.norm import NormBlockSizes, layer_norm, rms_norm
    from kernels.rope import RopeBlockSizes, apply_rope
    from kernels.shapes import ShapeProblem, UnsupportedShape, check_shape, shape_problems
    from kernels.sharding import sharded

__all__ = [
    "BlockSizes", "GroupedMatmulBlockSizes", "KernelBlocks", "NormBlockSizes", "RopeBlockSizes", "ScanBlockSizes",
    "ShapeProblem", "UnsupportedShape", "apply_rope", "attention", "check_shape", "grouped_matmul", "layer_norm",
    "linear_scan", "moe_ffn", "reference_attention", "rms_norm", "shape_problems", "sharded",
]

_HOMES = {  # each public name: the module that defines it
    name: module for module, names in {
        "kernels.attention": ("BlockSizes", "attention", "reference_attention"),
        "kernels.blocks": ("KernelBlocks",),
        "kernels.grouped_matmul": ("GroupedMatmulBlockSizes", "grouped_matmul"),
        "kernels.linear_scan": ("ScanBlockSizes", "linear_scan"),
        "kernels.moe": ("moe_ffn",),
        "kernels.norm": ("NormBlockSizes", "layer_norm", "rms_norm"),
        "kernels.rope": ("RopeBlockSizes", "apply_rope"),
        "kernels.shapes": ("ShapeProblem", "UnsupportedShape", "check_shape", "shape_problems"),
        "kernels.sharding": ("sharded",),
    }.items() for name in names
}


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use and kept."""
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value


class _Package(types.ModuleType):
    """Keeps `attention`, `grouped_matmul` and `linear_scan` the ops, not their modules.

    Importing a submodule binds it on its package under its own name; three ops share their
    module's name, and that binding would hide them from `__getattr__`.
    """

    def __setattr__(self, name: str, value: object) -> None:
        if name in _HOMES and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
