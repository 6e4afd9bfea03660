"""Attention: every implementation against the naive reference and jax.nn's, plus block skipping."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from kernel_checks import (
    IMPLEMENTATIONS,
    as_f32,
    assert_close,
    normal,
    packed_segment_ids,
)

from kernels import BlockSizes, attention, reference_attention
from kernels.attention_mask import MaskBand

_BLOCKS = BlockSizes(32, 64)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    batch: int = 1
    q_len: int = 128
    kv_len: int = 128
    heads: int = 2
    kv_heads: int = 2
    head_dim: int = 32
    causal: bool = True
    window: int | None = None
    segments: bool = False
    blocks: BlockSizes = _BLOCKS
    # Keys [0, unreachable_keys) lie outside every query's band, in whole key blocks. The
    # implementations get them as NaN (touching their blocks at all would spread NaN), the
    # references as zeros.
    unreachable_keys: int = 0

    def __str__(self):
        return self.name

    @property
    def jax_nn_supports(self) -> bool:
        """jax.nn.dot_product_attention aligns causal/window masks top-left: same as ours only if q_len == kv_len."""
        return self.q_len == self.kv_len or not (self.causal or self.window)


CASES = {
    case.name: case for case in [
        Case("causal_gqa2_segments_batch2", batch=2, kv_heads=1, segments=True),
        Case("window40_mqa_len192", q_len=192, kv_len=192, kv_heads=1, window=40),
        Case("bidirectional_window24_segments_len96", q_len=96, kv_len=96, causal=False, window=24,
             segments=True, blocks=BlockSizes(32, 32)),
        # 64 queries decode against 256 keys: they sit at positions 192..255 and, with a
        # 48-token window, see keys 145..255, so key blocks 0 and 1 (keys 0..127) are skipped.
        Case("decode_window48_gqa2_q64_kv256", q_len=64, kv_len=256, heads=4, window=48, unreachable_keys=128),
        Case("bidirectional_gqa2_batch2", batch=2, heads=4, causal=False),  # no mask at all
    ]
}
SUITE = [
    pytest.param(CASES[name], dtype, id=f"{name}-{dtype_name}")
    for name, dtype, dtype_name in [
        ("causal_gqa2_segments_batch2", jnp.float32, "f32"),
        ("window40_mqa_len192", jnp.float32, "f32"),
        ("bidirectional_window24_segments_len96", jnp.float32, "f32"),
        ("decode_window48_gqa2_q64_kv256", jnp.float32, "f32"),
        ("bidirectional_gqa2_batch2", jnp.bfloat16, "bf16"),
    ]
]


def _inputs(case: Case, dtype, seed: int = 0, *, poisoned: bool = False):
    """``((q, k, v), d_out, segment_ids)``; unreachable keys are NaN if ``poisoned``, else zero."""
    rng = np.random.default_rng(seed)
    q = normal(rng, (case.batch, case.q_len, case.heads, case.head_dim), dtype)
    k, v = (np.array(normal(rng, (case.batch, case.kv_len, case.kv_heads, case.head_dim), dtype)) for _ in "kv")
    d_out = normal(rng, q.shape, dtype)
    segment_ids = packed_segment_ids(rng, case.batch, case.q_len) if case.segments else None
    k[:, :case.unreachable_keys] = v[:, :case.unreachable_keys] = np.nan if poisoned else 0.0
    return (q, jnp.asarray(k), jnp.asarray(v)), d_out, segment_ids


def _value_and_grads(fn, qkv, d_out):
    """Output and input gradients for cotangent ``d_out``; ``fn`` is jitted by the caller."""
    out, vjp = jax.vjp(fn, *qkv)
    return out, vjp(d_out)


def _jax_nn_attention(q, k, v, *, case: Case, segment_ids):
    mask = None
    if segment_ids is not None:
        mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]  # [batch, 1, q_len, kv_len]
    window = None
    if case.window is not None:
        window = (case.window - 1, 0 if case.causal else case.window - 1)
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=case.causal, local_window_size=window,
                                        implementation="xla")


@functools.cache
def _references(case: Case, dtype):
    """(f32 reference, same-dtype reference, jax.nn's f32 result or None), shared by all implementations."""
    qkv, d_out, segment_ids = _inputs(case, dtype)
    options = {"causal": case.causal, "window": case.window, "segment_ids": segment_ids}
    reference = jax.jit(functools.partial(reference_attention, **options))
    want_f32 = _value_and_grads(reference, as_f32(qkv), as_f32(d_out))
    want_same_dtype = want_f32 if dtype == jnp.float32 else _value_and_grads(reference, qkv, d_out)
    independent = None
    if case.jax_nn_supports:
        jax_nn = jax.jit(functools.partial(_jax_nn_attention, case=case, segment_ids=segment_ids))
        independent = _value_and_grads(jax_nn, as_f32(qkv), as_f32(d_out))
        assert_close(want_f32, independent, independent, dtype=jnp.float32, what=f"reference vs jax.nn {case}")
    return want_f32, want_same_dtype, independent


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("case, dtype", SUITE)
def test_matches_references(implementation, case: Case, dtype):
    qkv, d_out, segment_ids = _inputs(case, dtype, poisoned=True)
    kernel = functools.partial(attention, causal=case.causal, window=case.window, segment_ids=segment_ids,
                               implementation=implementation, block_sizes=case.blocks)
    got = _value_and_grads(kernel, qkv, d_out)
    want_f32, want_same_dtype, independent = _references(case, dtype)
    assert_close(got, want_f32, want_same_dtype, dtype=dtype, what=f"{case}")
    if independent is not None:  # a second reference, written independently of ours
        assert_close(got, independent, want_same_dtype, dtype=dtype, what=f"{case} vs jax.nn")
    d_k = np.asarray(got[1][1])
    assert not d_k[:, :case.unreachable_keys].any(), "keys no query sees must get no gradient"


# ------------------------------------------------------------------------- block skipping


BANDS = [
    MaskBand(256, 256, causal=True),
    MaskBand(256, 256, causal=False),
    MaskBand(256, 256, causal=True, window=1),
    MaskBand(256, 256, causal=True, window=50),
    MaskBand(192, 192, causal=False, window=33),
    MaskBand(192, 320, causal=True, window=40),
    MaskBand(64, 256, causal=True),
    MaskBand(64, 256, causal=True, window=70),
    MaskBand(128, 256, causal=False, window=16),
]


@pytest.mark.parametrize("band", BANDS, ids=str)
@pytest.mark.parametrize("block_q, block_kv", [(32, 32), (32, 64), (64, 32)])
def test_visited_blocks_are_exactly_the_non_empty_ones(band: MaskBand, block_q, block_kv):
    q_pos, k_pos = np.arange(band.q_len)[:, None], np.arange(band.kv_len)[None, :]
    allowed = band.allows(q_pos, k_pos)
    allowed = np.ones((band.q_len, band.kv_len), bool) if allowed is None else np.asarray(allowed)
    nonempty = allowed.reshape(band.q_len // block_q, block_q, band.kv_len // block_kv, block_kv).any(axis=(1, 3))
    visited = band.visited_blocks(block_q, block_kv)
    np.testing.assert_array_equal(visited, nonempty)
    assert band.num_kv_steps(block_q, block_kv) == visited.sum(axis=1).max()
    assert band.num_q_steps(block_q, block_kv) == max(nonempty.sum(axis=0).max(), 1)
    # The backward's column walk visits the same pairs as the forward's row walk.
    for kv_block in range(band.kv_len // block_kv):
        rows = [int(band.q_block_at(kv_block, s, block_q, block_kv)[0])
                for s in range(band.num_q_steps(block_q, block_kv))
                if bool(band.q_block_at(kv_block, s, block_q, block_kv)[1])]
        assert rows == list(np.flatnonzero(nonempty[:, kv_block]))


def test_visited_fraction_causal_and_window():
    causal = MaskBand(1024, 1024, causal=True)
    assert causal.visited_blocks(128, 128).mean() == pytest.approx(36 / 64)  # 8 * 9 / 2 of 8 * 8
    local = MaskBand(1024, 1024, causal=True, window=256)
    assert local.visited_blocks(128, 128).sum() == 1 + 2 + 3 * 6  # rows see at most 3 blocks
    assert local.num_kv_steps(128, 128) == 3  # the grid's last axis: 3 steps, not 8


def test_window_shrinks_the_pallas_grid():
    """The interpreter visits (batch, heads, q_blocks, num_kv_steps) points, not the full square."""
    case = Case("window", q_len=256, kv_len=256, heads=1, kv_heads=1, window=32, blocks=BlockSizes(32, 32))
    (q, k, v), _, _ = _inputs(case, jnp.float32)
    points = []

    def record(token, point, core):  # the interpreter threads an int32 token through its callbacks
        points.append(tuple(int(i) for i in point))
        return token

    params = pltpu.InterpretParams(grid_point_recorder=record)
    with pltpu.force_tpu_interpret_mode(params):
        jax.block_until_ready(attention(q, k, v, window=32, implementation="pallas", block_sizes=case.blocks))
    assert len(points) == 8 * 2  # 8 query blocks x 2 key blocks (own and previous), not 8 x 8
    assert {p[3] for p in points} == {0, 1}


def test_chunked_memory_grows_linearly_with_sequence():
    """Compiled temp memory of the XLA path (forward + backward): ~2x per doubling; the naive forward's ~4x."""
    def temp_bytes(attend, seq, grad: bool):
        x = jax.ShapeDtypeStruct((1, seq, 2, 32), jnp.float32)
        fn = jax.grad(lambda q, k, v: attend(q, k, v).sum(), argnums=(0, 1, 2)) if grad else attend
        return jax.jit(fn).lower(x, x, x).compile().memory_analysis().temp_size_in_bytes

    chunked = functools.partial(attention, implementation="xla", block_sizes=BlockSizes(256, 256))
    chunked_growth = temp_bytes(chunked, 4096, grad=True) / temp_bytes(chunked, 2048, grad=True)
    naive_growth = temp_bytes(reference_attention, 4096, grad=False) / temp_bytes(reference_attention, 2048, grad=False)
    assert chunked_growth < 2.5
    assert naive_growth > 3.5


# ------------------------------------------------------------------------- validation


def test_bad_shapes_are_rejected_with_the_sizes():
    q = jnp.zeros((1, 192, 2, 32))
    with pytest.raises(ValueError, match="block_kv=12 must be a multiple of 8"):
        attention(q, q, q, implementation="pallas", block_sizes=BlockSizes(64, 12))
    with pytest.raises(ValueError, match="heads=2 is not a multiple of kv_heads=3"):
        attention(q, jnp.zeros((1, 192, 3, 32)), jnp.zeros((1, 192, 3, 32)))
    with pytest.raises(ValueError, match="q_len <= kv_len"):
        attention(q, q[:, :64], q[:, :64], causal=True)
    with pytest.raises(ValueError, match="block_q must be a positive int"):
        BlockSizes(block_q=0)


def test_unknown_implementation_lists_the_valid_ones():
    q = jnp.zeros((1, 64, 2, 32))
    with pytest.raises(ValueError, match="'pallas', 'xla', 'cudnn'"):
        attention(q, q, q, implementation="triton")


def test_cases_cudnn_cannot_run_are_refused_when_asked_for_by_name():
    """With implementation=None a GPU falls back to XLA for these; asked for by name, they are errors."""
    q = jnp.zeros((1, 64, 2, 32))
    with pytest.raises(ValueError, match="cuDNN attention does not support dtype float32"):
        attention(q, q, q, implementation="cudnn")
    q16 = q.astype(jnp.bfloat16)
    with pytest.raises(ValueError, match="does not support segment ids"):
        attention(q16, q16, q16, segment_ids=jnp.zeros((1, 64), jnp.int32), implementation="cudnn")
    with pytest.raises(ValueError, match="two-sided sliding window"):
        attention(q16, q16, q16, causal=False, window=8, implementation="cudnn")
