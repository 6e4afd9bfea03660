"""Rotary position embedding (RoPE), rotate-half convention (GPT-NeoX, LLaMA).

Feature ``i < d/2`` pairs with ``i + d/2``; the pair at sequence position ``p`` turns by
``p * base**(-2i/d)``. The Pallas kernel is fused: it computes the angles from the
positions in VMEM instead of reading ``[seq, d]`` sin/cos tables from HBM, so the op
costs one read and one write of x. A rotation's transpose is the rotation by the
opposite angle, so the backward pass is the same kernel with the sine negated and
saves nothing but the positions.

The ``"xla"`` implementation is the reference: XLA fuses the table computation into the
elementwise expression, so it also makes a single pass.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels import dispatch, generations, hardware

logger = logging.getLogger(__name__)

IMPLEMENTATIONS = (dispatch.PALLAS, dispatch.XLA)


@dataclasses.dataclass(frozen=True)
class RopeBlockSizes:
    """Sequence positions per kernel block (all heads and features of them)."""

    block_seq: int = 256

    def __post_init__(self):
        if not isinstance(self.block_seq, int) or self.block_seq < 1 or self.block_seq % 8:
            raise ValueError(f"block_seq must be a positive multiple of 8, got {self.block_seq!r}")

    def fit(self, seq_len: int, heads: int = 1, head_dim: int = 0, itemsize: int = 4) -> generations.BlockFit:
        """The block for ``seq_len`` positions of ``heads`` x ``head_dim``, within VMEM, and the padded length.

        Raises:
          ValueError: not even 8 positions fit in VMEM (`max_positions`).
        """
        cap = max_positions(heads, head_dim, itemsize)
        if cap < 8:
            raise ValueError(f"positions of {heads} heads x {head_dim=} ({itemsize}-byte) do not fit the VMEM "
                             f"of a {generations.current().chip.name} core, 8 at a time")
        return generations.fit_block(seq_len, min(self.block_seq, cap))


def max_positions(heads: int, head_dim: int, itemsize: int = 4,
                  chip: hardware.Chip | None = None) -> int:
    """Most positions a block may hold (a multiple of 8): x and out double-buffered, about six f32 copies."""
    chip = chip or generations.current().chip
    per_position = max(heads * head_dim, 1) * (4 * itemsize + 24)
    return (chip.vmem_limit_bytes // 2 // per_position) // 8 * 8


def apply_rope(
    x: jax.Array,
    positions: jax.Array,
    *,
    base: float = 10000.0,
    implementation: str | None = None,
    block_sizes: RopeBlockSizes | None = None,
) -> jax.Array:
    """Rotate ``x`` by its positions.

    Args:
      x: ``[batch, seq, heads, head_dim]`` (``head_dim`` even), any float dtype; angles
        and products in f32, result in ``x.dtype``.
      positions: ``[batch, seq]`` int32 position of every token (packed documents may
        restart at 0).
      base: the frequency base.
      implementation: ``"pallas"``, ``"xla"`` or None (from the backend, `kernels.dispatch`).
      block_sizes: positions per Pallas block (`RopeBlockSizes`), default per chip
        generation; any length runs (a dividing block, or padded positions cut off).

    Sharding: every token is independent; under ``jit`` the Pallas path needs
    `kernels.sharded` with x sharded over batch/seq/heads (not head_dim) and positions alike.
    """
    batch, seq_len, _, head_dim = x.shape
    if head_dim % 2:
        raise ValueError(f"{head_dim=} must be even")
    if positions.shape != (batch, seq_len):
        raise ValueError(f"positions must be [batch, seq] = {(batch, seq_len)}, got {positions.shape}")
    impl = dispatch.resolve(implementation, valid=IMPLEMENTATIONS)
    heads = x.shape[2]
    if impl == dispatch.PALLAS and implementation is None and max_positions(heads, head_dim, x.dtype.itemsize) < 8:
        logger.warning("RoPE runs on the XLA path: %d heads x head_dim=%d do not fit VMEM 8 positions at a time",
                       heads, head_dim)
        impl = dispatch.XLA
    if impl == dispatch.XLA:
        return reference_rope(x, positions, base=base)  # inlined in the caller's jit, where XLA fuses it
    blocks = block_sizes or RopeBlockSizes(generations.current().rope_seq)
    fit = blocks.fit(seq_len, x.shape[2], head_dim, x.dtype.itemsize)
    return _pallas_rope_jit(x, positions, config=_Config(float(base), fit.block, fit.padded))


@dataclasses.dataclass(frozen=True)
class _Config:
    base: float
    block_seq: int
    padded_seq: int  # positions padded to whole blocks (zeros at position 0), cut off after


@functools.partial(jax.jit, static_argnames=("config",))
def _pallas_rope_jit(x, positions, *, config: _Config):
    seq_len = x.shape[1]
    extra = config.padded_seq - seq_len
    if extra:
        x = jnp.pad(x, ((0, 0), (0, extra), (0, 0), (0, 0)))
        positions = jnp.pad(positions, ((0, 0), (0, extra)))
    return _pallas_rope(x, positions.astype(jnp.int32), config)[:, :seq_len]


@functools.partial(jax.custom_vjp, nondiff_argnames=("config",))
def _pallas_rope(x, positions, config: _Config):
    return _rotate(x, positions, config, inverse=False)


def _forward(x, positions, config):
    return _rotate(x, positions, config, inverse=False), positions


def _backward(config, positions, dy):
    return _rotate(dy, positions, config, inverse=True), None


_pallas_rope.defvjp(_forward, _backward)


def _rotate(x, positions, config: _Config, *, inverse: bool):
    batch, seq_len, heads, head_dim = x.shape
    block = config.block_seq
    return pl.pallas_call(
        functools.partial(_rope_kernel, base=config.base, inverse=inverse),
        grid=(batch, seq_len // block),
        in_specs=[pl.BlockSpec((None, block, 1), lambda b, s: (b, s, 0)),
                  pl.BlockSpec((None, block, heads, head_dim), lambda b, s: (b, s, 0, 0))],
        out_specs=pl.BlockSpec((None, block, heads, head_dim), lambda b, s: (b, s, 0, 0)),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        compiler_params=generations.compiler_params(("parallel", "parallel")),
        interpret=dispatch.pallas_interpret(),
    )(positions[..., None], x)


def _rope_kernel(positions_ref, x_ref, out_ref, *, base, inverse):
    head_dim = x_ref.shape[-1]
    half = head_dim // 2
    lane = lax.broadcasted_iota(jnp.int32, (1, head_dim), 1)
    # Lanes i and i + d/2 share the frequency base**(-2i/d).
    inv_freq = jnp.exp((lane % half).astype(jnp.float32) * (-2.0 * math.log(base) / head_dim))
    angle = positions_ref[...].astype(jnp.float32) * inv_freq  # [block_seq, head_dim]
    cos, sin = jnp.cos(angle)[:, None, :], jnp.sin(angle)[:, None, :]  # broadcast over heads
    x = x_ref[...].astype(jnp.float32)  # [block_seq, heads, head_dim]
    # rotate_half(x) = [-x2, x1]: swap the halves (a lane rotation by d/2) and negate the first.
    sign = jnp.where(lane < half, -1.0, 1.0)[:, None, :]
    rotated = pltpu.roll(x, half, 2) * sign
    out = x * cos - rotated * sin if inverse else x * cos + rotated * sin
    out_ref[...] = out.astype(out_ref.dtype)


def reference_rope(x: jax.Array, positions: jax.Array, *, base: float = 10000.0) -> jax.Array:
    """RoPE in plain ``jax.numpy`` with explicit sin/cos tables; same contract as `apply_rope`."""
    head_dim = x.shape[-1]
    inv_freq = 1.0 / (base ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))  # [d/2]
    angle = positions.astype(jnp.float32)[..., None] * inv_freq  # [batch, seq, d/2]
    angle = jnp.concatenate([angle, angle], axis=-1)[:, :, None, :]  # [batch, seq, 1, d]
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (xf * jnp.cos(angle) + rotated * jnp.sin(angle)).astype(x.dtype)
