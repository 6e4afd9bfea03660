"""TPU hardware facts: one frozen record per chip generation, the table the catalog and the kernels both read.

Vocabulary: a *chip generation* (v4, v5e, v5p, v6e) is named as the catalog's accelerator
types name it; JAX reports it as a *device kind* (``jax.devices()[0].device_kind``: "TPU v4",
"TPU v5 lite", ...). A chip has one or two *TensorCores*. *HBM* is the chip's memory; *VMEM*
is each TensorCore's on-chip vector memory that a Pallas block lives in, and the *VMEM limit*
how much of it Mosaic may use for one kernel (its buffers, double-buffered, and its scratch).

Sources: Google Cloud TPU documentation (the system architecture pages for v4, v5e, v5p and
v6e: TensorCores, HBM capacity and bandwidth, and peak bf16 FLOP/s per chip). HBM is kept in
bytes in the unit each page gives: v4's 32 GiB, and v5e's 16 GB, v5p's 95 GB and v6e's 32 GB
(decimal gigabytes). The VMEM sizes are those of JAX's own TPU table (``pltpu.get_tpu_info``);
the limit leaves an eighth to Mosaic's internal scratch, except on v4, whose 16 MiB per core is
already the compiler's default scope.

Plain data with no JAX import: the control plane reads it without loading an accelerator runtime.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Chip:
    """One chip generation's hardware; figures are per chip unless a comment says otherwise."""

    name: str  # as the accelerator types spell it: "v4", "v5e", "v5p", "v6e"
    device_kinds: tuple[str, ...]  # as JAX reports them
    tensorcores: int
    hbm_bytes: int  # what the memory-fit check (`policies.model.memory_fit`) plans against
    hbm_gbps: float
    peak_bf16_tflops: float  # dense; the denominator of model FLOPs utilisation (MFU)
    vmem_bytes: int  # per TensorCore
    vmem_limit_bytes: int  # given to every Pallas call


MIB, GIB, GB = 2**20, 2**30, 10**9
V4 = Chip("v4", ("TPU v4", "TPU v4 lite"), 2, 32 * GIB, 1200.0, 275.0, 16 * MIB, 16 * MIB)
V5E = Chip("v5e", ("TPU v5 lite", "TPU v5e"), 1, 16 * GB, 819.0, 197.0, 128 * MIB, 112 * MIB)
V5P = Chip("v5p", ("TPU v5", "TPU v5p"), 2, 95 * GB, 2765.0, 459.0, 64 * MIB, 56 * MIB)
V6E = Chip("v6e", ("TPU v6 lite", "TPU v6e"), 1, 32 * GB, 1638.0, 918.0, 128 * MIB, 112 * MIB)
CHIPS = {c.name: c for c in (V4, V5E, V5P, V6E)}


def from_device_kind(device_kind: str) -> Chip | None:
    """The chip JAX reports as ``device_kind``; None for a kind this table lacks (a CPU, a GPU, a newer TPU)."""
    return next((c for c in CHIPS.values() if device_kind in c.device_kinds), None)
