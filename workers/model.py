"""The built-in trainer's model: a decoder-only transformer over bytes.

Pre-norm blocks (RMSNorm, attention with rotary positions, RMSNorm, GELU MLP), layers
stacked on a leading axis and run with `lax.scan` so compile time does not grow with
depth. Attention, norms and RoPE go through the project's kernels (`kernels`), which
pick the implementation for the backend. Its dimensions are a
`policies.model.shape.ModelShape`, which also counts its parameters and FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import kernels
from kernels import dispatch
from kernels import moe as moe_routing
from kernels.blocks import KernelBlocks
from policies.model.shape import ModelShape  # the shape of the model built here
from policies.model.sharding import BATCH_AXES


def param_roles(shape: ModelShape) -> dict:
    """The pytree of parameter roles (keys of `policies.model.sharding.PARAM_RULES`), stacked layers marked."""
    layer = {"attn_norm": "norm", "wq": "wq", "wk": "wk", "wv": "wv", "wo": "wo", "mlp_norm": "norm"}
    if shape.moe_experts:
        layer.update(router="router", w_in="moe_in", w_out="moe_out")
    else:
        layer.update(w_up="w_up", w_down="w_down")
    if shape.scan_layer:
        layer.update(scan_norm="norm", scan_a="scan_in", scan_b="scan_in", scan_out="scan_out")
    return {"embed": "embed", "layers": {k: ("stacked", v) for k, v in layer.items()},
            "final_norm": "norm", "unembed": "unembed"}


def init_params(key: jax.Array, shape: ModelShape) -> dict:
    """Parameters in f32; the same values whatever the sharding (threefry is partitionable)."""
    d, f, v, hd, L = shape.d_model, shape.d_ff, shape.vocab_size, shape.head_dim, shape.n_layers
    keys = jax.random.split(key, 8)

    def dense(k, fan_in, *dims):
        return jax.random.normal(k, dims, jnp.float32) * (fan_in ** -0.5)

    layers = {
        "attn_norm": jnp.ones((L, d), jnp.float32),
        "wq": dense(keys[1], d, L, d, shape.n_heads * hd),
        "wk": dense(keys[2], d, L, d, shape.n_kv_heads * hd),
        "wv": dense(keys[3], d, L, d, shape.n_kv_heads * hd),
        "wo": dense(keys[4], d, L, shape.n_heads * hd, d) / (2 * L) ** 0.5,
        "mlp_norm": jnp.ones((L, d), jnp.float32),
    }
    if shape.moe_experts:
        e, extra = shape.moe_experts, jax.random.split(keys[5], 3)
        layers.update(router=dense(extra[0], d, L, d, e), w_in=dense(extra[1], d, L, e, d, f),
                      w_out=dense(extra[2], f, L, e, f, d) / (2 * L) ** 0.5)
    else:
        layers.update(w_up=dense(keys[5], d, L, d, f), w_down=dense(keys[6], f, L, f, d) / (2 * L) ** 0.5)
    if shape.scan_layer:
        extra = jax.random.split(jax.random.fold_in(key, 1), 3)
        layers.update(scan_norm=jnp.ones((L, d), jnp.float32), scan_a=dense(extra[0], d, L, d, d),
                      scan_b=dense(extra[1], d, L, d, d), scan_out=dense(extra[2], d, L, d, d) / (2 * L) ** 0.5)
    return {
        "embed": jax.random.normal(keys[0], (v, d), jnp.float32),
        "layers": layers,
        "final_norm": jnp.ones((d,), jnp.float32),
        "unembed": dense(keys[7], d, d, v),
    }


MOE_AUX_WEIGHT = 0.01  # weight of the experts' load-balancing loss in the training loss


def _per_shard(mesh: Mesh | None, implementation: str | None) -> bool:
    """Whether the kernels must run per device under `shard_map` on `mesh`.

    A Pallas kernel is one opaque call to XLA's partitioner, which would gather its
    sharded operands onto one device; on a mesh of more than one device each kernel
    therefore runs on its device's shard (see `kernels.sharding`). The XLA and cuDNN
    paths are partitioned by `jit` itself.
    """
    if mesh is None or mesh.size == 1:
        return False
    return dispatch.resolve(implementation, valid=(dispatch.PALLAS, dispatch.XLA, dispatch.CUDNN)) == dispatch.PALLAS


@dataclass(frozen=True)
class Numerics:
    """How the model computes, none of which changes what it computes (beyond rounding).

    - `compute_dtype`: the matmuls' and activations' type. The parameters stay float32
      (the master copy the optimizer updates); each step reads a copy cast to this type,
      and the kernels keep their softmax statistics and norm sums in float32; the logits
      are cast to float32 before the loss.
    - `remat`: "none", "full" (keep each block's input, recompute the rest in the
      backward pass), or the name of a `jax.checkpoint_policies` policy.
    - `blocks`: the kernels' block sizes (`kernels.blocks.KernelBlocks`); None: the chip's defaults.
    """

    compute_dtype: str = "float32"
    remat: str = "none"
    blocks: KernelBlocks | None = None

    def checkpointed(self, fn):
        if self.remat == "none":
            return fn
        policy = None if self.remat == "full" else getattr(jax.checkpoint_policies, self.remat)
        return jax.checkpoint(fn, policy=policy, prevent_cse=False)  # under scan, CSE cannot undo it


def forward(params: dict, tokens: jax.Array, shape: ModelShape, *, implementation: str | None = None,
            mesh: Mesh | None = None, numerics: Numerics = Numerics()) -> tuple[jax.Array, jax.Array]:
    """Logits [batch, seq, vocab] (float32) for int32 tokens [batch, seq], and the MoE auxiliary loss (0 without MoE).

    `mesh` (axes data, fsdp, model) is the one the batch is sharded over: batch rows over
    data and fsdp, heads over model. It is needed only to run Pallas kernels per shard.
    """
    b, s = tokens.shape
    hd = shape.head_dim
    dtype = jnp.dtype(numerics.compute_dtype)
    params = jax.tree.map(lambda p: p.astype(dtype), params)  # the float32 master's gradient flows back through it
    blocks = numerics.blocks or KernelBlocks()
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    h = params["embed"][tokens]  # [batch, seq, d_model]
    impl, per_shard = implementation, _per_shard(mesh, implementation)

    def on(fn, in_specs, out_specs):
        if per_shard and mesh is not None:  # (per_shard: there is a mesh)
            return kernels.sharded(fn, mesh, in_specs=in_specs, out_specs=out_specs)
        return fn

    rows = BATCH_AXES
    tok, heads, vec = P(rows, None, None), P(rows, None, "model", None), P(None)
    norm = on(lambda x, w: kernels.rms_norm(x, w, implementation=impl, block_sizes=blocks.norm), (tok, vec), tok)
    rope = on(lambda x, pos: kernels.apply_rope(x, pos, implementation=impl, block_sizes=blocks.rope),
              (heads, P(rows, None)), heads)
    attend = on(lambda q, k, v: kernels.attention(q, k, v, causal=True, implementation=impl,
                                                  block_sizes=blocks.attention), (heads,) * 3, heads)
    scan = on(lambda a, x: kernels.linear_scan(a, x, implementation=impl, block_sizes=blocks.scan), (tok, tok), tok)

    experts = on(lambda x, router, w_in, w_out: kernels.moe_ffn(x, router, w_in, w_out, top_k=shape.moe_top_k,
                                                              implementation=impl, block_sizes=blocks.moe)[0],
                 (P(rows, None), P(), P(), P()), P(rows, None))

    def moe(x, router, w_in, w_out):
        """The experts' output, and the load-balancing loss over the whole batch (not a mean of per-shard ones)."""
        _, chosen, probs = moe_routing.route(x, router, shape.moe_top_k)
        return experts(x, router, w_in, w_out), moe_routing.load_balancing_loss(probs, chosen)

    def block(carry, p):
        h, aux = carry
        a = norm(h, p["attn_norm"])
        q = (a @ p["wq"]).reshape(b, s, shape.n_heads, hd)
        k = (a @ p["wk"]).reshape(b, s, shape.n_kv_heads, hd)
        v = (a @ p["wv"]).reshape(b, s, shape.n_kv_heads, hd)
        o = attend(rope(q, positions), rope(k, positions), v)  # [b, s, heads, hd]
        h = h + o.reshape(b, s, shape.n_heads * hd) @ p["wo"]
        if shape.scan_layer:  # gated linear recurrence over time: h_t = a_t * h_{t-1} + b_t
            x = norm(h, p["scan_norm"])
            decay = jax.nn.sigmoid(x @ p["scan_a"])  # [b, s, d] in (0, 1)
            h = h + scan(decay, (1 - decay) * (x @ p["scan_b"])) @ p["scan_out"]
        m = norm(h, p["mlp_norm"])
        if shape.moe_experts:
            y, layer_aux = moe(m.reshape(b * s, -1), p["router"], p["w_in"], p["w_out"])
            h, aux = h + y.reshape(b, s, -1), aux + layer_aux.astype(jnp.float32)
        else:
            h = h + jax.nn.gelu(m @ p["w_up"]) @ p["w_down"]
        return (h, aux), None

    (h, aux), _ = jax.lax.scan(numerics.checkpointed(block), (h, jnp.float32(0.0)), params["layers"])
    h = norm(h, params["final_norm"])
    return (h @ params["unembed"]).astype(jnp.float32), aux / shape.n_layers


def loss_fn(params: dict, batch: jax.Array, shape: ModelShape, *, implementation: str | None = None,
            mesh: Mesh | None = None, numerics: Numerics = Numerics()) -> jax.Array:
    """Mean next-token cross-entropy of int32 tokens [batch, seq + 1], in float32."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    logits, aux = forward(params, inputs, shape, implementation=implementation, mesh=mesh, numerics=numerics)
    logz = jax.nn.logsumexp(logits, axis=-1)
    gold = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(logz - gold) + MOE_AUX_WEIGHT * aux
