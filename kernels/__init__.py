"""Compute kernels: Pallas TPU kernels, their XLA references, and dispatch by backend."""

from kernels.attention import BlockSizes, attention, reference_attention

__all__ = ["BlockSizes", "attention", "reference_attention"]
