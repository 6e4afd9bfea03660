"""Flash attention: causal, sliding-window, packed-segment and grouped-query attention.

File order: block sizes, the public function, the cuDNN path, and the naive reference. The Pallas
path (custom_vjp, pallas_call builders, kernel bodies) lives in `attention_flash`, the memory-efficient
XLA path in `attention_chunked`, the mask geometry in `attention_mask`. Default blocks come from the
chip generation, and blocks too large for its VMEM at the given ``head_dim`` are halved.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp

from kernels import dispatch, generations, hardware
from kernels.attention_chunked import chunked_attention
from kernels.attention_flash import Flash, Tiling, flash
from kernels.attention_mask import MASK_VALUE, MaskBand

logger = logging.getLogger(__name__)

IMPLEMENTATIONS = (dispatch.PALLAS, dispatch.XLA, dispatch.CUDNN)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes: ``[block_q, block_kv]`` score tiles for Pallas, chunk sizes for the XLA path.

    They change speed and memory, never the result (beyond float rounding). The backward
    pass (dQ and dK/dV kernels) has its own pair, which defaults to the forward's: it keeps
    more tiles live per step, so the best backward blocks are often smaller. On a TPU,
    ``block_kv`` should be a multiple of 128 (the lane width) for the kernels to lower well.
    Left out (``block_sizes=None``), they come from the chip generation (`kernels.generations`).
    """

    block_q: int = 512
    block_kv: int = 512
    block_q_bwd: int | None = None
    block_kv_bwd: int | None = None

    def __post_init__(self):
        for name in ("block_q", "block_kv", "block_q_bwd", "block_kv_bwd"):
            value = getattr(self, name)
            if value is None and name.endswith("_bwd"):
                continue
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
            if value % 8:
                raise ValueError(f"{name}={value} must be a multiple of 8")

    @classmethod
    def for_generation(cls, generation: generations.KernelGeneration) -> BlockSizes:
        return cls(*generation.attention)

    def tiling(self, q_len: int, kv_len: int, *, backward: bool = False, head_dim: int = 0,
               itemsize: int = 4) -> Tiling:
        """The blocks of one pass (forward, or ``backward``) fitted to the lengths (`generations.fit_block`).

        Blocks that would overflow the generation's VMEM limit at this ``head_dim`` are halved
        first (the larger one, down to 8 queries and 128 keys, or what was asked if smaller).
        """
        block_q = self.block_q_bwd or self.block_q if backward else self.block_q
        block_kv = self.block_kv_bwd or self.block_kv if backward else self.block_kv
        limit = generations.current().chip.vmem_limit_bytes
        while vmem_bytes(block_q, block_kv, head_dim, itemsize) > limit:
            if block_kv >= block_q and block_kv > 128 and block_kv % 256 == 0:
                block_kv //= 2
            elif block_q > 8 and block_q % 16 == 0:
                block_q //= 2
            else:
                break
        q = generations.fit_block(q_len, block_q)
        kv = generations.fit_block(kv_len, block_kv, align=generations.lane_align(block_kv))
        return Tiling(q.block, kv.block, q.padded, kv.padded)


def vmem_bytes(block_q: int, block_kv: int, head_dim: int, itemsize: int) -> int:
    """VMEM that the largest pass (dK/dV) holds at these blocks, an upper estimate.

    Double-buffered inputs q, dO ``[block_q, d]``, k, v and outputs dK, dV ``[block_kv, d]``,
    the lse and di rows (lane-padded to 128), f32 accumulators, and about four f32
    ``[block_q, block_kv]`` tiles (scores, probabilities, dP, dS).
    """
    io = 2 * itemsize * head_dim * (2 * block_q + 4 * block_kv) + 2 * 2 * 4 * 128 * block_q
    return io + 4 * head_dim * max(block_q, 2 * block_kv) + 4 * 4 * block_q * block_kv


def pallas_unsupported_reason(head_dim: int, itemsize: int, blocks: BlockSizes | None = None) -> str | None:
    """Why the Pallas kernels cannot hold this ``head_dim`` in VMEM even at their smallest blocks, or None."""
    blocks = blocks or BlockSizes.for_generation(generations.current())
    smallest = min(blocks.block_q, blocks.block_q_bwd or blocks.block_q, 8)
    smallest_kv = min(blocks.block_kv, blocks.block_kv_bwd or blocks.block_kv, 128)
    need, chip = vmem_bytes(smallest, smallest_kv, head_dim, itemsize), generations.current().chip
    if need <= chip.vmem_limit_bytes:
        return None
    return (f"{head_dim=} ({itemsize}-byte): {need / hardware.MIB:.0f} MiB of VMEM at {smallest}x{smallest_kv} "
            f"blocks, over the {chip.vmem_limit_bytes / hardware.MIB:.0f} MiB limit of a {chip.name}")


CHUNKED_BLOCK_SIZES = BlockSizes(block_q=256, block_kv=256)  # measured best of 128-1024 on CPU at 4k


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    window: int | None = None,
    segment_ids: jax.Array | None = None,
    sm_scale: float | None = None,
    implementation: str | None = None,
    block_sizes: BlockSizes | None = None,
) -> jax.Array:
    """Softmax attention, ``softmax(q k^T * sm_scale + mask) v``, per head.

    Args:
      q: ``[batch, q_len, heads, head_dim]``, bf16 or f32 (accumulation is f32).
      k: ``[batch, kv_len, kv_heads, head_dim]``, ``heads % kv_heads == 0`` (GQA/MQA).
      v: like ``k``.
      causal: query ``i`` sees keys ``j <= i`` (with ``q_len < kv_len`` the queries align
        with the last keys, as when decoding against a cache).
      window: sliding window (local attention): with ``causal``, query ``i`` sees keys
        ``i - window < j <= i``; without, ``|i - j| < window``.
      segment_ids: ``[batch, seq]`` int32 document ids of packed sequences (needs
        ``q_len == kv_len``); tokens only see tokens of their own segment.
      sm_scale: logit scale, default ``1 / sqrt(head_dim)``.
      implementation: ``"pallas"``, ``"xla"`` (chunked online softmax, memory linear in
        the sequence), ``"cudnn"``, or None to choose from the backend (`kernels.dispatch`).
      block_sizes: tile sizes (`BlockSizes`), default per chip generation; every path
        takes any length, fitting the blocks to it and padding (masked) what they do not tile.

    Returns:
      ``[batch, q_len, heads, head_dim]`` in ``q.dtype``.

    Sharding: the XLA and cuDNN paths partition like any XLA op under ``jit``. A Pallas
    kernel is one opaque call that XLA cannot split, so under ``jit`` with sharded inputs
    it would run on gathered operands: wrap it with `kernels.sharded` over the batch and
    head axes (every batch row and head is independent), e.g.
    ``kernels.sharded(attention, mesh, in_specs=(P("data", None, "model"),) * 3,
    out_specs=P("data", None, "model"), implementation="pallas")``.
    """
    _check_shapes(q, k, v, segment_ids)
    band = MaskBand(q.shape[1], k.shape[1], causal, window)
    scale = q.shape[-1] ** -0.5 if sm_scale is None else float(sm_scale)
    impl = dispatch.resolve(implementation, valid=IMPLEMENTATIONS, gpu_default=dispatch.CUDNN)
    if impl == dispatch.CUDNN:
        reason = cudnn_unsupported_reason(q, k, band, segment_ids)
        if reason is not None and implementation is not None:
            raise ValueError(f"cuDNN attention does not support {reason}")
        if reason is not None:
            impl = dispatch.XLA
    if impl == dispatch.PALLAS:
        blocks = block_sizes or BlockSizes.for_generation(generations.current())
        reason = pallas_unsupported_reason(q.shape[-1], q.dtype.itemsize, blocks)
        if reason is not None and implementation is not None:
            raise ValueError(f"Pallas attention cannot run {reason}")
        if reason is not None:  # the backend's default: the XLA path runs it
            logger.warning("Attention runs on the XLA path: the Pallas kernel cannot hold %s", reason)
            impl = dispatch.XLA
    if impl == dispatch.PALLAS:
        head_dim, itemsize = q.shape[-1], q.dtype.itemsize
        tilings: tuple[Tiling, Tiling] | BlockSizes = (
            blocks.tiling(band.q_len, band.kv_len, head_dim=head_dim, itemsize=itemsize),
            blocks.tiling(band.q_len, band.kv_len, backward=True, head_dim=head_dim, itemsize=itemsize))
    else:
        blocks = block_sizes or CHUNKED_BLOCK_SIZES
        tilings = blocks
    return _attention(q, k, v, segment_ids, band=band, sm_scale=scale, implementation=impl, blocks=tilings)


@functools.partial(jax.jit, static_argnames=("band", "sm_scale", "implementation", "blocks"))
def _attention(q, k, v, segment_ids, *, band: MaskBand, sm_scale: float, implementation: str, blocks):
    """``blocks``: the (forward, backward) `Tiling` pair for Pallas, the chunk `BlockSizes` for XLA."""
    if implementation == dispatch.PALLAS:
        config = Flash(band, sm_scale, *blocks)
        out = flash(q.swapaxes(1, 2), k.swapaxes(1, 2), v.swapaxes(1, 2), segment_ids, config)
        return out.swapaxes(1, 2)
    if implementation == dispatch.XLA:
        return chunked_attention(q, k, v, segment_ids, band=band, sm_scale=sm_scale, block_sizes=blocks)
    return _cudnn_attention(q, k, v, band, sm_scale)


def _check_shapes(q, k, v, segment_ids) -> None:
    if q.ndim != 4 or k.ndim != 4:
        raise ValueError(f"q and k must be [batch, seq, heads, head_dim], got {q.shape=}, {k.shape=}")
    batch, q_len, heads, head_dim = q.shape
    kv_batch, kv_len, kv_heads, kv_head_dim = k.shape
    if v.shape != k.shape:
        raise ValueError(f"v must have k's shape, got {v.shape=}, {k.shape=}")
    if kv_batch != batch or kv_head_dim != head_dim:
        raise ValueError(f"q and k disagree: {q.shape=}, {k.shape=}")
    if heads % kv_heads:
        raise ValueError(f"{heads=} is not a multiple of {kv_heads=}")
    if segment_ids is not None:
        if q_len != kv_len:
            raise ValueError(f"segment_ids need q_len == kv_len, got {q_len=}, {kv_len=}")
        if segment_ids.shape != (batch, q_len):
            raise ValueError(f"segment_ids must be [batch, seq] = {(batch, q_len)}, got {segment_ids.shape}")
        if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
            raise ValueError(f"segment_ids must be integers, got {segment_ids.dtype}")


# --------------------------------------------------------------------------- cuDNN path


def cudnn_unsupported_reason(q, k, band: MaskBand, segment_ids) -> str | None:
    """Why ``jax.nn.dot_product_attention(implementation="cudnn")`` cannot run this case, or None."""
    head_dim = q.shape[-1]
    if segment_ids is not None:
        return "segment ids (its only per-token mask input would be a dense [q_len, kv_len] mask)"
    if q.dtype not in (jnp.bfloat16, jnp.float16) or k.dtype != q.dtype:
        return f"dtype {q.dtype} (cuDNN flash attention takes bf16 or fp16)"
    if head_dim % 8 or head_dim > 128:
        return f"{head_dim=} (needs a multiple of 8, at most 128)"
    if band.q_offset and (band.causal or band.window is not None):
        return "a causal or windowed mask with q_len != kv_len (cuDNN aligns it top-left)"
    if band.window is not None and not band.causal:
        return "a two-sided sliding window"
    return None


def _cudnn_attention(q, k, v, band: MaskBand, sm_scale: float) -> jax.Array:
    window = None if band.window is None else (band.window - 1, 0)
    return jax.nn.dot_product_attention(q, k, v, scale=sm_scale, is_causal=band.causal,
                                        local_window_size=window, implementation="cudnn")


# --------------------------------------------------------------------------- reference


def reference_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    window: int | None = None,
    segment_ids: jax.Array | None = None,
    sm_scale: float | None = None,
) -> jax.Array:
    """Naive attention in plain ``jax.numpy``; materializes ``[batch, heads, q_len, kv_len]`` logits.

    Same arguments and result as `attention`; logits and softmax in f32, the
    probabilities cast to ``v.dtype`` for the value product (f32 accumulation).
    """
    batch, q_len, heads, head_dim = q.shape
    _, kv_len, kv_heads, _ = k.shape
    band = MaskBand(q_len, kv_len, causal, window)
    scale = head_dim ** -0.5 if sm_scale is None else sm_scale
    q_grouped = q.reshape(batch, q_len, kv_heads, heads // kv_heads, head_dim)
    logits = jnp.einsum("bqhgd,bkhd->bhgqk", q_grouped, k, preferred_element_type=jnp.float32) * scale
    mask = band.allows(jnp.arange(q_len)[:, None], jnp.arange(kv_len)[None, :])  # [q_len, kv_len]
    if segment_ids is not None:
        same = segment_ids[:, :, None] == segment_ids[:, None, :]  # [batch, q_len, kv_len]
        mask = same if mask is None else mask & same
    if mask is not None:
        mask = jnp.broadcast_to(mask, (batch, q_len, kv_len))[:, None, None]
        logits = jnp.where(mask, logits, MASK_VALUE)
    probs = jax.nn.softmax(logits, axis=-1)  # [batch, kv_heads, group, q_len, kv_len]
    out = jnp.einsum("bhgqk,bkhd->bqhgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(q.shape).astype(q.dtype)
