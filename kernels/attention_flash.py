"""Flash attention's Pallas path: the custom_vjp, the pallas_call builders and the kernel bodies
(`kernels.attention` is the public function that dispatches to it).

Layouts: the public API takes ``[batch, seq, heads, head_dim]``. The Pallas kernels work
on ``[batch, heads, seq, head_dim]`` (one transpose in and out, which XLA usually fuses into
the projections) so that each block is a ``[block, head_dim]`` tile in VMEM. Grouped-query
attention never repeats K/V: query head ``h`` reads key/value head ``h // group``.

Skipping: the forward and dQ grids are ``(batch, heads, q_blocks, num_kv_steps)`` where
``num_kv_steps`` is the widest row of the mask's band (see `MaskBand`), so with a sliding
window the blocks outside the band are not in the grid at all; inside a row, steps past
the row's last block repeat its index (no copy on a TPU) and skip the compute with
``pl.when``, as do block pairs whose segment id ranges do not meet. The dK/dV grid does
the same by columns.

Lengths: each pass (forward; dQ and dK/dV) fits its own blocks to the lengths
(`kernels.generations.fit_block`) and pads q, k and v to whole blocks; padded keys are
masked, padded queries are cut off (their zero cotangents add nothing to dK and dV), so
any length runs.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels import dispatch, generations
from kernels.attention_mask import MASK_VALUE, MaskBand, segment_block_bounds, segments_may_meet


@dataclasses.dataclass(frozen=True)
class Tiling:
    """One pass's fitted blocks and the lengths padded to whole blocks (padding is masked)."""

    block_q: int
    block_kv: int
    q_len: int
    kv_len: int


@dataclasses.dataclass(frozen=True)
class _FlashConfig:
    """What the kernels of one pass see: the real (unpadded) mask band and the pass's tiling."""

    band: MaskBand
    sm_scale: float
    blocks: Tiling

    @property
    def kv_padded(self) -> bool:
        return self.blocks.kv_len != self.band.kv_len


@dataclasses.dataclass(frozen=True)
class Flash:
    band: MaskBand
    sm_scale: float
    forward: Tiling
    backward: Tiling

    def pass_config(self, *, backward: bool) -> _FlashConfig:
        return _FlashConfig(self.band, self.sm_scale, self.backward if backward else self.forward)


def _pad_to(x, length: int, axis: int = 2, mode: str = "constant"):
    """``x`` zero-padded (or ``mode``) at the end of ``axis`` to ``length``."""
    if x is None or x.shape[axis] == length:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, length - x.shape[axis])
    return jnp.pad(x, widths, mode=mode)


def _padded(config: _FlashConfig, q, k, v, segment_ids, *row_operands):
    """Operands padded to the pass's tiling: queries (and per-query rows) and keys to whole blocks.

    Padded keys are masked in the kernels; padded queries are zeros whose outputs are cut
    off, and whose output cotangents are zero, so they add nothing to dK and dV.
    """
    q_len, kv_len = config.blocks.q_len, config.blocks.kv_len
    ids = None if segment_ids is None else _pad_to(segment_ids, max(q_len, kv_len), axis=1, mode="edge")
    rows = [_pad_to(x, q_len) for x in row_operands]
    return (_pad_to(q, q_len), _pad_to(k, kv_len), _pad_to(v, kv_len), ids, *rows)


@functools.partial(jax.custom_vjp, nondiff_argnames=("config",))
def flash(q, k, v, segment_ids, config: Flash):
    """q ``[batch, heads, q_len, head_dim]``, k/v ``[batch, kv_heads, kv_len, head_dim]``."""
    return _flash_forward(q, k, v, segment_ids, config)[0]


def _flash_forward(q, k, v, segment_ids, config: Flash):
    forward = config.pass_config(backward=False)
    out, lse = _forward_call(*_padded(forward, q, k, v, segment_ids), config=forward)
    q_len = q.shape[2]
    out, lse = out[:, :, :q_len], lse[:, :, :q_len]
    return out, (q, k, v, segment_ids, out, lse)


def _flash_backward(config: Flash, residuals, d_out):
    q, k, v, segment_ids, out, lse = residuals
    # [batch, heads, q_len, 1]: rowsum(dO * O) = rowsum(P * dP), the softmax Jacobian's diagonal term.
    di = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1, keepdims=True)
    backward = config.pass_config(backward=True)
    operands = _padded(backward, q, k, v, segment_ids, d_out, lse, di)
    dq = _dq_call(*operands, config=backward)
    dk, dv = _dkv_call(*operands, config=backward)
    q_len, kv_len = q.shape[2], k.shape[2]
    return dq[:, :, :q_len], dk[:, :, :kv_len], dv[:, :, :kv_len], None


flash.defvjp(_flash_forward, _flash_backward)


@dataclasses.dataclass(frozen=True)
class _Coords:
    """What one grid point works on; fields are traced int32 scalars (``real``: bool)."""

    batch: jax.Array
    head: jax.Array
    kv_head: jax.Array
    q_block: jax.Array
    kv_block: jax.Array
    real: jax.Array  # the step lies inside the band (not a padding step of a short row)


def _row_coords(config: _FlashConfig, group: int) -> Callable[..., _Coords]:
    """Grid ``(batch, heads, q_blocks, kv_steps)``: one query block against its band of key blocks."""
    blocks = config.blocks

    def coords(b, h, i, step):
        kv_block, real = config.band.kv_block_at(i, step, blocks.block_q, blocks.block_kv)
        return _Coords(b, h, h // group, i, kv_block, real)

    return coords


def _column_coords(config: _FlashConfig, group: int) -> Callable[..., _Coords]:
    """Grid ``(batch, kv_heads, kv_blocks, group, q_steps)``: one key block against the queries that see it."""
    blocks = config.blocks

    def coords(b, kv_head, j, g, step):
        q_block, real = config.band.q_block_at(j, step, blocks.block_q, blocks.block_kv)
        return _Coords(b, kv_head * group + g, kv_head, q_block, j, real)

    return coords


class _Specs:
    """BlockSpecs of every operand, all indexed through one ``coords`` function of the grid."""

    def __init__(self, coords: Callable[..., _Coords], grid_rank: int, reduction_axes: int, config: _FlashConfig,
                 head_dim: int):
        self.coords, self.grid_rank, self.reduction_axes = coords, grid_rank, reduction_axes
        bq, bk = config.blocks.block_q, config.blocks.block_kv
        self.q = self._spec((None, None, bq, head_dim), lambda c: (c.batch, c.head, c.q_block, 0))
        self.kv = self._spec((None, None, bk, head_dim), lambda c: (c.batch, c.kv_head, c.kv_block, 0))
        self.q_row = self._spec((None, None, bq, 1), lambda c: (c.batch, c.head, c.q_block, 0))
        self.q_segments = self._spec((None, bq, 1), lambda c: (c.batch, c.q_block, 0))
        self.kv_segments = self._spec((None, 1, bk), lambda c: (c.batch, 0, c.kv_block))

    def _spec(self, block_shape, pick):
        # Index maps get the grid indices, then the scalar-prefetch refs (unused here).
        return pl.BlockSpec(block_shape, lambda *args: pick(self.coords(*args[:self.grid_rank])))


# FLOPs per computed (query, key) pair and head_dim, per pass: the forward pass's q.k and p.v (2 + 2); dQ's
# recomputed q.k, dO.v and ds.k (6); dK/dV's recomputed q.k, p.dO, dO.v and ds.q (8). One exp a pair in each.
_PAIR_FLOPS = {"forward": 4, "dq": 6, "dkv": 8}


def _cost(pass_name: str, config: _FlashConfig, q, k, operands, out_shape) -> pl.CostEstimate:
    """What a pass costs, for XLA's cost model (which cannot see inside a Mosaic kernel): its matmul
    FLOPs over the mask's band, its exps, and each operand and output moved once."""
    batch, heads, _, head_dim = q.shape
    pairs = batch * heads * config.band.visited_pairs(config.blocks.block_q, config.blocks.block_kv)
    outs = out_shape if isinstance(out_shape, (list, tuple)) else [out_shape]
    moved = sum(a.size * a.dtype.itemsize for a, _ in operands) + sum(
        math.prod(o.shape) * jnp.dtype(o.dtype).itemsize for o in outs)
    return pl.CostEstimate(flops=int(_PAIR_FLOPS[pass_name] * pairs * head_dim), transcendentals=int(pairs),
                           bytes_accessed=int(moved))


def _call(kernel, specs: _Specs, grid, config, segment_ids, operands, out_shape, out_specs, scratch,
          cost: pl.CostEstimate | None = None):
    """Run ``kernel`` over ``grid`` on ``operands`` (``(array, BlockSpec)`` pairs), adding segment ids."""
    arrays, in_specs = [a for a, _ in operands], [s for _, s in operands]
    bounds: tuple[jax.Array, ...] = ()
    if segment_ids is not None:
        ids = segment_ids.astype(jnp.int32)  # padded to the longer of the two padded lengths
        q_lo, q_hi = segment_block_bounds(ids[:, :config.blocks.q_len], config.blocks.block_q)
        kv_lo, kv_hi = segment_block_bounds(ids[:, :config.blocks.kv_len], config.blocks.block_kv)
        bounds = tuple(x.reshape(-1) for x in (q_lo, q_hi, kv_lo, kv_hi))  # 1-D: SMEM pads 2-D arrays
        arrays += [ids[:, :config.blocks.q_len, None], ids[:, None, :config.blocks.kv_len]]  # [b, q, 1], [b, 1, kv]
        in_specs += [specs.q_segments, specs.kv_segments]
    # The trailing axes accumulate into one output block; the others are independent.
    reduced = specs.reduction_axes
    semantics = (generations.PARALLEL,) * (len(grid) - reduced) + (generations.ARBITRARY,) * reduced
    body = functools.partial(kernel, config=config, specs=specs, num_inputs=len(operands),
                             has_segments=segment_ids is not None)
    return pl.pallas_call(
        body,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(bounds), grid=grid, in_specs=in_specs, out_specs=out_specs,
            scratch_shapes=scratch),
        out_shape=out_shape,
        compiler_params=generations.compiler_params(semantics),
        interpret=dispatch.pallas_interpret(),
        cost_estimate=cost,
    )(*bounds, *arrays)


def _forward_call(q, k, v, segment_ids, *, config):
    batch, heads, q_len, head_dim = q.shape
    bq, bk = config.blocks.block_q, config.blocks.block_kv
    specs = _Specs(_row_coords(config, heads // k.shape[1]), 4, 1, config, head_dim)
    grid = (batch, heads, q_len // bq, config.band.num_kv_steps(bq, bk))  # q_len: padded
    operands = [(q, specs.q), (k, specs.kv), (v, specs.kv)]
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((batch, heads, q_len, 1), jnp.float32)]
    return _call(
        _forward_kernel, specs, grid, config, segment_ids, operands, out_shape=out_shape,
        out_specs=[specs.q, specs.q_row],
        scratch=[pltpu.VMEM((bq, 1), jnp.float32), pltpu.VMEM((bq, 1), jnp.float32),
                 pltpu.VMEM((bq, head_dim), jnp.float32)],
        cost=_cost("forward", config, q, k, operands, out_shape))


def _dq_call(q, k, v, segment_ids, d_out, lse, di, *, config):
    batch, heads, q_len, head_dim = q.shape
    bq, bk = config.blocks.block_q, config.blocks.block_kv
    specs = _Specs(_row_coords(config, heads // k.shape[1]), 4, 1, config, head_dim)
    grid = (batch, heads, q_len // bq, config.band.num_kv_steps(bq, bk))  # q_len: padded
    operands = [(q, specs.q), (k, specs.kv), (v, specs.kv), (d_out, specs.q), (lse, specs.q_row), (di, specs.q_row)]
    out_shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
    return _call(
        _dq_kernel, specs, grid, config, segment_ids, operands, out_shape=out_shape, out_specs=specs.q,
        scratch=[pltpu.VMEM((bq, head_dim), jnp.float32)], cost=_cost("dq", config, q, k, operands, out_shape))


def _dkv_call(q, k, v, segment_ids, d_out, lse, di, *, config):
    batch, heads, _, head_dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    group = heads // kv_heads
    bq, bk = config.blocks.block_q, config.blocks.block_kv
    specs = _Specs(_column_coords(config, group), 5, 2, config, head_dim)
    grid = (batch, kv_heads, kv_len // bk, group, config.band.num_q_steps(bq, bk))
    operands = [(q, specs.q), (k, specs.kv), (v, specs.kv), (d_out, specs.q), (lse, specs.q_row), (di, specs.q_row)]
    out_shape = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
    return _call(
        _dkv_kernel, specs, grid, config, segment_ids, operands, out_shape=out_shape, out_specs=[specs.kv, specs.kv],
        scratch=[pltpu.VMEM((bk, head_dim), jnp.float32), pltpu.VMEM((bk, head_dim), jnp.float32)],
        cost=_cost("dkv", config, q, k, operands, out_shape))


# --------------------------------------------------------------------------- kernel bodies


def _unpack(refs, num_inputs: int, has_segments: bool):
    """Split a kernel's refs into (segment bounds | None, inputs, segment refs | None, outputs + scratch)."""
    bounds = refs[:4] if has_segments else None
    refs = refs[4:] if has_segments else refs
    inputs, refs = refs[:num_inputs], refs[num_inputs:]
    segments = refs[:2] if has_segments else None
    return bounds, inputs, segments, refs[2:] if has_segments else refs


def _grid_coords(specs: _Specs) -> _Coords:
    return specs.coords(*(pl.program_id(axis) for axis in range(specs.grid_rank)))


def _visits(c: _Coords, bounds, config: _FlashConfig):
    """Whether this grid point computes: its block is in the band and its segments can meet."""
    if bounds is None:
        return c.real
    q_lo, q_hi, kv_lo, kv_hi = bounds
    num_q_blocks = config.blocks.q_len // config.blocks.block_q
    num_kv_blocks = config.blocks.kv_len // config.blocks.block_kv
    qi = c.batch * num_q_blocks + c.q_block
    ki = c.batch * num_kv_blocks + c.kv_block
    return c.real & segments_may_meet(q_lo[qi], q_hi[qi], kv_lo[ki], kv_hi[ki])


def _mask(c: _Coords, segments, config: _FlashConfig) -> jax.Array | None:
    """``[block_q, block_kv]`` bool of allowed (query, key) pairs, None when all are."""
    bq, bk = config.blocks.block_q, config.blocks.block_kv
    q_pos = c.q_block * bq + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
    k_pos = c.kv_block * bk + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
    mask = config.band.allows(q_pos, k_pos)
    if config.kv_padded:
        real = k_pos < config.band.kv_len
        mask = real if mask is None else mask & real
    if segments is not None:
        q_segments, kv_segments = segments
        same = q_segments[...] == kv_segments[...]  # [block_q, 1] == [1, block_kv]
        mask = same if mask is None else mask & same
    return mask


def _scores(q, k, sm_scale):
    """``[block_q, block_kv]`` f32 logits of q ``[block_q, d]`` and k ``[block_kv, d]``."""
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return s * sm_scale


def _probs(q_ref, k_ref, lse_ref, c, segments, config):
    """Recomputed softmax probabilities ``[block_q, block_kv]`` f32 from the saved log-sum-exp."""
    p = jnp.exp(_scores(q_ref[...], k_ref[...], config.sm_scale) - lse_ref[...])
    mask = _mask(c, segments, config)
    return p if mask is None else jnp.where(mask, p, 0.0)


def _forward_kernel(*refs, config, specs, num_inputs, has_segments):
    bounds, (q_ref, k_ref, v_ref), segments, rest = _unpack(refs, num_inputs, has_segments)
    out_ref, lse_ref, m_scratch, l_scratch, acc_scratch = rest
    c = _grid_coords(specs)
    step = pl.program_id(3)

    @pl.when(step == 0)
    def _init():
        m_scratch[...] = jnp.full_like(m_scratch, MASK_VALUE)
        l_scratch[...] = jnp.zeros_like(l_scratch)
        acc_scratch[...] = jnp.zeros_like(acc_scratch)

    @pl.when(_visits(c, bounds, config))
    def _accumulate():
        s = _scores(q_ref[...], k_ref[...], config.sm_scale)  # [block_q, block_kv]
        mask = _mask(c, segments, config)
        m_prev = m_scratch[...]  # [block_q, 1]
        row_max = (s if mask is None else jnp.where(mask, s, MASK_VALUE)).max(axis=1, keepdims=True)
        m_next = jnp.maximum(m_prev, row_max)
        p = jnp.exp(s - m_next)
        if mask is not None:
            p = jnp.where(mask, p, 0.0)
        alpha = jnp.exp(m_prev - m_next)
        l_scratch[...] = alpha * l_scratch[...] + p.sum(axis=1, keepdims=True)
        pv = jnp.dot(p.astype(v_ref.dtype), v_ref[...], preferred_element_type=jnp.float32)
        acc_scratch[...] = alpha * acc_scratch[...] + pv
        m_scratch[...] = m_next

    @pl.when(step == pl.num_programs(3) - 1)
    def _finish():
        l = l_scratch[...]
        l = jnp.where(l == 0.0, 1.0, l)  # a row with no visible key outputs 0
        out_ref[...] = (acc_scratch[...] / l).astype(out_ref.dtype)
        lse_ref[...] = m_scratch[...] + jnp.log(l)


def _dq_kernel(*refs, config, specs, num_inputs, has_segments):
    bounds, inputs, segments, (dq_ref, dq_scratch) = _unpack(refs, num_inputs, has_segments)
    q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref = inputs
    c = _grid_coords(specs)
    step = pl.program_id(3)

    @pl.when(step == 0)
    def _init():
        dq_scratch[...] = jnp.zeros_like(dq_scratch)

    @pl.when(_visits(c, bounds, config))
    def _accumulate():
        p = _probs(q_ref, k_ref, lse_ref, c, segments, config)  # [block_q, block_kv]
        dp = lax.dot_general(do_ref[...], v_ref[...], (((1,), (1,)), ((), ())),
                             preferred_element_type=jnp.float32)
        ds = p * (dp - di_ref[...])
        dq_scratch[...] += jnp.dot(ds.astype(k_ref.dtype), k_ref[...], preferred_element_type=jnp.float32)

    @pl.when(step == pl.num_programs(3) - 1)
    def _finish():
        dq_ref[...] = (dq_scratch[...] * config.sm_scale).astype(dq_ref.dtype)


def _dkv_kernel(*refs, config, specs, num_inputs, has_segments):
    bounds, inputs, segments, (dk_ref, dv_ref, dk_scratch, dv_scratch) = _unpack(refs, num_inputs, has_segments)
    q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref = inputs
    c = _grid_coords(specs)
    g, step = pl.program_id(3), pl.program_id(4)

    @pl.when((g == 0) & (step == 0))
    def _init():
        dk_scratch[...] = jnp.zeros_like(dk_scratch)
        dv_scratch[...] = jnp.zeros_like(dv_scratch)

    @pl.when(_visits(c, bounds, config))
    def _accumulate():
        p = _probs(q_ref, k_ref, lse_ref, c, segments, config)  # [block_q, block_kv]
        transposed_lhs = (((0,), (0,)), ((), ()))  # contract the query axis: [block_kv, head_dim]
        dv_scratch[...] += lax.dot_general(p.astype(do_ref.dtype), do_ref[...], transposed_lhs,
                                           preferred_element_type=jnp.float32)
        dp = lax.dot_general(do_ref[...], v_ref[...], (((1,), (1,)), ((), ())),
                             preferred_element_type=jnp.float32)
        ds = p * (dp - di_ref[...])
        dk_scratch[...] += lax.dot_general(ds.astype(q_ref.dtype), q_ref[...], transposed_lhs,
                                           preferred_element_type=jnp.float32)

    @pl.when((g == pl.num_programs(3) - 1) & (step == pl.num_programs(4) - 1))
    def _finish():
        dk_ref[...] = (dk_scratch[...] * config.sm_scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_scratch[...].astype(dv_ref.dtype)
