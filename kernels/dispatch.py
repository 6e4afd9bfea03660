"""Which implementation of an op runs, chosen from the devices it is compiled for.

The *target* is those devices: the current mesh's (``jax.set_mesh``), which is how a
program is compiled for a TPU slice that is not here (``jax.experimental.topologies``:
XLA's TPU compiler on a machine without a TPU, see `workers.tpu_target`); with no mesh
set, the default backend's first device. Every choice below (implementation, Mosaic or
an interpreter, the chip generation's blocks in `kernels.generations`) reads the target,
never the default backend alone: off a TPU that would say "cpu" for a TPU program.

Vocabulary, shared by every op in `kernels`:

- ``"pallas"``: the Pallas TPU kernel. On a TPU it is compiled by Mosaic; on any other
  backend it runs in TPU interpret mode, a CPU simulation of the TPU that is exact but
  slow. That is how the tests (and the CPU training comparison) exercise the kernels.
- ``"xla"``: plain ``jax.numpy`` compiled by XLA. For attention this is the
  memory-efficient path (online softmax over key/value chunks), for the others the
  fused XLA expression of the op.
- ``"cudnn"``: attention only, ``jax.nn.dot_product_attention(implementation="cudnn")``.
- ``None``: automatic: ``"pallas"`` on TPU (``"xla"`` for an op whose rows are too wide for
  the chip's VMEM even at the smallest block, see `kernels.shapes`); on GPU ``"cudnn"`` for
  attention where cuDNN supports the case and ``"xla"`` otherwise; ``"xla"`` on CPU.

The grouped matmul's ``"xla"`` path is ``jax.lax.ragged_dot`` on a GPU (a grouped GEMM) and
a loop over row tiles elsewhere.
"""

from __future__ import annotations

import dataclasses
import os

import jax
from jax.experimental.pallas import tpu as pltpu

PALLAS = "pallas"
XLA = "xla"
CUDNN = "cudnn"

_GPU_BACKENDS = ("gpu", "cuda", "rocm")


@dataclasses.dataclass(frozen=True)
class Target:
    """The devices a program is compiled for: their platform (GPU platforms named ``"gpu"``) and kind."""

    platform: str
    device_kind: str


def target() -> Target:
    """The current mesh's devices (``jax.set_mesh``, also inside ``jit`` and ``shard_map`` under it),
    else the default backend's."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    if device is not None:
        platform, kind = device.platform, device.device_kind
    else:
        platform, kind = jax.default_backend(), jax.devices()[0].device_kind
    return Target("gpu" if platform in _GPU_BACKENDS else platform, kind)


def backend() -> str:
    """The target's platform: ``"tpu"``, ``"gpu"`` or ``"cpu"``."""
    return target().platform


def resolve(implementation: str | None, *, valid: tuple[str, ...], gpu_default: str = XLA) -> str:
    """The implementation to run: ``implementation`` if valid, else the backend's default.

    Raises:
      ValueError: for a string not in ``valid``, listing the valid ones.
    """
    if implementation is None:
        platform = backend()
        if platform == "tpu":
            return PALLAS
        return gpu_default if platform == "gpu" else XLA
    if implementation not in valid:
        raise ValueError(
            f"Unknown implementation {implementation!r}; valid: {', '.join(map(repr, valid))} "
            "or None (chosen from the backend).")
    return implementation


INTERPRET_ENV = "KERNELS_PALLAS_INTERPRET"


def pallas_interpret() -> pltpu.InterpretParams | bool:
    """The ``interpret=`` argument of ``pallas_call``: Mosaic on TPU, an interpreter elsewhere.

    Off TPU the default is TPU interpret mode, which simulates the TPU's memories and
    DMAs. With ``KERNELS_PALLAS_INTERPRET=generic`` it is Pallas's generic interpreter
    instead, which lowers the kernel body to plain XLA ops: much faster, and it does not
    run the devices of a mesh in lockstep (TPU interpret mode does, and under
    ``shard_map`` on a CPU with fewer cores than devices it stalls for minutes).
    """
    if backend() == "tpu":
        return False
    mode = os.environ.get(INTERPRET_ENV, "tpu")
    if mode not in ("tpu", "generic"):
        raise ValueError(f"{INTERPRET_ENV}={mode!r}: expected 'tpu' or 'generic'")
    return True if mode == "generic" else pltpu.InterpretParams()
