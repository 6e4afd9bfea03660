"""RMSNorm and LayerNorm over the last axis, fused: one read of x, one write of y.

Both share one pair of Pallas kernels over blocks of rows (the leading axes flattened);
LayerNorm is the ``centered`` variant with a bias. Statistics are f32 whatever the input
dtype. The forward saves the per-row statistics (``rstd``, and ``mean`` for LayerNorm),
so the backward needs one more read of x and dy and no recomputed reductions beyond the
two row means of the standard formula. The weight and bias gradients are summed per row
block inside the kernel and across blocks by XLA (``[row_blocks, 1, d]`` partials), which
keeps every grid step independent ("parallel" on a TPU's two cores).

The ``"xla"`` implementation is the reference itself: XLA fuses it into one pass over x
(and its gradient into one more), so there is no separate memory-efficient variant to write.
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

from kernels import dispatch, generations, hardware

logger = logging.getLogger(__name__)

IMPLEMENTATIONS = (dispatch.PALLAS, dispatch.XLA)


@dataclasses.dataclass(frozen=True)
class NormBlockSizes:
    """Rows per kernel block; the feature axis is never split. Default per chip generation."""

    block_rows: int = 256

    def __post_init__(self):
        if not isinstance(self.block_rows, int) or self.block_rows < 1 or self.block_rows % 8:
            raise ValueError(f"block_rows must be a positive multiple of 8, got {self.block_rows!r}")

    def fit(self, rows: int, d: int = 0, itemsize: int = 4) -> generations.BlockFit:
        """The block for ``rows`` rows of ``d`` features, no larger than VMEM holds, and the padded row count.

        Raises:
          ValueError: not even 8 rows of ``d`` features fit in VMEM (`max_rows`).
        """
        cap = max_rows(d, itemsize)
        if cap < 8:
            raise ValueError(f"rows of d={d} features ({itemsize}-byte) do not fit the VMEM of a "
                             f"{generations.current().chip.name} core, 8 at a time")
        return generations.fit_block(rows, min(self.block_rows, cap))


def max_rows(d: int, itemsize: int = 4, chip: hardware.Chip | None = None) -> int:
    """Most rows of ``d`` features a block may hold (a multiple of 8; under 8: none fit).

    The backward holds the most: x, dy and dx double-buffered, and about four f32 rows of
    temporaries; half the VMEM limit is left to Mosaic and its own copies.
    """
    chip = chip or generations.current().chip
    per_row = max(d, 1) * (6 * itemsize + 16)
    return (chip.vmem_limit_bytes // 2 // per_row) // 8 * 8


def rms_norm(
    x: jax.Array,
    weight: jax.Array,
    *,
    eps: float = 1e-6,
    implementation: str | None = None,
    block_sizes: NormBlockSizes | None = None,
) -> jax.Array:
    """``x / sqrt(mean(x**2, -1) + eps) * weight``.

    Args:
      x: ``[..., d]``, any float dtype; statistics in f32, result in ``x.dtype``.
      weight: ``[d]``.
      eps: added to the mean square.
      implementation: ``"pallas"``, ``"xla"`` or None (from the backend, `kernels.dispatch`).
      block_sizes: rows per Pallas block (`NormBlockSizes`), default per chip generation;
        any number of rows runs (a block that divides them, or zero rows padded).

    Sharding: the Pallas path needs whole rows per device; wrap it in `kernels.sharded`
    with x sharded over leading axes only and ``weight`` replicated.
    """
    return _norm(x, weight, None, eps=eps, implementation=implementation, block_sizes=block_sizes)


def layer_norm(
    x: jax.Array,
    weight: jax.Array,
    bias: jax.Array,
    *,
    eps: float = 1e-5,
    implementation: str | None = None,
    block_sizes: NormBlockSizes | None = None,
) -> jax.Array:
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the last axis; arguments as `rms_norm`."""
    return _norm(x, weight, bias, eps=eps, implementation=implementation, block_sizes=block_sizes)


def _norm(x, weight, bias, *, eps, implementation, block_sizes):
    d = x.shape[-1]
    for name, param in (("weight", weight), ("bias", bias)):
        if param is not None and param.shape != (d,):
            raise ValueError(f"{name} must be [d] = {(d,)}, got {param.shape}")
    impl = dispatch.resolve(implementation, valid=IMPLEMENTATIONS)
    if impl == dispatch.PALLAS and implementation is None and max_rows(d, x.dtype.itemsize) < 8:
        logger.warning("The norm runs on the XLA path: rows of d=%d do not fit VMEM 8 at a time", d)
        impl = dispatch.XLA
    if impl == dispatch.XLA:
        # Not behind a jit of its own: under the caller's grad, a jit boundary made XLA
        # keep a full-size residual that it otherwise fuses away.
        return reference_norm(x, weight, bias, eps=eps)
    blocks = block_sizes or NormBlockSizes(generations.current().norm_rows)
    fit = blocks.fit(math.prod(x.shape[:-1]), d, x.dtype.itemsize)
    return _pallas_norm_jit(x, weight, bias, config=_Config(float(eps), fit.block, fit.padded))


@dataclasses.dataclass(frozen=True)
class _Config:
    eps: float
    block_rows: int
    padded_rows: int  # rows padded to whole blocks: zero rows, whose outputs are cut off


@functools.partial(jax.jit, static_argnames=("config",))
def _pallas_norm_jit(x, weight, bias, *, config: _Config):
    rows = x.reshape(-1, x.shape[-1])  # [rows, d]
    num_rows = rows.shape[0]
    if config.padded_rows != num_rows:  # zero rows normalize to zeros and add nothing to the gradients
        rows = jnp.pad(rows, ((0, config.padded_rows - num_rows), (0, 0)))
    return _pallas_norm(rows, weight, bias, config)[:num_rows].reshape(x.shape)


# --------------------------------------------------------------------------- Pallas path


@functools.partial(jax.custom_vjp, nondiff_argnames=("config",))
def _pallas_norm(x, weight, bias, config: _Config):
    return _forward(x, weight, bias, config)[0]


def _forward(x, weight, bias, config):
    rows, d = x.shape
    block = config.block_rows
    centered = bias is not None
    row_spec = pl.BlockSpec((block, d), lambda i: (i, 0))
    stat_spec = pl.BlockSpec((block, 1), lambda i: (i, 0))
    param_spec = pl.BlockSpec((1, d), lambda i: (0, 0))
    params = [weight[None]] + ([bias[None]] if centered else [])
    stat_shape = jax.ShapeDtypeStruct((rows, 1), jnp.float32)
    y, *stats = pl.pallas_call(
        functools.partial(_forward_kernel, eps=config.eps, centered=centered),
        grid=(rows // block,),
        in_specs=[row_spec] + [param_spec] * len(params),
        out_specs=[row_spec] + [stat_spec] * (1 + centered),
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype)] + [stat_shape] * (1 + centered),
        compiler_params=generations.compiler_params(("parallel",)),
        interpret=dispatch.pallas_interpret(),
    )(x, *params)
    return y, (x, weight, bias, stats)


def _backward(config, residuals, dy):
    x, weight, bias, stats = residuals
    rows, d = x.shape
    block = config.block_rows
    centered = bias is not None
    row_spec = pl.BlockSpec((block, d), lambda i: (i, 0))
    stat_spec = pl.BlockSpec((block, 1), lambda i: (i, 0))
    partial_spec = pl.BlockSpec((None, 1, d), lambda i: (i, 0, 0))
    partial_shape = jax.ShapeDtypeStruct((rows // block, 1, d), jnp.float32)
    dx, *param_partials = pl.pallas_call(
        functools.partial(_backward_kernel, centered=centered),
        grid=(rows // block,),
        in_specs=[row_spec, pl.BlockSpec((1, d), lambda i: (0, 0))] + [stat_spec] * len(stats) + [row_spec],
        out_specs=[row_spec] + [partial_spec] * (1 + centered),
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype)] + [partial_shape] * (1 + centered),
        compiler_params=generations.compiler_params(("parallel",)),
        interpret=dispatch.pallas_interpret(),
    )(x, weight[None], *stats, dy)
    d_weight = param_partials[0].sum(axis=(0, 1)).astype(weight.dtype)
    d_bias = param_partials[1].sum(axis=(0, 1)).astype(bias.dtype) if centered else None
    return dx, d_weight, d_bias


_pallas_norm.defvjp(_forward, _backward)


def _forward_kernel(x_ref, weight_ref, *refs, eps, centered):
    bias_ref, y_ref, mean_ref, rstd_ref = refs if centered else (None, refs[0], None, refs[1])
    x = x_ref[...].astype(jnp.float32)  # [block_rows, d]
    if centered:
        mean = x.mean(axis=1, keepdims=True)
        x = x - mean
        mean_ref[...] = mean
    rstd = lax.rsqrt((x * x).mean(axis=1, keepdims=True) + eps)  # [block_rows, 1]
    y = x * rstd * weight_ref[...].astype(jnp.float32)
    if centered:
        y = y + bias_ref[...].astype(jnp.float32)
    y_ref[...] = y.astype(y_ref.dtype)
    rstd_ref[...] = rstd


def _backward_kernel(x_ref, weight_ref, *refs, centered):
    if centered:
        mean_ref, rstd_ref, dy_ref, dx_ref, dw_ref, db_ref = refs
    else:
        (rstd_ref, dy_ref, dx_ref, dw_ref), mean_ref, db_ref = refs, None, None
    x = x_ref[...].astype(jnp.float32)  # [block_rows, d]
    if centered:
        x = x - mean_ref[...]
    rstd = rstd_ref[...]  # [block_rows, 1]
    x_hat = x * rstd
    dy = dy_ref[...].astype(jnp.float32)
    g = dy * weight_ref[...].astype(jnp.float32)  # gradient w.r.t. x_hat
    # d x_hat / d x projects out the directions the normalization removed: the row's
    # scale (both norms) and its mean (LayerNorm).
    g = g - x_hat * (g * x_hat).mean(axis=1, keepdims=True)
    if centered:
        g = g - g.mean(axis=1, keepdims=True)
    dx_ref[...] = (g * rstd).astype(dx_ref.dtype)
    dw_ref[...] = (dy * x_hat).sum(axis=0, keepdims=True)
    if centered:
        db_ref[...] = dy.sum(axis=0, keepdims=True)


# --------------------------------------------------------------------------- reference


def reference_norm(x: jax.Array, weight: jax.Array, bias: jax.Array | None, *, eps: float) -> jax.Array:
    """RMSNorm (``bias is None``) or LayerNorm in plain ``jax.numpy``, statistics in f32."""
    xf = x.astype(jnp.float32)
    if bias is not None:
        xf = xf - xf.mean(axis=-1, keepdims=True)
    y = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps) * weight.astype(jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(x.dtype)
