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

Every public op takes ``implementation="pallas" | "xla" | None`` (attention also
``"cudnn"``), is differentiable and jit-able, and imports nothing but JAX and NumPy.
"""

from kernels.attention import BlockSizes, attention, reference_attention
from kernels.grouped_matmul import GroupedMatmulBlockSizes, grouped_matmul
from kernels.linear_scan import ScanBlockSizes, linear_scan
from kernels.moe import moe_ffn
from kernels.norm import NormBlockSizes, layer_norm, rms_norm
from kernels.rope import RopeBlockSizes, apply_rope
from kernels.sharding import sharded

__all__ = [
    "BlockSizes", "GroupedMatmulBlockSizes", "NormBlockSizes", "RopeBlockSizes", "ScanBlockSizes",
    "apply_rope", "attention", "grouped_matmul", "layer_norm", "linear_scan", "moe_ffn", "reference_attention",
    "rms_norm", "sharded",
]
