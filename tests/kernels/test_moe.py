"""Mixture of experts: routing, grouping and capacity, and every implementation against the dense reference."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_checks import IMPLEMENTATIONS, as_f32, assert_close, normal

from kernels import GroupedMatmulBlockSizes, moe_ffn
from kernels.moe import group_by_expert, load_balancing_loss, reference_moe_ffn, route

TOKENS, D_MODEL, D_FF, EXPERTS = 24, 64, 128, 4
BLOCKS = GroupedMatmulBlockSizes(8, 128, 128)


def _inputs(dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = normal(rng, (TOKENS, D_MODEL), dtype)
    router_w = normal(rng, (D_MODEL, EXPERTS), jnp.float32)  # routers are kept in f32
    w_in = normal(rng, (EXPERTS, D_MODEL, D_FF), dtype, scale=D_MODEL ** -0.5)
    w_out = normal(rng, (EXPERTS, D_FF, D_MODEL), dtype, scale=D_FF ** -0.5)
    d_y = normal(rng, (TOKENS, D_MODEL), dtype)
    return (x, router_w, w_in, w_out), d_y


def _run(fn, params, d_y):
    """``(y, aux, gradients of sum(y * d_y) + 0.5 * aux)`` and the stats."""
    def outputs(*params):
        y, aux, stats = fn(*params)
        return (y, aux), stats

    (y, aux), vjp, stats = jax.vjp(outputs, *params, has_aux=True)
    return (y, aux, vjp((d_y, jnp.float32(0.5)))), stats


@functools.cache
def _references(dtype, capacity_factor):
    """((f32 reference, stats), same-dtype reference), computed once for all implementations."""
    params, d_y = _inputs(dtype)
    reference = jax.jit(functools.partial(reference_moe_ffn, top_k=2, capacity_factor=capacity_factor))
    want_f32 = _run(reference, as_f32(params), as_f32(d_y))
    return want_f32, want_f32[0] if dtype == jnp.float32 else _run(reference, params, d_y)[0]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype, capacity_factor", [
    pytest.param(jnp.float32, None, id="dropless-f32"),
    pytest.param(jnp.bfloat16, 0.75, id="capacity0.75-bf16"),
])
def test_matches_reference(implementation, dtype, capacity_factor):
    params, d_y = _inputs(dtype)
    kernel = functools.partial(moe_ffn, top_k=2, capacity_factor=capacity_factor, implementation=implementation,
                               block_sizes=BLOCKS)
    got, got_stats = _run(kernel, params, d_y)
    (want_f32, want_stats), want_same_dtype = _references(dtype, capacity_factor)
    assert_close(got, want_f32, want_same_dtype, dtype=dtype)
    assert int(got_stats["dropped_tokens"]) == int(want_stats["dropped_tokens"])
    np.testing.assert_array_equal(got_stats["tokens_per_expert"], want_stats["tokens_per_expert"])
    if capacity_factor is None:
        assert int(got_stats["dropped_tokens"]) == 0
    else:
        assert int(got_stats["dropped_tokens"]) > 0, "the case should overflow some expert"


def test_capacity_drops_the_latest_choices_and_counts_them():
    experts = jnp.asarray([[0, 1], [0, 2], [0, 1], [0, 3], [1, 0]], jnp.int32)  # expert 0 chosen 5 times
    layout = group_by_expert(experts, 4, capacity=3, block_rows=8)
    rows = np.asarray(layout.rows).reshape(5, 2)
    num_rows = layout.tile_expert.shape[0] * 8
    dropped = rows == num_rows
    np.testing.assert_array_equal(dropped, [[0, 0], [0, 0], [0, 0], [1, 0], [0, 1]])  # the 4th and 5th of expert 0
    assert int(layout.dropped) == 2
    np.testing.assert_array_equal(layout.tokens_per_expert, [5, 3, 1, 1])
    # Kept rows are distinct and lie in a tile of their own expert; every expert has a tile.
    kept = rows[~dropped]
    assert len(set(kept.tolist())) == kept.size
    np.testing.assert_array_equal(layout.tile_expert[kept // 8], np.asarray(experts)[~dropped])
    assert set(np.asarray(layout.tile_expert[: int(layout.num_tiles)]).tolist()) == {0, 1, 2, 3}
    assert bool(jnp.all(jnp.diff(layout.tile_expert) >= 0))


def test_dropless_layout_keeps_every_choice():
    experts = jnp.asarray(np.random.default_rng(0).integers(0, 3, size=(50, 2)), jnp.int32)  # expert 3 idle
    layout = group_by_expert(experts, 4, capacity=None, block_rows=8)
    rows = np.asarray(layout.rows)
    assert int(layout.dropped) == 0 and len(set(rows.tolist())) == rows.size
    assert rows.max() < layout.tile_expert.shape[0] * 8


def test_load_balancing_loss_is_one_when_balanced_and_grows_when_not():
    uniform = jnp.full((8, 4), 0.25)
    assert float(load_balancing_loss(uniform, jnp.asarray([[0], [1], [2], [3]] * 2))) == pytest.approx(1.0)
    skewed = jnp.asarray([[0.7, 0.1, 0.1, 0.1]] * 8)
    assert float(load_balancing_loss(skewed, jnp.zeros((8, 1), jnp.int32))) == pytest.approx(4 * 0.7)


def test_bad_arguments_are_rejected():
    params, _ = _inputs(jnp.float32)
    with pytest.raises(ValueError, match="top_k=5 must be in"):
        moe_ffn(*params, top_k=5)
    with pytest.raises(ValueError, match="w_out must be"):
        moe_ffn(params[0], params[1], params[2], params[3][:, :64])


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_top1_router_learns_from_the_task_loss(implementation):
    """With top_k=1 the gate is the chosen expert's probability (Switch), so the task loss alone moves the router.

    Renormalized, the gate would be exactly 1 and this gradient exactly zero.
    """
    params, d_y = _inputs(jnp.float32)

    def task_loss(router_w, fn):
        y, _, _ = fn(params[0], router_w, params[2], params[3])  # the aux loss left out
        return jnp.sum(y * d_y)

    kernel = functools.partial(moe_ffn, top_k=1, implementation=implementation, block_sizes=BLOCKS)
    got = jax.grad(task_loss)(params[1], kernel)
    want = jax.grad(task_loss)(params[1], functools.partial(reference_moe_ffn, top_k=1))
    assert float(jnp.abs(got).max()) > 1e-3
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    gates, _, probs = jax.jit(route, static_argnums=2)(params[0], params[1], 1)
    np.testing.assert_allclose(gates[:, 0], probs.max(axis=-1), rtol=1e-6)
    assert float(gates.min()) < 0.99  # not renormalized to 1
