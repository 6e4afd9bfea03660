"""Linear recurrence scan: every implementation against the sequential reference, with gradients."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_checks import IMPLEMENTATIONS, as_f32, assert_close, normal, uniform

from kernels import ScanBlockSizes, linear_scan
from kernels.linear_scan import reference_linear_scan

# (dtype, [batch, time, dim], blocks, with h0): 3 time blocks of 32 carried across; 3 time
# blocks x 2 feature blocks.
CASES = [
    pytest.param(jnp.float32, (2, 96, 64), ScanBlockSizes(32, 64), True, id="f32-2x96x64-h0"),
    pytest.param(jnp.bfloat16, (1, 48, 256), ScanBlockSizes(16, 128), False, id="bf16-1x48x256"),
]


def _inputs(dtype, shape):
    rng = np.random.default_rng(0)
    a = uniform(rng, shape, dtype, 0.6, 1.0)  # decays: a stable recurrence
    b = normal(rng, shape, dtype)
    h0 = normal(rng, (shape[0], shape[2]), dtype)
    d_out = normal(rng, shape, dtype)
    return (a, b, h0), d_out


def _value_and_grads(fn, args, d_out):
    out, vjp = jax.vjp(fn, *args)
    return out, vjp(d_out)


@functools.cache
def _references(dtype, shape, with_h0):
    """(f32 reference, same-dtype reference), computed once for all implementations."""
    (a, b, h0), d_out = _inputs(dtype, shape)
    args = (a, b, h0) if with_h0 else (a, b)
    reference = jax.jit(reference_linear_scan)
    want_f32 = _value_and_grads(reference, as_f32(args), as_f32(d_out))
    return want_f32, want_f32 if dtype == jnp.float32 else _value_and_grads(reference, args, d_out)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype, shape, blocks, with_h0", CASES)
def test_matches_reference(implementation, dtype, shape, blocks, with_h0):
    (a, b, h0), d_out = _inputs(dtype, shape)
    args = (a, b, h0) if with_h0 else (a, b)

    def kernel(a, b, h0=None):
        return linear_scan(a, b, h0=h0, implementation=implementation, block_sizes=blocks)

    got = _value_and_grads(kernel, args, d_out)
    assert_close(got, *_references(dtype, shape, with_h0), dtype=dtype)


def test_bad_shapes_are_rejected():
    a = jnp.zeros((1, 100, 64))
    with pytest.raises(ValueError, match="block_dim must be a positive multiple of 8"):
        ScanBlockSizes(64, 100)
    with pytest.raises(ValueError, match=r"h0 must be \[batch, dim\]"):
        linear_scan(a, a, h0=jnp.zeros((1, 32)))
