"""Rotary position embedding: every implementation against the reference; the rotation's algebra."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_checks import DTYPES, IMPLEMENTATIONS, as_f32, assert_close, normal

from kernels import RopeBlockSizes, apply_rope
from kernels.rope import reference_rope


def _inputs(dtype, seq=48):
    rng = np.random.default_rng(0)
    x = normal(rng, (2, seq, 3, 64), dtype)
    d_out = normal(rng, x.shape, dtype)
    # Two packed documents per row: positions restart at the boundary.
    positions = jnp.asarray(np.stack([np.r_[np.arange(20), np.arange(seq - 20)], np.arange(100, 100 + seq)]),
                            jnp.int32)
    return x, positions, d_out


def _value_and_grad(fn, x, d_out):
    out, vjp = jax.vjp(fn, x)
    return out, vjp(d_out)


@functools.cache
def _references(dtype):
    """(f32 reference, same-dtype reference), computed once for all implementations."""
    x, positions, d_out = _inputs(dtype)
    reference = jax.jit(functools.partial(reference_rope, positions=positions, base=500.0))
    want_f32 = _value_and_grad(reference, as_f32(x), as_f32(d_out))
    return want_f32, want_f32 if dtype == jnp.float32 else _value_and_grad(reference, x, d_out)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference(implementation, dtype):
    x, positions, d_out = _inputs(dtype)
    kernel = functools.partial(apply_rope, positions=positions, base=500.0, implementation=implementation,
                               block_sizes=RopeBlockSizes(16))
    assert_close(_value_and_grad(kernel, x, d_out), *_references(dtype), dtype=dtype)


def test_rotation_preserves_norms_and_relative_positions():
    """|rope(x)| = |x|, and <rope(q, p), rope(k, p')> depends on p - p' only."""
    rope = jax.jit(reference_rope)
    x = normal(np.random.default_rng(1), (1, 16, 2, 64), jnp.float32)
    q, k = x[:, :1], x[:, 1:2]
    rotated = rope(x, jnp.arange(16, dtype=jnp.int32)[None] * 37)
    np.testing.assert_allclose(jnp.linalg.norm(rotated, axis=-1), jnp.linalg.norm(x, axis=-1), rtol=1e-5)

    def score(p_q, p_k):
        rq = rope(q, jnp.full((1, 1), p_q, jnp.int32))
        rk = rope(k, jnp.full((1, 1), p_k, jnp.int32))
        return float(jnp.sum(rq * rk))

    assert score(7, 3) == pytest.approx(score(104, 100), rel=1e-4)


def test_bad_shapes_are_rejected():
    with pytest.raises(ValueError, match="block_seq must be a positive multiple of 8"):
        RopeBlockSizes(12)
    with pytest.raises(ValueError, match="head_dim=63 must be even"):
        apply_rope(jnp.zeros((1, 40, 2, 63)), jnp.zeros((1, 40), jnp.int32))
