"""Compute kernels: Pallas TPU kernels, their XLA references, and dispatch by backend."""

from kernels.attention import BlockSizes, attention, reference_attention
from kernels.norm import NormBlockSizes, layer_norm, rms_norm
from kernels.grouped_matmul import GroupedMatmulBlockSizes, grouped_matmul
from kernels.linear_scan import ScanBlockSizes, linear_scan
from kernels.moe import moe_ffn
from kernels.rope import RopeBlockSizes, apply_rope

__all__ = [
    "BlockSizes", "GroupedMatmulBlockSizes", "NormBlockSizes", "RopeBlockSizes", "ScanBlockSizes",
    "apply_rope", "attention", "grouped_matmul", "layer_norm", "linear_scan", "moe_ffn", "reference_attention",
    "rms_norm",
]
