"""Lengths that the blocks do not divide run on every path: the block rule, and each op against its reference.

The issue's cases are here: 384 rows with ``block_rows=256`` (the norm, in test_norm.py),
``seq_len=200`` with ``block_q=128`` (attention), and the same kind of length for RoPE,
the scan and the grouped matmul (through the MoE layer), forward and backward, on the
Pallas kernels (TPU interpret mode) and the XLA paths.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_checks import assert_close, normal

from kernels import (
    BlockSizes,
    GroupedMatmulBlockSizes,
    RopeBlockSizes,
    ScanBlockSizes,
    apply_rope,
    attention,
    generations,
    linear_scan,
    moe_ffn,
    reference_attention,
)
from kernels.linear_scan import reference_linear_scan
from kernels.moe import reference_moe_ffn
from kernels.rope import reference_rope

PATHS = [pytest.param("pallas", id="pallas"), pytest.param("xla", id="xla")]


def _vjp(fn, args, d_out):
    out, vjp = jax.vjp(fn, *args)
    return out, vjp(d_out)


@pytest.mark.parametrize("length, block, align, want", [
    (384, 256, 8, (192, 384)),  # a divisor in [block / 2, block]: no padding
    (200, 128, 8, (104, 208)),  # none: the least padding
    (200, 512, 8, (200, 200)),  # shorter than the block: one whole block
    (600, 512, 128, (384, 768)),  # lane-aligned blocks only
    (7, 8, 8, (7, 7)),
])
def test_fit_block(length, block, align, want):
    fit = generations.fit_block(length, block, align=align)
    assert (fit.block, fit.padded) == want
    assert fit.padded % fit.block == 0
    assert fit.block == length or fit.block % align == 0


def test_fit_block_rejects_unaligned_requests():
    with pytest.raises(ValueError, match="block=100 must be a positive multiple of 8"):
        generations.fit_block(300, 100)


def test_backward_blocks_fit_on_their_own():
    blocks = BlockSizes(128, 128, block_q_bwd=64, block_kv_bwd=64)
    forward, backward = blocks.tiling(200, 200), blocks.tiling(200, 200, backward=True)
    assert (forward.block_q, forward.q_len, forward.block_kv, forward.kv_len) == (104, 208, 128, 256)
    assert (backward.block_q, backward.q_len, backward.block_kv, backward.kv_len) == (40, 200, 40, 200)


@pytest.mark.parametrize("implementation", PATHS)
@pytest.mark.parametrize("causal", [pytest.param(True, id="causal"), pytest.param(False, id="bidirectional")])
def test_attention_seq_len_200_with_block_128(implementation, causal):
    rng = np.random.default_rng(0)
    q = normal(rng, (1, 200, 2, 32), jnp.float32)
    k, v = (normal(rng, (1, 200, 1, 32), jnp.float32) for _ in "kv")
    d_out = normal(rng, q.shape, jnp.float32)
    blocks = BlockSizes(128, 128, block_q_bwd=64, block_kv_bwd=64)
    kernel = functools.partial(attention, causal=causal, implementation=implementation, block_sizes=blocks)
    got = _vjp(kernel, (q, k, v), d_out)
    want = _vjp(jax.jit(functools.partial(reference_attention, causal=causal)), (q, k, v), d_out)
    assert_close(got, want, want, dtype=jnp.float32)


@pytest.mark.parametrize("implementation", PATHS)
def test_rope_seq_len_200_with_block_128(implementation):
    rng = np.random.default_rng(1)
    x = normal(rng, (1, 200, 2, 32), jnp.float32)
    positions = jnp.asarray(np.arange(200)[None], jnp.int32)
    d_out = normal(rng, x.shape, jnp.float32)
    kernel = functools.partial(apply_rope, positions=positions, implementation=implementation,
                               block_sizes=RopeBlockSizes(128))
    got = _vjp(kernel, (x,), d_out)
    want = _vjp(jax.jit(functools.partial(reference_rope, positions=positions)), (x,), d_out)
    assert_close(got, want, want, dtype=jnp.float32)


@pytest.mark.parametrize("implementation", PATHS)
def test_scan_time_200_dim_160_with_blocks_128(implementation):
    rng = np.random.default_rng(2)
    a = jnp.asarray(rng.uniform(0.5, 1.0, (1, 200, 160)).astype(np.float32))
    b = normal(rng, a.shape, jnp.float32)
    d_out = normal(rng, a.shape, jnp.float32)
    kernel = functools.partial(linear_scan, implementation=implementation, block_sizes=ScanBlockSizes(128, 128))
    got = _vjp(kernel, (a, b), d_out)
    want = _vjp(jax.jit(reference_linear_scan), (a, b), d_out)
    assert_close(got, want, want, dtype=jnp.float32)


@pytest.mark.parametrize("implementation", PATHS)
def test_moe_d_ff_160_with_block_128(implementation):
    """The grouped matmuls' n (then k, in the second product) of 160 with 128-blocks: padded to 256."""
    rng = np.random.default_rng(3)
    tokens, d_model, d_ff, experts = 20, 40, 160, 3
    params = (normal(rng, (tokens, d_model), jnp.float32), normal(rng, (d_model, experts), jnp.float32),
              normal(rng, (experts, d_model, d_ff), jnp.float32, scale=d_model ** -0.5),
              normal(rng, (experts, d_ff, d_model), jnp.float32, scale=d_ff ** -0.5))
    d_y = normal(rng, (tokens, d_model), jnp.float32)

    def first(fn):
        return lambda *p: fn(*p)[0]

    kernel = functools.partial(moe_ffn, top_k=2, implementation=implementation,
                               block_sizes=GroupedMatmulBlockSizes(8, 128, 128))
    got = _vjp(first(kernel), params, d_y)
    want = _vjp(jax.jit(first(functools.partial(reference_moe_ffn, top_k=2))), params, d_y)
    assert_close(got, want, want, dtype=jnp.float32)
