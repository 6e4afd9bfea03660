"""Compute kernels for the trainer: Pallas TPU kernels, their XLA paths and references, dispatch.

One module per op, each in the same order (block sizes, public function, Pallas path with
its custom VJP and kernel bodies, XLA path, plain ``jax.numpy`` reference):

- `attention` (+ `attention_mask`, `attention_chunked`): flash attention, causal / sliding
  window / packed segments / grouped-query heads, forward and backward.
- `norm`: fused RMSNorm and LayerNorm.
- `rope`: rotary position embedding with in-kernel angles.
- `moe` (+ `grouped_matmul`): top-k routed experts, dropless or with a capacity.
- `linear_scan`: ``h_t = a_t * h_{t-1} + b_t``, blocked and carried.
- `dispatch`: which implementation runs for ``implementation=None``; `sharding`: the Pallas
  paths per device under ``shard_map``.
- `generations`: the TPU generation's VMEM limit and default blocks, and the rule that
  fits a block to any length; `blocks.KernelBlocks`: every op's block sizes in one record
  (a job's ``workload.kernel_blocks``); `shapes.check_shape`: what no path can run.

Every public op takes ``implementation="pallas" | "xla" | None`` (attention also
``"cudnn"``), is differentiable and jit-able, and imports nothing but JAX and NumPy.
"""

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
