"""Shared pieces of the kernel test suites: the tolerance rule, inputs, implementations.

(``tests/kernels`` has no ``__init__.py`` on purpose: as a package it would be named
``kernels`` and shadow the package under test; pytest puts this directory on the path.)

Tolerance rule: an implementation's error against the reference computed in f32 (on
the same, already rounded inputs) may be at most twice the error of the plain reference
computed in the inputs' own dtype, plus a small ``atol`` scaled by the result's size.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# Every implementation of an op runs the op's whole suite; None is the backend's default
# (on this CPU-only machine "xla", checked in test_dispatch.py).
IMPLEMENTATIONS = [
    pytest.param("pallas", id="pallas"),
    pytest.param("xla", id="xla"),
    pytest.param(None, id="default"),
]

DTYPES = [pytest.param(jnp.float32, id="f32"), pytest.param(jnp.bfloat16, id="bf16")]

ATOL = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 1e-3}

# Inputs, conversions and comparisons run in NumPy: every eager JAX op would compile a
# small XLA program per shape, which adds up to a large share of the suite's time.


def _np_f32(x) -> np.ndarray:
    return np.asarray(x).astype(np.float32)


def assert_close(got, want_f32, want_same_dtype, *, dtype, what: str = "") -> None:
    """Apply the tolerance rule leaf by leaf to pytrees of arrays (outputs, gradients)."""
    paths_and_got, treedef = jax.tree_util.tree_flatten_with_path(got)
    want_leaves = treedef.flatten_up_to(want_f32)
    plain_leaves = treedef.flatten_up_to(want_same_dtype)
    for (path, g), w, r in zip(paths_and_got, want_leaves, plain_leaves, strict=True):
        name = f"{what}{jax.tree_util.keystr(path)}"
        g, w, r = _np_f32(g), _np_f32(w), _np_f32(r)
        assert g.shape == w.shape, f"{name}: shape {g.shape} != {w.shape}"
        assert np.isfinite(g).all(), f"{name}: non-finite values"
        err, ref_err = float(np.abs(g - w).max(initial=0)), float(np.abs(r - w).max(initial=0))
        atol = ATOL[jnp.dtype(dtype)] * (1.0 + float(np.abs(w).max(initial=0)))
        assert err <= 2 * ref_err + atol, (
            f"{name}: error {err:.3g} > 2 x plain-reference error {ref_err:.3g} + atol {atol:.2g}")


def normal(rng: np.random.Generator, shape, dtype, scale: float = 1.0, shift: float = 0.0) -> jax.Array:
    """``shift + scale * N(0, 1)`` values, already representable in ``dtype``."""
    values = (shift + scale * rng.standard_normal(shape)).astype(np.float32)
    return jnp.asarray(values.astype(jnp.dtype(dtype)))


def uniform(rng: np.random.Generator, shape, dtype, low: float, high: float) -> jax.Array:
    return jnp.asarray(rng.uniform(low, high, shape).astype(np.float32).astype(jnp.dtype(dtype)))


def as_f32(tree):
    """Floating leaves upcast to f32 (exactly: the values are the same)."""
    def upcast(x):
        return jnp.asarray(_np_f32(x)) if jnp.issubdtype(x.dtype, jnp.floating) else x

    return jax.tree.map(upcast, tree)


def packed_segment_ids(rng: np.random.Generator, batch: int, seq: int, max_docs: int = 4) -> jax.Array:
    """``[batch, seq]`` int32 ids of documents packed back to back, boundaries at random."""
    rows = []
    for _ in range(batch):
        cuts = np.sort(rng.choice(np.arange(1, seq), size=rng.integers(1, max_docs), replace=False))
        rows.append(np.searchsorted(cuts, np.arange(seq), side="right"))
    return jnp.asarray(np.stack(rows), jnp.int32)
