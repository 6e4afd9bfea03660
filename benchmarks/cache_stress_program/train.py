"""The program `benchmarks/cache_stress.py` trains: a step slow to compile, quick to run.

A user's own JAX program on the training API (`workers.api`): a stack of residual MLP blocks,
unrolled in Python so that XLA compiles a long program (seconds on these CPU hosts, well over
the `jax_persistent_cache_min_compile_time_secs` that `workers.runtime.configure` sets for the
hosts' cache), on a model small enough that a step takes a fraction of a second.

Each process also notes what JAX's persistent compilation cache did for its train step, as
one JSON line in a file of its own under ``args["probe_dir"]`` (the local hosts share this
machine's disk): whether the cache was on, its directory, how many compiles asked it, its
hits and misses, and how long the step's compile took. ``args["jax_cache"]: true`` turns
JAX's cache back on inside the program, as it was before a multi-process CPU runtime turned
it off (`workers.runtime._no_shared_jax_cache`): the control that puts the stress back on the
old path.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import optax

from workers import api


class CacheProbe:
    """JAX's compile and cache events in this process, counted from the moment it is made."""

    def __init__(self) -> None:
        from jax import monitoring

        self.events: dict[str, int] = {}
        self.compile_s: dict[str, float] = {}
        monitoring.register_event_listener(self._event)
        monitoring.register_event_duration_secs_listener(self._duration)

    def _event(self, event: str, **_) -> None:
        if event.startswith("/jax/compilation_cache/"):
            name = event.rsplit("/", 1)[1]
            self.events[name] = self.events.get(name, 0) + 1

    def _duration(self, event: str, seconds: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            name = str(kwargs.get("fun_name", "?"))  # "jit(train_step)" and the like
            self.compile_s[name] = self.compile_s.get(name, 0.0) + seconds

    def write(self, probe_dir: str, ctx: api.Context) -> None:
        """One line for this process and launch (a file per process: no two writers of one file)."""
        line = {"rank": ctx.rank, "pid": os.getpid(), "at": time.time(), "restored_step": ctx.restored_step,
                "jax_cache_enabled": bool(jax.config.jax_enable_compilation_cache),
                "cache_dir": jax.config.jax_compilation_cache_dir,
                "min_compile_time_s": jax.config.jax_persistent_cache_min_compile_time_secs,
                "requests_use_cache": self.events.get("compile_requests_use_cache", 0),
                "hits": self.events.get("cache_hits", 0), "misses": self.events.get("cache_misses", 0),
                "compile_s": {k: round(v, 3) for k, v in self.compile_s.items()}}
        path = Path(probe_dir) / f"rank{ctx.rank}-pid{os.getpid()}-{time.time_ns()}.json"
        path.write_text(json.dumps(line) + "\n")


def init_params(key: jax.Array, vocab: int, d: int, n_layers: int) -> dict:
    keys = jax.random.split(key, 1 + 2 * n_layers)
    blocks = [{"scale": jnp.ones(d),
               "up": jax.random.normal(keys[1 + 2 * i], (d, 4 * d)) / math.sqrt(d),
               "down": jax.random.normal(keys[2 + 2 * i], (4 * d, d)) / math.sqrt(4 * d * 2 * n_layers)}
              for i in range(n_layers)]
    return {"embed": jax.random.normal(keys[0], (vocab, d)) * 0.02, "blocks": blocks}


def loss_fn(params: dict, batch: jax.Array) -> jax.Array:
    h = params["embed"][batch[:, :-1]]  # [batch, seq, d]
    for blk in params["blocks"]:  # unrolled: one long program for XLA
        x = h * jax.lax.rsqrt((h * h).mean(-1, keepdims=True) + 1e-6) * blk["scale"]
        h = h + jax.nn.gelu(x @ blk["up"]) @ blk["down"]
        h = h + 0.1 * jnp.cumsum(x, axis=1) / jnp.arange(1, x.shape[1] + 1)[None, :, None]  # causal mixing
    logits = h @ params["embed"].T
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def main(ctx: api.Context) -> None:
    args = dict(ctx.args)
    if args.get("jax_cache"):  # the control: JAX's own cache on again, as before the fix
        from jax.experimental.compilation_cache import compilation_cache

        jax.config.update("jax_enable_compilation_cache", True)
        compilation_cache.reset_cache()
    probe = CacheProbe()
    d, n_layers = int(args.get("d_model", 64)), int(args.get("n_layers", 12))
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(float(args.get("learning_rate", 3e-3))))

    def init(key):
        params = init_params(key, ctx.dataset.vocab_size, d, n_layers)
        return {"params": params, "opt_state": optimizer.init(params)}

    def train_step(state: dict, batch: jax.Array) -> tuple[dict, dict]:
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch)
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}, {"loss": loss}

    state = ctx.restore_or_init(init)
    step_fn = jax.jit(train_step, donate_argnums=0)
    noted = False
    with ctx.loop(state, step=step_fn) as loop:
        for step in loop:
            state, metrics = step_fn(loop.state, ctx.batch(step))
            if not noted and args.get("probe_dir"):  # the step is compiled (or loaded) by now
                probe.write(args["probe_dir"], ctx)
                noted = True
            loop.done(state, **metrics)
