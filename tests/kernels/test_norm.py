"""RMSNorm and LayerNorm: every implementation against the plain reference, outputs and gradients."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_checks import IMPLEMENTATIONS, as_f32, assert_close, normal

from kernels import NormBlockSizes, layer_norm, rms_norm
from kernels.norm import reference_norm

# (norm, dtype, x shape, rows per block): both norms (one kernel, two variants), both
# dtypes, over 3 blocks of 16 rows and over 3 blocks of 8 rows of a feature size that is
# not a power of two.
CASES = [
    pytest.param(False, jnp.float32, (2, 24, 128), 16, id="rms-f32-48x128"),
    pytest.param(True, jnp.bfloat16, (3, 8, 96), 8, id="layer-bf16-24x96"),
]


def _value_and_grads(fn, args, d_out):
    out, vjp = jax.vjp(fn, *args)
    return out, vjp(d_out)


def _inputs(shape, dtype, centered: bool):
    rng = np.random.default_rng(0)
    x = normal(rng, shape, dtype, scale=2.0, shift=0.5)  # off-center rows exercise LayerNorm's mean
    weight = normal(rng, shape[-1:], jnp.float32, scale=0.1, shift=1.0)
    bias = normal(rng, shape[-1:], jnp.float32, scale=0.1)
    d_out = normal(rng, shape, dtype)
    return ((x, weight, bias) if centered else (x, weight)), d_out


def _reference(centered: bool):
    if centered:
        return jax.jit(functools.partial(reference_norm, eps=1e-5))
    return jax.jit(lambda x, w: reference_norm(x, w, None, eps=1e-6))


@functools.cache
def _references(centered, dtype, shape):
    """(f32 reference, same-dtype reference), computed once for all implementations."""
    args, d_out = _inputs(shape, dtype, centered)
    reference = _reference(centered)
    want_f32 = _value_and_grads(reference, as_f32(args), as_f32(d_out))
    return want_f32, want_f32 if dtype == jnp.float32 else _value_and_grads(reference, args, d_out)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("centered, dtype, shape, block_rows", CASES)
def test_matches_reference(implementation, centered, dtype, shape, block_rows):
    args, d_out = _inputs(shape, dtype, centered)
    options = {"implementation": implementation, "block_sizes": NormBlockSizes(block_rows)}
    if centered:
        kernel = functools.partial(layer_norm, eps=1e-5, **options)
    else:
        kernel = functools.partial(rms_norm, eps=1e-6, **options)
    got = _value_and_grads(kernel, args, d_out)
    assert_close(got, *_references(centered, dtype, shape), dtype=dtype)


@pytest.mark.parametrize("rows, block_rows, want_block, want_padded", [
    pytest.param(384, 256, 192, 384, id="384-rows-divisor"),  # the global_batch_size 12 on v4-8
    pytest.param(300, 256, 152, 304, id="300-rows-padded"),
])
def test_rows_that_blocks_do_not_divide_run_on_pallas(rows, block_rows, want_block, want_padded):
    fit = NormBlockSizes(block_rows).fit(rows, 128)
    assert (fit.block, fit.padded) == (want_block, want_padded)
    shape = (rows // 4, 4, 128)
    args, d_out = _inputs(shape, jnp.float32, centered=False)
    kernel = functools.partial(rms_norm, eps=1e-6, implementation="pallas", block_sizes=NormBlockSizes(block_rows))
    got = _value_and_grads(kernel, args, d_out)
    want = _value_and_grads(_reference(False), args, d_out)
    assert_close(got, want, want, dtype=jnp.float32)


def test_bad_arguments_are_rejected():
    x = jnp.zeros((3, 100, 64))
    with pytest.raises(ValueError, match="block_rows must be a positive multiple of 8"):
        NormBlockSizes(100)
    with pytest.raises(ValueError, match=r"weight must be \[d\]"):
        layer_norm(x, jnp.ones(32), jnp.zeros(64))
    with pytest.raises(ValueError, match="valid: 'pallas', 'xla'"):
        rms_norm(x, jnp.ones(64), implementation="cudnn")
