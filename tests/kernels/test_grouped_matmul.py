"""Grouped matmul: every implementation against the dense reference, with the MoE row layout."""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_checks import IMPLEMENTATIONS, as_f32, assert_close, normal

from kernels import GroupedMatmulBlockSizes, grouped_matmul
from kernels.grouped_matmul import reference_grouped_matmul
from kernels.moe import group_by_expert

grouped_matmul_module = importlib.import_module("kernels.grouped_matmul")  # the package exports a function by that name


def _layout(num_choices: int, num_experts: int, block_rows: int, seed: int = 0):
    """A layout for random choices that leave expert 2 idle (it still owns one, empty, tile)."""
    rng = np.random.default_rng(seed)
    experts = rng.choice([e for e in range(num_experts) if e != 2], size=(num_choices, 1))
    return group_by_expert(jnp.asarray(experts, jnp.int32), num_experts, capacity=None, block_rows=block_rows)


# (dtype, choices, experts, k, n, block_rows): padding tiles at the end, an idle expert, and
# two k and two n blocks (the contraction accumulated across grid steps). bf16 runs through
# these kernels in test_moe.py's bf16 case.
CASES = [
    pytest.param(jnp.float32, 40, 4, 256, 256, GroupedMatmulBlockSizes(8, 128, 128), id="f32-k2n2blocks"),
]


def _value_and_grads(fn, x, w, d_out):
    out, vjp = jax.vjp(fn, x, w)
    return out, vjp(d_out)


def _inputs(dtype, num_choices, num_experts, k, n, block_rows):
    layout = _layout(num_choices, num_experts, block_rows)
    num_rows = layout.tile_expert.shape[0] * block_rows
    rng = np.random.default_rng(0)
    occupied = np.zeros(num_rows, bool)
    occupied[np.asarray(layout.rows)] = True
    x = normal(rng, (num_rows, k), dtype)
    x = jnp.asarray(np.where(occupied[:, None], np.asarray(x), 0).astype(x.dtype))  # unused rows are 0, as in moe_ffn
    w = normal(rng, (num_experts, k, n), dtype, scale=k ** -0.5)
    d_out = normal(rng, (num_rows, n), dtype)
    return layout, (x, w, d_out)


@functools.cache
def _references(dtype, num_choices, num_experts, k, n, block_rows):
    """(f32 reference, same-dtype reference), computed once for all implementations."""
    layout, (x, w, d_out) = _inputs(dtype, num_choices, num_experts, k, n, block_rows)
    tile = np.arange(x.shape[0]) // block_rows
    row_expert = np.where(tile < int(layout.num_tiles), np.asarray(layout.tile_expert)[tile], -1)  # -1: padding
    reference = jax.jit(functools.partial(reference_grouped_matmul, row_expert=row_expert))
    want_f32 = _value_and_grads(reference, *as_f32((x, w, d_out)))
    return want_f32, want_f32 if dtype == jnp.float32 else _value_and_grads(reference, x, w, d_out)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype, num_choices, num_experts, k, n, blocks", CASES)
def test_matches_reference(implementation, dtype, num_choices, num_experts, k, n, blocks):
    layout, (x, w, d_out) = _inputs(dtype, num_choices, num_experts, k, n, blocks.block_rows)
    assert int(layout.num_tiles) < layout.tile_expert.shape[0], "the case should have padding tiles"
    kernel = functools.partial(grouped_matmul, tile_expert=layout.tile_expert, num_tiles=layout.num_tiles,
                               implementation=implementation, block_sizes=blocks)
    got = _value_and_grads(kernel, x, w, d_out)
    assert_close(got, *_references(dtype, num_choices, num_experts, k, n, blocks.block_rows), dtype=dtype)
    # The idle expert's weight gradient is written, as zeros (an unwritten block would be NaN here).
    assert not np.asarray(got[1][1][2]).any()


@pytest.mark.parametrize("dtype, num_choices, num_experts, k, n, blocks", CASES)
def test_ragged_dot_path_matches_reference(monkeypatch, dtype, num_choices, num_experts, k, n, blocks):
    """The GPU's XLA path (``jax.lax.ragged_dot`` over the layout's groups), run here on the CPU."""
    monkeypatch.setattr(grouped_matmul_module, "use_ragged_dot", lambda: True)
    layout, (x, w, d_out) = _inputs(dtype, num_choices, num_experts, k, n, blocks.block_rows)
    x = x.at[-1].set(1.0)  # a padding row that is not zero: its output must still be
    kernel = functools.partial(grouped_matmul, tile_expert=layout.tile_expert, num_tiles=layout.num_tiles,
                               implementation="xla", block_sizes=blocks)
    got = _value_and_grads(kernel, x, w, d_out)
    want = _references(dtype, num_choices, num_experts, k, n, blocks.block_rows)
    assert not np.asarray(got[0][-1]).any()
    got = (got[0], (got[1][0].at[-1].set(0.0), got[1][1]))  # the padding row's dx is free; its x was 0 there
    assert_close(got, *want, dtype=dtype)
    assert "ragged_dot" in str(jax.make_jaxpr(kernel)(x, w))


def test_bad_block_sizes_are_rejected():
    with pytest.raises(ValueError, match="block_rows must be a positive multiple of 8, got 12"):
        GroupedMatmulBlockSizes(block_rows=12)
