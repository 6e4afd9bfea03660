"""Memory-efficient attention in plain XLA: online softmax over key/value chunks.

The CPU default of `kernels.attention` (and the GPU fallback). For each query chunk a
``fori_loop`` runs over the key chunks of the mask's band only, carrying the running max,
normalizer and output (FlashAttention's recurrence), so live memory is
``O(chunk_q * chunk_kv)`` per head rather than ``O(q_len * kv_len)``. The backward pass is
a custom VJP that recomputes the probabilities chunk by chunk from the saved log-sum-exp;
differentiating the loops directly would store every chunk's probabilities and bring the
quadratic memory back. Lengths that the chunks do not divide are padded and masked.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from kernels.attention_mask import MASK_VALUE, MaskBand, segments_may_meet


@dataclasses.dataclass(frozen=True)
class _Config:
    band: MaskBand
    sm_scale: float
    chunk_q: int
    chunk_kv: int

    @property
    def num_q_chunks(self) -> int:
        return -(-self.band.q_len // self.chunk_q)

    @property
    def num_kv_chunks(self) -> int:
        return -(-self.band.kv_len // self.chunk_kv)


def chunked_attention(q, k, v, segment_ids, *, band: MaskBand, sm_scale: float, block_sizes) -> jax.Array:
    """`kernels.attention` on ``[batch, seq, heads, head_dim]`` operands, chunked by ``block_sizes``."""
    config = _Config(band, sm_scale, min(block_sizes.block_q, band.q_len), min(block_sizes.block_kv, band.kv_len))
    return _attention(q, k, v, segment_ids, config)


@functools.partial(jax.custom_vjp, nondiff_argnames=("config",))
def _attention(q, k, v, segment_ids, config: _Config):
    return _forward(q, k, v, segment_ids, config)[0]


# ----------------------------------------------------------------------------- layout


def _chunk_queries(x, config: _Config, kv_heads: int):
    """``[batch, q_len, heads, d]`` -> ``[q_chunks, batch, kv_heads, group, chunk_q, d]`` (zero padded)."""
    batch, q_len, heads, dim = x.shape
    n, c = config.num_q_chunks, config.chunk_q
    x = jnp.pad(x, ((0, 0), (0, n * c - q_len), (0, 0), (0, 0)))
    return x.reshape(batch, n, c, kv_heads, heads // kv_heads, dim).transpose(1, 0, 3, 4, 2, 5)


def _unchunk_queries(x, q_len: int):
    """Inverse of `_chunk_queries`."""
    n, batch, kv_heads, group, c, dim = x.shape
    x = x.transpose(1, 0, 4, 2, 3, 5).reshape(batch, n * c, kv_heads * group, dim)
    return x[:, :q_len]


def _chunk_keys(x, config: _Config):
    """``[batch, kv_len, kv_heads, d]`` -> ``[kv_chunks, batch, kv_heads, chunk_kv, d]``."""
    batch, kv_len, kv_heads, dim = x.shape
    n, c = config.num_kv_chunks, config.chunk_kv
    x = jnp.pad(x, ((0, 0), (0, n * c - kv_len), (0, 0), (0, 0)))
    return x.reshape(batch, n, c, kv_heads, dim).transpose(1, 0, 3, 2, 4)


def _unchunk_keys(x, kv_len: int):
    n, batch, kv_heads, c, dim = x.shape
    return x.transpose(1, 0, 3, 2, 4).reshape(batch, n * c, kv_heads, dim)[:, :kv_len]


def _chunk_segments(segment_ids, chunk: int, num_chunks: int):
    """``[batch, seq]`` -> ``[chunks, batch, chunk]``, padded with the last id (keeps chunk min/max)."""
    batch, seq = segment_ids.shape
    ids = jnp.pad(segment_ids, ((0, 0), (0, num_chunks * chunk - seq)), mode="edge")
    return ids.reshape(batch, num_chunks, chunk).transpose(1, 0, 2)


class _Segments:
    """Chunked segment ids and the test for whether a (query chunk, key chunk) pair can meet."""

    def __init__(self, segment_ids, config: _Config):
        self.q = _chunk_segments(segment_ids, config.chunk_q, config.num_q_chunks)  # [q_chunks, batch, chunk_q]
        self.kv = _chunk_segments(segment_ids, config.chunk_kv, config.num_kv_chunks)

    def may_meet(self, i, j):
        q_ids, kv_ids = self.q[i], self.kv[j]
        return jnp.any(segments_may_meet(q_ids.min(-1), q_ids.max(-1), kv_ids.min(-1), kv_ids.max(-1)))

    def same(self, i, j):
        """``[batch, 1, 1, chunk_q, chunk_kv]`` bool."""
        return (self.q[i][:, :, None] == self.kv[j][:, None, :])[:, None, None]


def _mask(config: _Config, segments: _Segments | None, i, j):
    """Allowed pairs of query chunk ``i`` and key chunk ``j``, broadcastable to the logits."""
    band = config.band
    q_pos = i * config.chunk_q + jnp.arange(config.chunk_q)[:, None]
    k_pos = j * config.chunk_kv + jnp.arange(config.chunk_kv)[None, :]
    mask = (q_pos < band.q_len) & (k_pos < band.kv_len)  # padding
    band_mask = band.allows(q_pos, k_pos)
    if band_mask is not None:
        mask &= band_mask
    return mask if segments is None else mask & segments.same(i, j)


def _skip_unless(segments: _Segments | None, i, j, update, carry):
    """``update(carry)``, skipped (at run time) when the chunks' segments cannot meet."""
    if segments is None:
        return update(carry)
    return lax.cond(segments.may_meet(i, j), update, lambda c: c, carry)


def _logits(q, k, sm_scale):
    """q ``[batch, kv_heads, group, chunk_q, d]``, k ``[batch, kv_heads, chunk_kv, d]`` -> f32 logits."""
    return jnp.einsum("bhgqd,bhkd->bhgqk", q, k, preferred_element_type=jnp.float32) * sm_scale


# ----------------------------------------------------------------------------- forward


def _forward(q, k, v, segment_ids, config: _Config):
    kv_heads = k.shape[2]
    q_chunks = _chunk_queries(q, config, kv_heads)  # [q_chunks, batch, kv_heads, group, chunk_q, d]
    k_chunks, v_chunks = _chunk_keys(k, config), _chunk_keys(v, config)  # [kv_chunks, batch, kv_heads, chunk_kv, d]
    segments = None if segment_ids is None else _Segments(segment_ids, config)

    def query_chunk(i):
        qi = q_chunks[i]
        row_shape = qi.shape[:-1] + (1,)

        def visit(j, carry):
            def update(carry):
                m, l, acc = carry
                s = _logits(qi, k_chunks[j], config.sm_scale)
                mask = _mask(config, segments, i, j)
                m_next = jnp.maximum(m, jnp.where(mask, s, MASK_VALUE).max(-1, keepdims=True))
                p = jnp.where(mask, jnp.exp(s - m_next), 0.0)
                alpha = jnp.exp(m - m_next)
                pv = jnp.einsum("bhgqk,bhkd->bhgqd", p.astype(v.dtype), v_chunks[j],
                                preferred_element_type=jnp.float32)
                return m_next, alpha * l + p.sum(-1, keepdims=True), alpha * acc + pv

            return _skip_unless(segments, i, j, update, carry)

        first, last = config.band.kv_blocks(i, config.chunk_q, config.chunk_kv)
        init = (jnp.full(row_shape, MASK_VALUE), jnp.zeros(row_shape), jnp.zeros(qi.shape, jnp.float32))
        m, l, acc = lax.fori_loop(first, last + 1, visit, init)
        l = jnp.where(l == 0.0, 1.0, l)  # padding rows see no key; they output 0
        return (acc / l).astype(q.dtype), (m + jnp.log(l))[..., 0]

    out, lse = lax.map(query_chunk, jnp.arange(config.num_q_chunks))
    out = _unchunk_queries(out, config.band.q_len)
    return out, (q, k, v, segment_ids, out, lse)


# ----------------------------------------------------------------------------- backward


def _backward(config: _Config, residuals, d_out):
    q, k, v, segment_ids, out, lse = residuals  # lse: [q_chunks, batch, kv_heads, group, chunk_q]
    kv_heads = k.shape[2]
    q_chunks, do_chunks = _chunk_queries(q, config, kv_heads), _chunk_queries(d_out, config, kv_heads)
    k_chunks, v_chunks = _chunk_keys(k, config), _chunk_keys(v, config)
    # rowsum(dO * O) = rowsum(P * dP): the diagonal term of the softmax Jacobian.
    di = jnp.sum(_chunk_queries(d_out.astype(jnp.float32) * out.astype(jnp.float32), config, kv_heads), -1)
    segments = None if segment_ids is None else _Segments(segment_ids, config)

    def key_chunk(dq, j):
        kj, vj = k_chunks[j], v_chunks[j]

        def visit(i, carry):
            def update(carry):
                dq, dk, dv = carry
                qi, doi = q_chunks[i], do_chunks[i]
                p = jnp.exp(_logits(qi, kj, config.sm_scale) - lse[i][..., None])
                p = jnp.where(_mask(config, segments, i, j), p, 0.0)  # [batch, kv_heads, group, chunk_q, chunk_kv]
                dv += jnp.einsum("bhgqk,bhgqd->bhkd", p.astype(doi.dtype), doi, preferred_element_type=jnp.float32)
                dp = jnp.einsum("bhgqd,bhkd->bhgqk", doi, vj, preferred_element_type=jnp.float32)
                ds = (p * (dp - di[i][..., None])).astype(qi.dtype)
                dk += jnp.einsum("bhgqk,bhgqd->bhkd", ds, qi, preferred_element_type=jnp.float32)
                dq_i = dq[i] + jnp.einsum("bhgqk,bhkd->bhgqd", ds, kj, preferred_element_type=jnp.float32)
                return lax.dynamic_update_index_in_dim(dq, dq_i, i, 0), dk, dv

            return _skip_unless(segments, i, j, update, carry)

        first, last = config.band.q_blocks(j, config.chunk_q, config.chunk_kv)
        zeros = jnp.zeros(kj.shape, jnp.float32)
        dq, dk, dv = lax.fori_loop(first, last + 1, visit, (dq, zeros, zeros))
        return dq, (dk, dv)

    dq, (dk, dv) = lax.scan(key_chunk, jnp.zeros(q_chunks.shape, jnp.float32), jnp.arange(config.num_kv_chunks))
    scale = config.sm_scale
    dq = _unchunk_queries(dq * scale, config.band.q_len).astype(q.dtype)
    dk = _unchunk_keys(dk * scale, config.band.kv_len).astype(k.dtype)
    dv = _unchunk_keys(dv, config.band.kv_len).astype(v.dtype)
    return dq, dk, dv, None


_attention.defvjp(_forward, _backward)
