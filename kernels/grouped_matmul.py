"""Grouped matmul over experts: ``y[rows of tile t] = x[rows of tile t] @ w[tile_expert[t]]``.

The rows of ``x`` are grouped by expert and padded so that every tile of ``block_rows``
rows belongs to one expert (`kernels.moe.group_by_expert` builds that layout); only the
first ``num_tiles`` tiles hold rows, the rest of the static buffer is padding whose
output is zero. Layout contract, relied on by the weight-gradient kernel: tiles are in
expert order, and every expert owns at least one tile.

Pallas: the tile-to-expert table and ``num_tiles`` are scalar-prefetched into SMEM and
drive the index maps, so each tile DMAs exactly its expert's weight block; padding tiles
repeat the last real tile's indices (no copy on a TPU) and skip the matmul. The weight
gradient walks the tiles with the output block of their expert resident, initialized
at an expert's first tile and written at its last. XLA: on a GPU, ``jax.lax.ragged_dot``
over the layout's groups (each expert's tiles, padding tiles counted to the last
expert and zeroed), which XLA lowers to a grouped GEMM: on an H100 the tile loop took
1.3 to 5 times as long as a ragged_dot MoE (benchmarks/kernels.py --gpu). Elsewhere a
loop over tiles with a dynamically indexed expert weight (ragged_dot on CPU is dense:
every expert for every row, ``num_experts`` times the work). All share one custom VJP:
``dx = grouped_matmul(dy, w^T)`` and ``dw = per-expert x^T dy``.
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
class GroupedMatmulBlockSizes:
    """Rows per tile (one expert each), and the contraction / output blocks of the Pallas kernels."""

    block_rows: int = 128
    block_k: int = 512
    block_n: int = 512

    def __post_init__(self):
        for name in ("block_rows", "block_k", "block_n"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1 or value % 8:
                raise ValueError(f"{name} must be a positive multiple of 8, got {value!r}")

    def fit(self, k: int, n: int) -> tuple[GroupedMatmulBlockSizes, int, int]:
        """Blocks for ``[.., k] @ [k, n]`` (`generations.fit_block`; rows are tiled by the layout), and k and n
        padded to them."""
        fk = generations.fit_block(k, self.block_k, align=generations.lane_align(self.block_k))
        fn = generations.fit_block(n, self.block_n, align=generations.lane_align(self.block_n))
        return GroupedMatmulBlockSizes(self.block_rows, fk.block, fn.block), fk.padded, fn.padded


def grouped_matmul(
    x: jax.Array,
    w: jax.Array,
    tile_expert: jax.Array,
    num_tiles: jax.Array,
    *,
    implementation: str | None = None,
    block_sizes: GroupedMatmulBlockSizes | None = None,
) -> jax.Array:
    """``[rows, k] x [experts, k, n] -> [rows, n]`` with each row tile using its expert's weight.

    Args:
      x: ``[rows, k]``, rows a multiple of ``block_sizes.block_rows``, grouped as above.
      w: ``[experts, k, n]``.
      tile_expert: ``[rows // block_rows]`` int32, non-decreasing, every expert present.
      num_tiles: int32 scalar, tiles that hold rows; later tiles give zeros.
      implementation: ``"pallas"``, ``"xla"`` or None (from the backend).
      block_sizes: `GroupedMatmulBlockSizes`, default per chip generation; any k and n run
        (dividing blocks, or zeros padded and cut off).

    Returns:
      ``[rows, n]`` in ``x.dtype`` (f32 accumulation). Differentiable in ``x`` and ``w``.
    """
    blocks = block_sizes or GroupedMatmulBlockSizes(*generations.current().grouped_matmul)
    rows, k = x.shape
    if w.ndim != 3 or w.shape[1] != k:
        raise ValueError(f"w must be [experts, k={k}, n], got {w.shape}")
    if rows % blocks.block_rows or tile_expert.shape != (rows // blocks.block_rows,):
        raise ValueError(f"{rows=} must be tiles of block_rows={blocks.block_rows}, one tile_expert each; "
                         f"got {tile_expert.shape=}")
    impl = dispatch.resolve(implementation, valid=IMPLEMENTATIONS)
    padded = (k, w.shape[2])
    if impl == dispatch.PALLAS:
        blocks, padded_k, padded_n = blocks.fit(k, w.shape[2])
        padded = (padded_k, padded_n)
    return _gmm_jit(x, w, tile_expert.astype(jnp.int32), jnp.reshape(num_tiles, (1,)).astype(jnp.int32),
                    config=_Config(impl, blocks, impl == dispatch.XLA and use_ragged_dot()), padded=tuple(padded))


@dataclasses.dataclass(frozen=True)
class _Config:
    implementation: str
    blocks: GroupedMatmulBlockSizes
    ragged_dot: bool = False  # the XLA path on jax.lax.ragged_dot (`use_ragged_dot`)

    def transposed(self) -> _Config:
        """The config for the ``dy @ w^T`` product, whose k and n swap roles."""
        b = self.blocks
        return _Config(self.implementation, GroupedMatmulBlockSizes(b.block_rows, b.block_n, b.block_k),
                       self.ragged_dot)


@functools.partial(jax.jit, static_argnames=("config", "padded"))
def _gmm_jit(x, w, tile_expert, num_tiles, *, config: _Config, padded: tuple[int, int]):
    # k and n padded with zeros to whole blocks: zero columns of x meet zero rows of w, and the
    # extra output columns are cut off (their cotangents, zero, add nothing to dx or dw).
    k, n = w.shape[1:]
    pad_k, pad_n = padded[0] - k, padded[1] - n
    if pad_k or pad_n:
        x = jnp.pad(x, ((0, 0), (0, pad_k)))
        w = jnp.pad(w, ((0, 0), (0, pad_k), (0, pad_n)))
    return _gmm(x, w, tile_expert, num_tiles, config)[:, :n]


@functools.partial(jax.custom_vjp, nondiff_argnames=("config",))
def _gmm(x, w, tile_expert, num_tiles, config: _Config):
    return _matmul(x, w, tile_expert, num_tiles, config, transpose_rhs=False)


def _gmm_forward(x, w, tile_expert, num_tiles, config):
    return _gmm(x, w, tile_expert, num_tiles, config), (x, w, tile_expert, num_tiles)


def _gmm_backward(config, residuals, dy):
    x, w, tile_expert, num_tiles = residuals
    dx = _matmul(dy.astype(x.dtype), w, tile_expert, num_tiles, config.transposed(), transpose_rhs=True)
    dw = _weight_grad(x, dy.astype(x.dtype), tile_expert, num_tiles, w.shape[0], config)
    return dx, dw.astype(w.dtype), None, None


_gmm.defvjp(_gmm_forward, _gmm_backward)


def _matmul(x, w, tile_expert, num_tiles, config: _Config, *, transpose_rhs: bool):
    if config.implementation == dispatch.PALLAS:
        return _pallas_matmul(x, w, tile_expert, num_tiles, config.blocks, transpose_rhs=transpose_rhs)
    if config.ragged_dot:
        return _ragged_matmul(x, w, tile_expert, num_tiles, config.blocks.block_rows, transpose_rhs=transpose_rhs)
    return _xla_matmul(x, w, tile_expert, num_tiles, config.blocks.block_rows, transpose_rhs=transpose_rhs)


def _weight_grad(x, dy, tile_expert, num_tiles, num_experts: int, config: _Config):
    if config.implementation == dispatch.PALLAS:
        return _pallas_weight_grad(x, dy, tile_expert, num_tiles, num_experts, config.blocks)
    if config.ragged_dot:
        return _ragged_weight_grad(x, dy, tile_expert, num_tiles, num_experts, config.blocks.block_rows)
    return _xla_weight_grad(x, dy, tile_expert, num_tiles, num_experts, config.blocks.block_rows)


def use_ragged_dot() -> bool:
    """Whether the XLA path runs on ``jax.lax.ragged_dot``: on a GPU, where it is a grouped GEMM."""
    return dispatch.backend() == "gpu"


# --------------------------------------------------------------------------- Pallas path


def _real_tile(t, num_tiles_ref):
    """Tile ``t``, or the last real tile for padding tiles (so their blocks are not copied again)."""
    return jnp.minimum(t, num_tiles_ref[0] - 1)


def _pallas_matmul(x, w, tile_expert, num_tiles, blocks: GroupedMatmulBlockSizes, *, transpose_rhs: bool):
    rows, k = x.shape
    n = w.shape[1] if transpose_rhs else w.shape[2]
    bm, bk, bn = blocks.block_rows, blocks.block_k, blocks.block_n
    if transpose_rhs:  # w: [experts, n, k]
        w_spec = pl.BlockSpec((None, bn, bk), lambda t, j, kk, te, nt: (te[_real_tile(t, nt)], j, kk))
    else:  # w: [experts, k, n]
        w_spec = pl.BlockSpec((None, bk, bn), lambda t, j, kk, te, nt: (te[_real_tile(t, nt)], kk, j))
    return pl.pallas_call(
        functools.partial(_matmul_kernel, transpose_rhs=transpose_rhs),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(rows // bm, n // bn, k // bk),
            in_specs=[pl.BlockSpec((bm, bk), lambda t, j, kk, te, nt: (_real_tile(t, nt), kk)), w_spec],
            out_specs=pl.BlockSpec((bm, bn), lambda t, j, kk, te, nt: (t, j)),
            scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)]),
        out_shape=jax.ShapeDtypeStruct((rows, n), x.dtype),
        compiler_params=generations.compiler_params(("parallel", "parallel", "arbitrary")),
        interpret=dispatch.pallas_interpret(),
    )(tile_expert, num_tiles, x, w)


def _matmul_kernel(tile_expert_ref, num_tiles_ref, x_ref, w_ref, out_ref, acc_ref, *, transpose_rhs):
    del tile_expert_ref  # used by the index maps only
    kk = pl.program_id(2)

    @pl.when(kk == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(pl.program_id(0) < num_tiles_ref[0])
    def _accumulate():
        contract = (((1,), (1,)), ((), ())) if transpose_rhs else (((1,), (0,)), ((), ()))
        acc_ref[...] += lax.dot_general(x_ref[...], w_ref[...], contract, preferred_element_type=jnp.float32)

    @pl.when(kk == pl.num_programs(2) - 1)
    def _finish():  # padding tiles write the zeros they were initialized with
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def _pallas_weight_grad(x, dy, tile_expert, num_tiles, num_experts, blocks: GroupedMatmulBlockSizes):
    rows, k = x.shape
    n = dy.shape[1]
    bm, bk, bn = blocks.block_rows, blocks.block_k, blocks.block_n
    return pl.pallas_call(
        _weight_grad_kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(k // bk, n // bn, rows // bm),
            in_specs=[pl.BlockSpec((bm, bk), lambda kk, j, t, te, nt: (_real_tile(t, nt), kk)),
                      pl.BlockSpec((bm, bn), lambda kk, j, t, te, nt: (_real_tile(t, nt), j))],
            out_specs=pl.BlockSpec((None, bk, bn), lambda kk, j, t, te, nt: (te[t], kk, j)),
            scratch_shapes=[pltpu.VMEM((bk, bn), jnp.float32)]),
        out_shape=jax.ShapeDtypeStruct((num_experts, k, n), jnp.float32),
        compiler_params=generations.compiler_params(("parallel", "parallel", "arbitrary")),
        interpret=dispatch.pallas_interpret(),
    )(tile_expert, num_tiles, x, dy)


def _weight_grad_kernel(tile_expert_ref, num_tiles_ref, x_ref, dy_ref, dw_ref, acc_ref):
    t, last_tile = pl.program_id(2), pl.num_programs(2) - 1
    expert = tile_expert_ref[t]
    # Tiles are in expert order (padding tiles carry the last expert), so an expert's
    # tiles are consecutive and its output block stays resident across them.
    first_of_expert = (t == 0) | (tile_expert_ref[jnp.maximum(t - 1, 0)] != expert)
    last_of_expert = (t == last_tile) | (tile_expert_ref[jnp.minimum(t + 1, last_tile)] != expert)

    @pl.when(first_of_expert)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(t < num_tiles_ref[0])
    def _accumulate():
        acc_ref[...] += lax.dot_general(x_ref[...], dy_ref[...], (((0,), (0,)), ((), ())),
                                        preferred_element_type=jnp.float32)

    @pl.when(last_of_expert)
    def _finish():
        dw_ref[...] = acc_ref[...]


# --------------------------------------------------------------------------- XLA path


def _xla_matmul(x, w, tile_expert, num_tiles, block_rows: int, *, transpose_rhs: bool):
    rows, k = x.shape
    n = w.shape[1] if transpose_rhs else w.shape[2]
    tiles = x.reshape(rows // block_rows, block_rows, k)

    def tile_product(t):
        w_e = w[tile_expert[t]]
        contract = (((1,), (1,)), ((), ())) if transpose_rhs else (((1,), (0,)), ((), ()))
        return lax.cond(
            t < num_tiles[0],
            lambda: lax.dot_general(tiles[t], w_e, contract, preferred_element_type=jnp.float32).astype(x.dtype),
            lambda: jnp.zeros((block_rows, n), x.dtype))

    return lax.map(tile_product, jnp.arange(tiles.shape[0])).reshape(rows, n)


def _groups(tile_expert, num_tiles, num_experts: int, block_rows: int, rows: int):
    """Rows per expert of the layout (padding tiles belong to the last expert), and the mask of real rows."""
    group_sizes = jnp.bincount(tile_expert, length=num_experts).astype(jnp.int32) * block_rows
    real = (jnp.arange(rows) < num_tiles[0] * block_rows)[:, None]
    return group_sizes, real


def _ragged_matmul(x, w, tile_expert, num_tiles, block_rows: int, *, transpose_rhs: bool):
    group_sizes, real = _groups(tile_expert, num_tiles, w.shape[0], block_rows, x.shape[0])
    rhs = w.swapaxes(1, 2) if transpose_rhs else w  # [experts, k, n]
    y = lax.ragged_dot(x, rhs, group_sizes, preferred_element_type=jnp.float32)
    return jnp.where(real, y, 0.0).astype(x.dtype)  # padding tiles give zeros, as the contract says


def _ragged_weight_grad(x, dy, tile_expert, num_tiles, num_experts: int, block_rows: int):
    group_sizes, real = _groups(tile_expert, num_tiles, num_experts, block_rows, x.shape[0])
    per_group = lax.RaggedDotDimensionNumbers(  # contract the rows within each group: [experts, k, n]
        dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
    return lax.ragged_dot_general(jnp.where(real, x, 0), dy, group_sizes, per_group,
                                  preferred_element_type=jnp.float32)


def _xla_weight_grad(x, dy, tile_expert, num_tiles, num_experts: int, block_rows: int):
    rows, k = x.shape
    x_tiles = x.reshape(rows // block_rows, block_rows, k)
    dy_tiles = dy.reshape(rows // block_rows, block_rows, dy.shape[1])

    def add_tile(dw, t):
        def add(dw):
            update = lax.dot_general(x_tiles[t], dy_tiles[t], (((0,), (0,)), ((), ())),
                                     preferred_element_type=jnp.float32)
            return dw.at[tile_expert[t]].add(update)

        return lax.cond(t < num_tiles[0], add, lambda dw: dw, dw), None

    dw, _ = lax.scan(add_tile, jnp.zeros((num_experts, k, dy.shape[1]), jnp.float32), jnp.arange(x_tiles.shape[0]))
    return dw


# --------------------------------------------------------------------------- reference


def reference_grouped_matmul(x: jax.Array, w: jax.Array, row_expert: jax.Array) -> jax.Array:
    """``y[r] = x[r] @ w[row_expert[r]]`` computed densely (every expert, then select); ``-1`` rows give 0."""
    everything = jnp.einsum("rk,ekn->ren", x, w, preferred_element_type=jnp.float32)  # [rows, experts, n]
    onehot = jax.nn.one_hot(row_expert, w.shape[0], dtype=jnp.float32)  # all zero for -1
    return jnp.einsum("ren,re->rn", everything, onehot).astype(x.dtype)
