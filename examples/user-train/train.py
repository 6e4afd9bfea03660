"""A user's own model and training step, in plain JAX and optax, trained by the orchestrator.

Everything model-related here is the user's: a small GPT (learned positions, LayerNorm,
`jax.nn.dot_product_attention`, tied embeddings; not the orchestrator's built-in model),
its loss, its AdamW schedule, its train step. What the orchestrator adds comes through
the training API's context (`workers.api.Context`): the mesh, restore-or-init resharded
onto whatever slice the job runs on, the step loop that checkpoints, stops on preemption
notices and reports, and the batches (token files made by `orchestrator data prepare`).

Submitted (`orchestrator submit examples/user-train/job.yaml`), every host calls `main`.
Alone, for a quick try on this machine's CPU (the same code, no controller):

    python examples/user-train/train.py --steps 30 --devices 4
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import jax
import jax.numpy as jnp
import optax

from workers import api


@dataclasses.dataclass(frozen=True)
class Config:
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    vocab_size: int = 256  # taken from the token files when the job has them
    max_len: int = 1024
    learning_rate: float = 3e-3
    warmup_steps: int = 10
    dtype: str = "float32"  # the compute dtype: the job file's workload.precision (ctx.compute_dtype)


def init_params(key: jax.Array, cfg: Config) -> dict:
    d, keys = cfg.d_model, jax.random.split(key, 2 + 4 * cfg.n_layers)

    def dense(k, n_in, n_out):
        return jax.random.normal(k, (n_in, n_out), jnp.float32) / math.sqrt(n_in)

    blocks = []
    for i in range(cfg.n_layers):
        k = keys[2 + 4 * i: 6 + 4 * i]
        blocks.append({"ln1": {"scale": jnp.ones(d), "bias": jnp.zeros(d)},
                       "qkv": dense(k[0], d, 3 * d), "out": dense(k[1], d, d) / math.sqrt(2 * cfg.n_layers),
                       "ln2": {"scale": jnp.ones(d), "bias": jnp.zeros(d)},
                       "up": dense(k[2], d, 4 * d), "down": dense(k[3], 4 * d, d) / math.sqrt(2 * cfg.n_layers)})
    return {"tokens": jax.random.normal(keys[0], (cfg.vocab_size, d)) * 0.02,
            "positions": jax.random.normal(keys[1], (cfg.max_len, d)) * 0.02,
            "blocks": blocks, "ln_f": {"scale": jnp.ones(d), "bias": jnp.zeros(d)}}


def layer_norm(x, p):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]


def forward(params: dict, tokens: jax.Array, cfg: Config) -> jax.Array:
    b, s = tokens.shape
    h = params["tokens"][tokens] + params["positions"][:s]
    for blk in params["blocks"]:
        q, k, v = jnp.split(layer_norm(h, blk["ln1"]) @ blk["qkv"], 3, axis=-1)
        heads = lambda x: x.reshape(b, s, cfg.n_heads, -1)  # noqa: E731
        o = jax.nn.dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        h = h + o.reshape(b, s, -1) @ blk["out"]
        h = h + jax.nn.gelu(layer_norm(h, blk["ln2"]) @ blk["up"]) @ blk["down"]
    return layer_norm(h, params["ln_f"]) @ params["tokens"].T  # tied embeddings


def loss_fn(params: dict, batch: jax.Array, cfg: Config) -> jax.Array:
    params = jax.tree.map(lambda p: p.astype(cfg.dtype), params)  # float32 master weights, compute in cfg.dtype
    logits = forward(params, batch[:, :-1], cfg).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def make_optimizer(cfg: Config, steps: int) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.learning_rate, cfg.warmup_steps,
                                                  max(steps, 1 + cfg.warmup_steps))
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))


def make_train_step(cfg: Config, optimizer: optax.GradientTransformation):
    def train_step(state: dict, batch: jax.Array) -> tuple[dict, dict]:
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch, cfg)
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        new_state = {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}
        return new_state, {"loss": loss, "grad_norm": optax.global_norm(grads)}

    return train_step


def flops_per_step(params: dict, cfg: Config, ctx: api.Context) -> float:
    """Model FLOPs of a training step: 6 per parameter per token, plus attention's 12 * layers * d * seq."""
    n = sum(x.size for x in jax.tree.leaves(params)) - params["positions"].size  # a lookup, no FLOPs
    per_token = 6 * n + 12 * cfg.n_layers * cfg.d_model * ctx.seq_len
    return per_token * ctx.seq_len * ctx.global_batch_size


def main(ctx: api.Context) -> None:
    """What every host runs: the user's model and step, inside the orchestrator's loop."""
    cfg = Config(**{**ctx.args, "vocab_size": ctx.dataset.vocab_size, "dtype": ctx.compute_dtype})
    optimizer = make_optimizer(cfg, ctx.steps)

    def init(key):
        params = init_params(key, cfg)
        return {"params": params, "opt_state": optimizer.init(params)}

    state = ctx.restore_or_init(init)  # the newest checkpoint, resharded onto this slice; or fresh
    train_step = jax.jit(make_train_step(cfg, optimizer), donate_argnums=0)
    # step=: the step `orchestrator plan --compile` compiles for each slice; flops_per_step: for MFU.
    with ctx.loop(state, step=train_step, flops_per_step=flops_per_step(state["params"], cfg, ctx)) as loop:
        for step in loop:
            state, metrics = train_step(loop.state, ctx.batch(step))
            loop.done(state, **metrics)  # loss, and any metric of the program's own


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="train the example alone, on this machine's CPU")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--data", default=None, help="token files from `orchestrator data prepare` (default: bytes)")
    args = p.parse_args()
    from workers import runtime
    from workers.protocol import StepDone

    runtime.configure(platform="cpu", devices_per_host=args.devices, compile_cache_dir=None)

    def show(report):
        if isinstance(report, StepDone):
            print(f"step {report.step + 1}: loss {report.loss:.4f}")

    main(api.local_context(steps=args.steps, seq_len=128, global_batch_size=16, data=args.data, send=show))
