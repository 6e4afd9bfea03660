"""The model's shape: its dimensions, its parameter count and its training FLOPs per token.

One record for the built-in decoder (see `workers.model`), taken by the sharding plan
(`policies.model.sharding.plan_mesh`), the throughput model (`policies.cost.slice_options.ScalingModel`
wants FLOPs per token) and the workers that build the model. The job file's
`ModelConfig` turns into one with `ModelConfig.shape()`.

Glossary: a block is attention (q, k, v, o projections; `n_kv_heads` <= `n_heads` for
grouped-query attention), an optional scan layer (a gated linear recurrence over time
with three d_model x d_model projections) and a feed-forward (dense, or `moe_experts`
experts of which each token uses `moe_top_k`), each behind an RMSNorm; embedding and
unembedding are separate matrices.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    vocab_size: int
    moe_experts: int = 0  # > 0: the feed-forward is a mixture of this many experts
    moe_top_k: int = 2
    scan_layer: bool = False  # a gated linear-recurrence (state-space) mixer in every block

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def num_params(self) -> int:
        """Every parameter of the model, all experts included."""
        return self._params(experts=self.moe_experts)

    def active_params(self) -> int:
        """Parameters one token goes through: with MoE, the router and `moe_top_k` experts."""
        return self._params(experts=min(self.moe_top_k, self.moe_experts))

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward and backward) on sequences of `seq_len`; see
        `training_flops_per_token` for the formula."""
        return training_flops_per_token(active_params=self.active_params(), n_layers=self.n_layers,
                                        d_model=self.d_model, seq_len=seq_len, scan_layer=self.scan_layer)

    def _params(self, *, experts: int) -> int:
        d, f, v, hd = self.d_model, self.d_ff, self.vocab_size, self.head_dim
        attn = d * self.n_heads * hd * 2 + d * self.n_kv_heads * hd * 2  # wq, wo; wk, wv
        mlp = experts * 2 * d * f + d * self.moe_experts if self.moe_experts else 2 * d * f  # + the router
        scan = 3 * d * d + d if self.scan_layer else 0  # scan_a, scan_b, scan_out; its norm
        per_layer = attn + mlp + scan + 2 * d  # + the attention and feed-forward norms
        return 2 * v * d + self.n_layers * per_layer + d  # embed, unembed; the final norm


def training_flops_per_token(*, active_params: float, n_layers: int, d_model: int, seq_len: int,
                             scan_layer: bool = False) -> float:
    """Training FLOPs per token: 6 x active_params + 12 x n_layers x d_model x seq_len
    (+ 6 x n_layers x d_model with a scan layer).

    A multiply-add is 2 FLOPs and training is 3 passes (forward, and backward through
    activations and weights): 6 per parameter a token goes through. Attention scores
    (q.k over the sequence) and their weighted sum of values are 2 x d_model x seq_len
    multiply-adds a token in each layer: 12 x n_layers x d_model x seq_len (no discount
    for the causal mask, as in the usual MFU accounting). The scan layer's recurrence
    h_t = a_t * h_(t-1) + b_t is one multiply-add per channel: 6 x n_layers x d_model.
    """
    scan = 6 * n_layers * d_model if scan_layer else 0
    return 6 * active_params + 12 * n_layers * d_model * seq_len + scan
