"""Attention masks as a band of key offsets, and the blocks a band leaves non-empty.

Query row ``i`` sits at absolute position ``i + q_offset`` with
``q_offset = kv_len - q_len``: the last query lines up with the last key, the convention
of decoding against a KV cache (``q_offset = 0`` for self-attention). A query at absolute
position ``p`` may see key ``k`` when ``lo <= k - p <= hi``:

- causal: ``hi = 0``;
- sliding window ``w`` (local attention): ``lo = -(w - 1)``, and ``hi = w - 1`` unless
  causal. With causal, query ``i`` sees keys ``i - w < j <= i``.

Segment ids (packed documents) further restrict a query to keys of its own segment; a
block pair whose segment id ranges do not intersect is empty too (see
`segments_may_meet`).

Because the band is convex, the key blocks a query block can see form one contiguous
range ``[first, last]``; the kernels iterate over ``last - first + 1`` blocks per row
(`num_kv_steps` in the grid) instead of all of them, and never compute the rest.
Lengths that the blocks do not divide count a last, partial block (its padding is
masked by the kernels). Every function here works on Python ints, NumPy arrays and traced int32 scalars alike,
so the same code serves the grid size, the kernels' index maps and the unit tests.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

# The logit of a masked pair: far below any real one, finite so that a fully masked row stays NaN-free.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


@dataclasses.dataclass(frozen=True)
class MaskBand:
    """Causal / sliding-window structure of an attention mask over ``[q_len, kv_len]``."""

    q_len: int
    kv_len: int
    causal: bool
    window: int | None = None

    def __post_init__(self):
        if self.window is not None and self.window < 1:
            raise ValueError(f"window must be >= 1 when given, got {self.window=}")
        if (self.causal or self.window is not None) and self.q_len > self.kv_len:
            raise ValueError(
                f"A causal or windowed mask needs q_len <= kv_len (queries align with the last keys); "
                f"got {self.q_len=}, {self.kv_len=}")

    @property
    def q_offset(self) -> int:
        return self.kv_len - self.q_len

    @property
    def lo(self) -> int | None:
        """Smallest allowed ``key - query`` offset, None when unbounded."""
        return None if self.window is None else -(self.window - 1)

    @property
    def hi(self) -> int | None:
        """Largest allowed ``key - query`` offset, None when unbounded."""
        if self.causal:
            return 0
        return None if self.window is None else self.window - 1

    def allows(self, q_pos, k_pos) -> jax.Array | None:
        """Boolean mask for query rows ``q_pos`` and key rows ``k_pos`` (broadcast), None if all pass."""
        offset = k_pos - (q_pos + self.q_offset)
        mask = None
        if self.lo is not None:
            mask = offset >= self.lo
        if self.hi is not None:
            below = offset <= self.hi
            mask = below if mask is None else mask & below
        return mask

    def kv_blocks(self, q_block, block_q: int, block_kv: int):
        """First and last key block that query block ``q_block`` can see."""
        first_q = q_block * block_q + self.q_offset
        first_k = 0 if self.lo is None else _maximum(first_q + self.lo, 0)
        last_k = self.kv_len - 1
        if self.hi is not None:
            last_k = _minimum(first_q + block_q - 1 + self.hi, last_k)
        return first_k // block_kv, last_k // block_kv

    def q_blocks(self, kv_block, block_q: int, block_kv: int):
        """First and last query block that can see key block ``kv_block`` (first > last: none)."""
        first_k = kv_block * block_kv
        # p + lo <= k <= p + hi  <=>  k - hi <= p <= k - lo, with p = row + q_offset.
        first_q = 0 if self.hi is None else _maximum(first_k - self.hi - self.q_offset, 0)
        last_q = self.q_len - 1
        if self.lo is not None:
            last_q = _minimum(first_k + block_kv - 1 - self.lo - self.q_offset, last_q)
        return first_q // block_q, last_q // block_q

    def num_kv_steps(self, block_q: int, block_kv: int) -> int:
        """Key blocks visited per query block: the grid's innermost extent in the forward pass."""
        first, last = self.kv_blocks(np.arange(_blocks(self.q_len, block_q)), block_q, block_kv)
        return int(np.max(np.asarray(last) - np.asarray(first))) + 1

    def visited_pairs(self, block_q: int, block_kv: int) -> int:
        """(query, key) pairs the kernels compute per head: every block of every row's band, whole
        (a block is computed whole and masked), so at least the pairs the mask allows."""
        first, last = self.kv_blocks(np.arange(_blocks(self.q_len, block_q)), block_q, block_kv)
        return int(np.sum(np.asarray(last) - np.asarray(first) + 1)) * block_q * block_kv

    def num_q_steps(self, block_q: int, block_kv: int) -> int:
        """Query blocks visited per key block: the innermost grid extent of the dK/dV pass."""
        first, last = self.q_blocks(np.arange(_blocks(self.kv_len, block_kv)), block_q, block_kv)
        return max(int(np.max(np.asarray(last) - np.asarray(first))) + 1, 1)

    def kv_block_at(self, q_block, step, block_q: int, block_kv: int):
        """The key block visited at ``step`` of query block ``q_block``, and whether it is real.

        Steps past the row's last block repeat that block (so a TPU skips the copy) and
        report False (so the kernel skips the compute).
        """
        first, last = self.kv_blocks(q_block, block_q, block_kv)
        return _minimum(first + step, last), first + step <= last

    def q_block_at(self, kv_block, step, block_q: int, block_kv: int):
        """The query block visited at ``step`` of key block ``kv_block``, and whether it is real."""
        first, last = self.q_blocks(kv_block, block_q, block_kv)
        num_q_blocks = _blocks(self.q_len, block_q)
        index = jnp.clip(_minimum(first + step, last), 0, num_q_blocks - 1)
        return index, first + step <= last

    def visited_blocks(self, block_q: int, block_kv: int) -> np.ndarray:
        """``[q_blocks, kv_blocks]`` bool: the block pairs the forward grid computes."""
        q_block = np.arange(_blocks(self.q_len, block_q))[:, None]
        kv_block = np.arange(_blocks(self.kv_len, block_kv))[None, :]
        first, last = self.kv_blocks(q_block, block_q, block_kv)
        return np.broadcast_to((first <= kv_block) & (kv_block <= last), (q_block.size, kv_block.size))


def _blocks(length: int, block: int) -> int:
    """Blocks covering ``length`` (the last one may be partly padding, which the kernels mask)."""
    return -(-length // block)


def _maximum(a, b):
    """``maximum`` that stays in NumPy for static (non-JAX) operands, so grid sizes stay concrete."""
    return jnp.maximum(a, b) if isinstance(a, jax.Array) or isinstance(b, jax.Array) else np.maximum(a, b)


def _minimum(a, b):
    return jnp.minimum(a, b) if isinstance(a, jax.Array) or isinstance(b, jax.Array) else np.minimum(a, b)


def segments_may_meet(q_lo, q_hi, kv_lo, kv_hi):
    """Whether a query block with segment ids in ``[q_lo, q_hi]`` can meet a key block's ``[kv_lo, kv_hi]``.

    Disjoint id ranges mean no equal pair, so the block is empty; overlapping ranges may
    still hold no equal pair (ids that are not sorted), which only costs a wasted block.
    """
    return (q_lo <= kv_hi) & (kv_lo <= q_hi)


def segment_block_bounds(segment_ids: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """Per-block min and max of ``segment_ids`` ``[batch, seq]`` -> two ``[batch, seq // block]``."""
    batch, seq = segment_ids.shape
    blocks = segment_ids.reshape(batch, seq // block, block)
    return blocks.min(axis=-1), blocks.max(axis=-1)
