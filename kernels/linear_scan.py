"""Linear recurrence ``h_t = a_t * h_{t-1} + b_t`` (elementwise), the core of diagonal state-space layers.

- Pallas: time cut into blocks, carried across them. Grid ``(batch, dim_blocks,
  time_blocks)`` with time innermost; each grid step runs the recurrence sequentially
  over its ``block_time`` rows and leaves the state in VMEM scratch for the next block.
  Sequential rows use one sublane of a TPU vreg; a faster kernel would scan eight rows
  at a time in registers.
- XLA: a sequential ``lax.scan`` over time, vectorized over batch and features. On CPU
  that is the fastest form measured: at ``[4, 4096, 512]`` an associative scan in chunks
  of 64 to 256 steps (with a sequential pass over the chunk ends) took 1.4 to 2.3 times
  as long, and unrolling the loop 8 or 32 steps slowed it too. On a GPU, where every
  loop step costs a kernel launch, the chunked associative form would be the one to add.

The backward pass is shared: with ``delta_t = dL/dh_t`` accumulated through the
recurrence, ``delta_t = g_t + a_{t+1} * delta_{t+1}`` is the same recurrence run in
reverse, and ``da_t = delta_t * h_{t-1}``, ``db_t = delta_t``, ``dh0 = a_0 * delta_0``. It
saves ``a``, ``h0`` and the output ``h``: no per-step state beyond the output.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels import dispatch, generations

IMPLEMENTATIONS = (dispatch.PALLAS, dispatch.XLA)


@dataclasses.dataclass(frozen=True)
class ScanBlockSizes:
    """Time steps and features per block of the Pallas kernel (the XLA path does not block)."""

    block_time: int = 256
    block_dim: int = 512

    def __post_init__(self):
        for name in ("block_time", "block_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1 or value % 8:
                raise ValueError(f"{name} must be a positive multiple of 8, got {value!r}")

    def fit(self, time: int, dim: int) -> tuple[ScanBlockSizes, int, int]:
        """Blocks fitted to the array (`generations.fit_block`), and the time and dim lengths padded to them."""
        t = generations.fit_block(time, self.block_time)
        d = generations.fit_block(dim, self.block_dim, align=generations.lane_align(self.block_dim))
        return ScanBlockSizes(t.block, d.block), t.padded, d.padded


def linear_scan(
    a: jax.Array,
    b: jax.Array,
    *,
    h0: jax.Array | None = None,
    implementation: str | None = None,
    block_sizes: ScanBlockSizes | None = None,
) -> jax.Array:
    """All states of ``h_t = a_t * h_{t-1} + b_t``, ``h_{-1} = h0``.

    Args:
      a: ``[batch, time, dim]`` decays (any float dtype; the state is carried in f32).
      b: ``[batch, time, dim]`` inputs, same dtype as ``a``.
      h0: ``[batch, dim]`` initial state, zeros when None.
      implementation: ``"pallas"``, ``"xla"`` or None (from the backend, `kernels.dispatch`).
      block_sizes: `ScanBlockSizes` of the Pallas kernel, default per chip generation; any
        length runs (dividing blocks, or zero steps and features padded and cut off).

    Returns:
      ``h``: ``[batch, time, dim]`` in ``a.dtype``.

    Sharding: batch and dim are independent; the Pallas path under ``jit`` needs
    `kernels.sharded` with time unsharded.
    """
    if a.ndim != 3 or a.shape != b.shape:
        raise ValueError(f"a and b must both be [batch, time, dim], got {a.shape=}, {b.shape=}")
    batch, time, dim = a.shape
    if h0 is not None and h0.shape != (batch, dim):
        raise ValueError(f"h0 must be [batch, dim] = {(batch, dim)}, got {h0.shape}")
    impl = dispatch.resolve(implementation, valid=IMPLEMENTATIONS)
    blocks = block_sizes or ScanBlockSizes(*generations.current().scan)
    padded = (time, dim)
    if impl == dispatch.PALLAS:
        blocks, padded_time, padded_dim = blocks.fit(time, dim)
        padded = (padded_time, padded_dim)
    h0 = jnp.zeros((batch, dim), a.dtype) if h0 is None else h0
    return _scan_jit(a, b, h0, config=_Config(impl, blocks, *padded))


@dataclasses.dataclass(frozen=True)
class _Config:
    implementation: str
    blocks: ScanBlockSizes
    padded_time: int
    padded_dim: int


@functools.partial(jax.jit, static_argnames=("config",))
def _scan_jit(a, b, h0, *, config: _Config):
    # Padding: zero decays and inputs after the last step (they leave earlier states alone, and
    # the reverse pass starts from their zero cotangents) and in extra features; cut off after.
    _, time, dim = a.shape
    pad_time, pad_dim = config.padded_time - time, config.padded_dim - dim
    if pad_time or pad_dim:
        a, b = (jnp.pad(x, ((0, 0), (0, pad_time), (0, pad_dim))) for x in (a, b))
        h0 = jnp.pad(h0, ((0, 0), (0, pad_dim)))
    return _scan(a, b, h0, config)[:, :time, :dim]


@functools.partial(jax.custom_vjp, nondiff_argnames=("config",))
def _scan(a, b, h0, config: _Config):
    return _run(a, b, h0, config, reverse=False, out_dtype=a.dtype)[0]


def _scan_forward(a, b, h0, config):
    h, _ = _run(a, b, h0, config, reverse=False, out_dtype=a.dtype)
    return h, (a, h0, h)


def _scan_backward(config, residuals, dh):
    a, h0, h = residuals
    delta, dh0 = _run(a, dh, jnp.zeros_like(h0), config, reverse=True, out_dtype=jnp.float32)
    h_prev = jnp.concatenate([h0[:, None], h[:, :-1]], axis=1).astype(jnp.float32)
    return (delta * h_prev).astype(a.dtype), delta.astype(a.dtype), dh0.astype(h0.dtype)


_scan.defvjp(_scan_forward, _scan_backward)


def _run(a, b, h0, config: _Config, *, reverse: bool, out_dtype):
    """The recurrence over time, forward or (``reverse``) in the backward's form; returns (h, final carry).

    Forward: ``h_t = a_t * carry + b_t; carry = h_t``. Reverse, for t from last to first:
    ``h_t = b_t + carry; carry = a_t * h_t``. Carries are f32 ``[batch, dim]``.
    """
    if config.implementation == dispatch.PALLAS:
        return _pallas_scan(a, b, h0, config.blocks, reverse=reverse, out_dtype=out_dtype)
    return _sequential_scan(a, b, h0, reverse=reverse, out_dtype=out_dtype)


# --------------------------------------------------------------------------- Pallas path


def _pallas_scan(a, b, h0, blocks: ScanBlockSizes, *, reverse: bool, out_dtype):
    batch, time, dim = a.shape
    bt, bd = blocks.block_time, blocks.block_dim
    num_time_blocks = time // bt

    def time_block(t):
        return num_time_blocks - 1 - t if reverse else t

    seq_spec = pl.BlockSpec((None, bt, bd), lambda i, j, t: (i, time_block(t), j))
    state_spec = pl.BlockSpec((None, 1, bd), lambda i, j, t: (i, 0, j))
    h, carry = pl.pallas_call(
        functools.partial(_scan_kernel, reverse=reverse),
        grid=(batch, dim // bd, num_time_blocks),
        in_specs=[seq_spec, seq_spec, state_spec],
        out_specs=[seq_spec, state_spec],
        out_shape=[jax.ShapeDtypeStruct(a.shape, out_dtype), jax.ShapeDtypeStruct((batch, 1, dim), jnp.float32)],
        scratch_shapes=[pltpu.VMEM((1, bd), jnp.float32)],
        compiler_params=generations.compiler_params(("parallel", "parallel", "arbitrary")),
        interpret=dispatch.pallas_interpret(),
    )(a, b, h0[:, None, :])
    return h, carry[:, 0]


def _scan_kernel(a_ref, b_ref, h0_ref, h_ref, carry_out_ref, carry_ref, *, reverse):
    # a_ref, b_ref, h_ref: [block_time, block_dim]; h0_ref, carry_out_ref, carry_ref: [1, block_dim]
    @pl.when(pl.program_id(2) == 0)
    def _init():
        carry_ref[...] = h0_ref[...].astype(jnp.float32)

    block_time = a_ref.shape[0]

    def step(i, carry):
        t = block_time - 1 - i if reverse else i
        a_t = a_ref[pl.ds(t, 1), :].astype(jnp.float32)
        b_t = b_ref[pl.ds(t, 1), :].astype(jnp.float32)
        h_t = b_t + carry if reverse else a_t * carry + b_t
        h_ref[pl.ds(t, 1), :] = h_t.astype(h_ref.dtype)
        return a_t * h_t if reverse else h_t

    carry_ref[...] = lax.fori_loop(0, block_time, step, carry_ref[...])

    @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
    def _finish():
        carry_out_ref[...] = carry_ref[...]


# --------------------------------------------------------------------------- XLA path


def _sequential_scan(a, b, h0, *, reverse: bool, out_dtype):
    def step(carry, ab):
        a_t, b_t = (x.astype(jnp.float32) for x in ab)
        h_t = b_t + carry if reverse else a_t * carry + b_t
        return (a_t * h_t if reverse else h_t), h_t.astype(out_dtype)

    carry, h = lax.scan(step, h0.astype(jnp.float32), (a.swapaxes(0, 1), b.swapaxes(0, 1)), reverse=reverse)
    return h.swapaxes(0, 1), carry


# --------------------------------------------------------------------------- reference


def reference_linear_scan(a: jax.Array, b: jax.Array, h0: jax.Array | None = None) -> jax.Array:
    """The recurrence as a plain sequential ``lax.scan`` over time, state in f32."""
    batch, _, dim = a.shape
    h0 = jnp.zeros((batch, dim), jnp.float32) if h0 is None else h0.astype(jnp.float32)

    def step(h, ab):
        a_t, b_t = ab
        h = a_t.astype(jnp.float32) * h + b_t.astype(jnp.float32)
        return h, h

    _, hs = lax.scan(step, h0, (a.swapaxes(0, 1), b.swapaxes(0, 1)))
    return hs.swapaxes(0, 1).astype(a.dtype)
