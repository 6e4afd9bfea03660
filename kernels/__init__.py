"""Compute kernels: Pallas TPU kernels, their XLA references, and dispatch by backend."""

from kernels.attention import BlockSizes, attention, reference_attention
from kernels.norm import NormBlockSizes, layer_norm, rms_norm
from kernels.rope import RopeBlockSizes, apply_rope

__all__ = [
    "BlockSizes", "NormBlockSizes", "RopeBlockSizes",
    "apply_rope", "attention", "layer_norm", "reference_attention", "rms_norm",
]
