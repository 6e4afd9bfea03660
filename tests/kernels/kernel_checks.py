"""Shared pieces of the kernel test suites: the tolerance rule, inputs, implementations.

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


def _max_abs(a, b) -> float:
    return float(jnp.max(jnp.abs(jnp.asarray(a, jnp.float32) - jnp.asarray(b, jnp.float32))))


def assert_close(got, want_f32, want_same_dtype, *, dtype, what: str = "") -> None:
    """Apply the tolerance rule leaf by leaf to pytrees of arrays (outputs, gradients)."""
    paths_and_got, treedef = jax.tree_util.tree_flatten_with_path(got)
    want_leaves = treedef.flatten_up_to(want_f32)
    plain_leaves = treedef.flatten_up_to(want_same_dtype)
    for (path, g), w, r in zip(paths_and_got, want_leaves, plain_leaves):
        name = f"{what}{jax.tree_util.keystr(path)}"
        assert g.shape == w.shape, f"{name}: shape {g.shape} != {w.shape}"
        assert bool(jnp.all(jnp.isfinite(jnp.asarray(g, jnp.float32)))), f"{name}: non-finite values"
        err, ref_err = _max_abs(g, w), _max_abs(r, w)
        atol = ATOL[jnp.dtype(dtype)] * (1.0 + float(jnp.max(jnp.abs(jnp.asarray(w, jnp.float32)))))
        assert err <= 2 * ref_err + atol, (
            f"{name}: error {err:.3g} > 2 x plain-reference error {ref_err:.3g} + atol {atol:.2g}")


def normal(key, shape, dtype, scale: float = 1.0) -> jax.Array:
    """Random normal values already representable in ``dtype`` (cast back with ``.astype(f32)``)."""
    return (scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def as_f32(tree):
    return jax.tree.map(lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def packed_segment_ids(rng: np.random.Generator, batch: int, seq: int, max_docs: int = 4) -> jax.Array:
    """``[batch, seq]`` int32 ids of documents packed back to back, boundaries at random."""
    rows = []
    for _ in range(batch):
        cuts = np.sort(rng.choice(np.arange(1, seq), size=rng.integers(1, max_docs), replace=False))
        rows.append(np.searchsorted(cuts, np.arange(seq), side="right"))
    return jnp.asarray(np.stack(rows), jnp.int32)
