"""Mixture-of-experts feed-forward: top-k routing, grouping by expert, grouped matmuls.

Routing: softmax over the router logits, the ``top_k`` experts per token. With
``top_k > 1`` their probabilities are renormalized to sum to one (Mixtral); with
``top_k == 1`` the gate is the chosen expert's softmax probability itself (Switch
Transformer): renormalized, it would be exactly 1, a constant, and the router would get
no gradient from the task loss, only from the auxiliary loss. The auxiliary load-balancing loss is
Switch Transformer's ``num_experts * sum_e f_e * P_e`` (``f_e``: the fraction of token
choices routed to ``e``, ``P_e``: its mean router probability), 1.0 when perfectly balanced.

Capacity, and what is dropped:

- ``capacity_factor=None`` (default): dropless. Every expert takes all the tokens routed to
  it; groups are ragged and padded to whole tiles, so the buffer holds
  ``tokens * top_k + experts * block_rows`` rows and nothing is ever dropped.
- ``capacity_factor=c``: an expert takes at most ``ceil(c * tokens * top_k / experts)``
  choices, earlier tokens first; the rest are dropped (their share of the token's output
  is zero, the residual stream carries the token on) and counted in
  ``stats["dropped_tokens"]`` (token choices dropped, out of ``tokens * top_k``).

The expert MLP is ``gelu(x @ w_in[e]) @ w_out[e]`` (``jax.nn.gelu``, tanh form) through `grouped_matmul`; routing,
dispatch and combine are gathers and scatters that XLA differentiates.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from kernels import dispatch, generations
from kernels.grouped_matmul import GroupedMatmulBlockSizes, grouped_matmul

IMPLEMENTATIONS = (dispatch.PALLAS, dispatch.XLA)


class ExpertLayout(NamedTuple):
    """Where each token choice goes in the expert-grouped row buffer."""

    rows: jax.Array  # [tokens * top_k] int32 row of each (token, choice); num_rows when dropped
    tile_expert: jax.Array  # [num_rows // block_rows] int32 expert of each row tile
    num_tiles: jax.Array  # int32: tiles holding rows; the rest of the buffer is padding
    tokens_per_expert: jax.Array  # [experts] int32 choices routed to each expert (before capacity)
    dropped: jax.Array  # int32: choices over capacity


def moe_ffn(
    x: jax.Array,
    router_w: jax.Array,
    w_in: jax.Array,
    w_out: jax.Array,
    *,
    top_k: int = 2,
    capacity_factor: float | None = None,
    implementation: str | None = None,
    block_sizes: GroupedMatmulBlockSizes | None = None,
) -> tuple[jax.Array, jax.Array, dict]:
    """A mixture-of-experts GELU MLP.

    Args:
      x: ``[tokens, d_model]``.
      router_w: ``[d_model, experts]``.
      w_in: ``[experts, d_model, d_ff]``.
      w_out: ``[experts, d_ff, d_model]``.
      top_k: experts per token.
      capacity_factor: None for dropless routing, else the per-expert capacity factor.
      implementation: ``"pallas"``, ``"xla"`` or None (from the backend) for the grouped matmuls.
      block_sizes: `GroupedMatmulBlockSizes`; ``block_rows`` is also the tile of the layout.

    Returns:
      ``(y, aux_loss, stats)``: ``y`` ``[tokens, d_model]`` in ``x.dtype``; the f32
      load-balancing loss; ``stats = {"dropped_tokens": int32, "tokens_per_expert": [experts] int32}``.

    Sharding: routing is per token, but the aux loss and the stats are means and counts
    over the tokens given. Under ``jit`` the XLA path partitions as is; the Pallas path
    needs `kernels.sharded` with tokens sharded and the weights replicated, and then
    returns per-shard aux losses and stats (average them with ``lax.pmean`` inside).
    """
    tokens, d_model = x.shape
    num_experts = router_w.shape[1]
    if router_w.shape != (d_model, num_experts):
        raise ValueError(f"router_w must be [d_model={d_model}, experts], got {router_w.shape}")
    if w_in.ndim != 3 or w_in.shape[:2] != (num_experts, d_model):
        raise ValueError(f"w_in must be [experts={num_experts}, d_model={d_model}, d_ff], got {w_in.shape}")
    if w_out.shape != (num_experts, w_in.shape[2], d_model):
        raise ValueError(f"w_out must be [experts, d_ff, d_model] = {(num_experts, w_in.shape[2], d_model)}, "
                         f"got {w_out.shape}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be in [1, experts={num_experts}]")
    capacity = None
    if capacity_factor is not None:
        if capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be positive, got {capacity_factor}")
        capacity = math.ceil(capacity_factor * tokens * top_k / num_experts)
    impl = dispatch.resolve(implementation, valid=IMPLEMENTATIONS)
    blocks = block_sizes or GroupedMatmulBlockSizes(*generations.current().grouped_matmul)
    return _moe_ffn(x, router_w, w_in, w_out, top_k=top_k, capacity=capacity, implementation=impl, blocks=blocks)


@functools.partial(jax.jit, static_argnames=("top_k", "capacity", "implementation", "blocks"))
def _moe_ffn(x, router_w, w_in, w_out, *, top_k, capacity, implementation, blocks):
    tokens, d_model = x.shape
    num_experts = router_w.shape[1]
    gates, experts, probs = route(x, router_w, top_k)
    aux_loss = load_balancing_loss(probs, experts)
    layout = group_by_expert(experts, num_experts, capacity=capacity, block_rows=blocks.block_rows)
    num_rows = layout.tile_expert.shape[0] * blocks.block_rows

    # Dispatch: each token choice copied to its row ([num_rows, d_model]); dropped ones fall off the end.
    # Repeating in f32 makes the backward sum a token's top_k gradients before rounding them.
    choices = jnp.repeat(x.astype(jnp.float32), top_k, axis=0).astype(x.dtype)
    x_rows = jnp.zeros((num_rows, d_model), x.dtype).at[layout.rows].set(choices, mode="drop")
    matmul = {"implementation": implementation, "block_sizes": blocks}
    h = grouped_matmul(x_rows, w_in, layout.tile_expert, layout.num_tiles, **matmul)  # [num_rows, d_ff]
    h = jax.nn.gelu(h.astype(jnp.float32)).astype(x.dtype)
    y_rows = grouped_matmul(h, w_out, layout.tile_expert, layout.num_tiles, **matmul)  # [num_rows, d_model]
    # Combine: gather each choice's output (zero if dropped), weight by its gate, sum per token.
    y_choices = y_rows.at[layout.rows].get(mode="fill", fill_value=0).reshape(tokens, top_k, d_model)
    y = jnp.einsum("tkd,tk->td", y_choices.astype(jnp.float32), gates).astype(x.dtype)
    stats = {"dropped_tokens": layout.dropped, "tokens_per_expert": layout.tokens_per_expert}
    return y, aux_loss, stats


def route(x: jax.Array, router_w: jax.Array, top_k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(gates [tokens, top_k] f32, experts [tokens, top_k] int32, probs [tokens, experts] f32)``."""
    logits = jnp.dot(x, router_w, preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    gates, experts = jax.lax.top_k(probs, top_k)
    if top_k > 1:  # top-1 keeps its probability as the gate, the router's only task-loss gradient
        gates = gates / gates.sum(axis=-1, keepdims=True)
    return gates, experts.astype(jnp.int32), probs


def load_balancing_loss(probs: jax.Array, experts: jax.Array) -> jax.Array:
    """Switch Transformer's auxiliary loss: ``experts * sum_e (fraction of choices to e) * (mean prob of e)``."""
    num_experts = probs.shape[-1]
    routed = jax.nn.one_hot(experts, num_experts, dtype=jnp.float32).sum(axis=1)  # [tokens, experts]
    fraction = routed.mean(axis=0) / experts.shape[1]
    return num_experts * jnp.sum(fraction * probs.mean(axis=0))


def group_by_expert(experts: jax.Array, num_experts: int, *, capacity: int | None, block_rows: int) -> ExpertLayout:
    """Rows for every token choice, grouped by expert, each expert padded to whole tiles.

    ``experts`` is ``[tokens, top_k]``. Within an expert, choices keep token order; with a
    ``capacity``, the choices past it are dropped. Every expert gets at least one tile (so
    the weight gradient of an idle expert is written, as zeros), hence the static bound of
    ``ceil(tokens * top_k / block_rows) + num_experts`` tiles.
    """
    choices = experts.reshape(-1)  # [tokens * top_k], token-major
    num_choices = choices.shape[0]
    order = jnp.argsort(choices, stable=True)  # choices sorted by expert, token order within
    sorted_experts = choices[order]
    counts = jnp.bincount(choices, length=num_experts).astype(jnp.int32)
    group_start = jnp.cumsum(counts) - counts
    rank = jnp.arange(num_choices, dtype=jnp.int32) - group_start[sorted_experts]  # place within its expert
    kept = counts if capacity is None else jnp.minimum(counts, capacity)
    tiles = jnp.maximum(-(-kept // block_rows), 1)  # [experts]
    tile_end = jnp.cumsum(tiles)
    max_tiles = -(-num_choices // block_rows) + num_experts
    num_rows = max_tiles * block_rows
    row = (tile_end - tiles)[sorted_experts] * block_rows + rank
    row = jnp.where(rank < kept[sorted_experts], row, num_rows)
    rows = jnp.zeros(num_choices, jnp.int32).at[order].set(row)  # back to (token, choice) order
    tile_expert = jnp.minimum(jnp.searchsorted(tile_end, jnp.arange(max_tiles), side="right"), num_experts - 1)
    return ExpertLayout(rows=rows, tile_expert=tile_expert.astype(jnp.int32), num_tiles=tile_end[-1],
                        tokens_per_expert=counts, dropped=(counts - kept).sum())


def reference_moe_ffn(
    x: jax.Array,
    router_w: jax.Array,
    w_in: jax.Array,
    w_out: jax.Array,
    *,
    top_k: int = 2,
    capacity_factor: float | None = None,
) -> tuple[jax.Array, jax.Array, dict]:
    """`moe_ffn` computed densely in plain ``jax.numpy``: every expert on every token, then weighted.

    Capacity is applied independently of `group_by_expert`: a choice is kept when fewer
    than ``capacity`` earlier choices (in token order) went to the same expert.
    """
    tokens = x.shape[0]
    num_experts = router_w.shape[1]
    gates, experts, probs = route(x, router_w, top_k)
    onehot = jax.nn.one_hot(experts.reshape(-1), num_experts, dtype=jnp.int32)  # [tokens * top_k, experts]
    keep = jnp.ones(tokens * top_k, bool)
    if capacity_factor is not None:
        capacity = math.ceil(capacity_factor * tokens * top_k / num_experts)
        earlier = (jnp.cumsum(onehot, axis=0) - onehot)  # choices before this one, per expert
        keep = (earlier * onehot).sum(axis=1) < capacity
    weights = (onehot * (gates.reshape(-1) * keep)[:, None]).reshape(tokens, top_k, num_experts).sum(axis=1)
    # Each product rounds to x.dtype, as a plain program in that dtype would. Products of
    # low-precision values are exact in f32, so upcasting first is a low-precision matmul
    # with f32 accumulation (XLA:CPU has no bf16 x bf16 -> f32 dot for these shapes).
    f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
    h = jnp.einsum("td,edf->tef", f32(x), f32(w_in)).astype(x.dtype)  # [tokens, experts, d_ff]
    h = jax.nn.gelu(f32(h)).astype(x.dtype)
    y_experts = jnp.einsum("tef,efd->ted", f32(h), f32(w_out)).astype(x.dtype)
    y = jnp.einsum("ted,te->td", f32(y_experts), weights).astype(x.dtype)
    stats = {"dropped_tokens": (~keep).sum().astype(jnp.int32), "tokens_per_expert": onehot.sum(axis=0)}
    return y, load_balancing_loss(probs, experts), stats
