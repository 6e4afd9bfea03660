"""The built-in language-model trainer, on the training API (`workers.api`) as users' programs are.

`Trainer` runs the same way in a plain script (the benchmarks' bare baseline, the
tests' single-process reference) and on every host of a slice under the controller.
Batch `step` depends only on `(seed, step)` and the optimizer's schedule only on the
step count in its state, so a run restored at step k continues exactly as an
uninterrupted run would, on any mesh.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kernels.blocks import KernelBlocks
from policies.model.shape import ModelShape
from policies.model.sharding import BATCH_AXES, PARAM_RULES
from workers import api, runtime
from workers.model import Numerics, init_params, loss_fn, param_roles

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainConfig:
    """Everything a host needs to train; plain data so it crosses process boundaries."""

    model: ModelShape
    seq_len: int
    global_batch_size: int
    steps: int
    seed: int
    lr_peak: float
    lr_end: float
    warmup_steps: int
    weight_decay: float
    mesh_shape: tuple[int, int, int]  # (data, fsdp, model)
    checkpoint_dir: str | None = None
    checkpoint_interval: int = 20
    checkpoint_keep: int = 3
    implementation: str | None = None
    data: str | None = None  # token files (`workers.tokens`); None: the standard library's bytes
    precision: str = "float32"  # the compute dtype: float32, bfloat16, or auto (bfloat16 on TPU and GPU)
    remat: str = "none"  # `workers.model.Numerics.remat`
    microbatches: int = 1  # gradient accumulation: the global batch in this many parts, one update
    kernel_blocks: dict | None = None  # `kernels.blocks.KernelBlocks.from_mapping`; None: the chip's defaults

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        d = dict(d)
        d["model"] = ModelShape(**d["model"])
        d["mesh_shape"] = tuple(d["mesh_shape"])
        return cls(**d)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_len


class Trainer:
    """The built-in trainer: its model, optimizer and shardings around the training API's loop."""

    def __init__(self, cfg: TrainConfig, ctx: api.Context | None = None):
        self.cfg = cfg
        self.ctx = ctx or context_for(cfg)
        self.mesh = self.ctx.mesh
        self.replicated = NamedSharding(self.mesh, P())
        self.batch_sharding = NamedSharding(self.mesh, P(BATCH_AXES, None))
        schedule = optax.warmup_cosine_decay_schedule(
            init_value=0.0, peak_value=cfg.lr_peak, warmup_steps=cfg.warmup_steps,
            decay_steps=max(cfg.steps, cfg.warmup_steps + 1), end_value=cfg.lr_end)
        self.optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                                     optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay))
        self.param_shardings = jax.tree.map(self._param_sharding, param_roles(cfg.model),
                                            is_leaf=lambda x: isinstance(x, (str, tuple)))
        abstract = jax.eval_shape(self._init, jax.random.key(0))
        opt_shardings = optax.tree_map_params(self.optimizer, lambda _, s: s, abstract["opt_state"],
                                              self.param_shardings, transform_non_params=lambda _: self.replicated)
        self.state_shardings = {"params": self.param_shardings, "opt_state": opt_shardings,
                                "step": self.replicated}
        self.abstract_state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                           abstract, self.state_shardings)

    def _param_sharding(self, role) -> NamedSharding:
        if isinstance(role, tuple):  # ("stacked", role): a leading layer axis, replicated
            return NamedSharding(self.mesh, P(None, *PARAM_RULES[role[1]]))
        return NamedSharding(self.mesh, P(*PARAM_RULES[role]))

    # -- state -------------------------------------------------------------------

    def _init(self, key: jax.Array) -> dict:
        params = init_params(key, self.cfg.model)
        return {"params": params, "opt_state": self.optimizer.init(params), "step": jnp.int32(0)}

    def init_state(self) -> dict:
        """A fresh state, compiled once per program and kept (`runtime.compile_keyed`)."""
        key = jax.random.key(self.cfg.seed)
        lower = lambda: jax.jit(self._init, out_shardings=self.state_shardings).lower(key)  # noqa: E731
        return runtime.compile_keyed(self._program_id("init_state"), lower)(key)

    def restore_or_init(self) -> dict:
        """The newest readable committed checkpoint, falling back step by step; else a fresh state."""
        return self.ctx.restore_or_init(self._init, self.state_shardings, initialize=self.init_state)

    # -- steps -------------------------------------------------------------------

    def numerics(self) -> Numerics:
        c = self.cfg
        return Numerics(compute_dtype=self.ctx.compute_dtype, remat=c.remat,
                        blocks=KernelBlocks.from_mapping(c.kernel_blocks))

    def gradients(self, params: dict, batch: jax.Array) -> tuple[jax.Array, dict]:
        """Mean loss and its gradient over `batch`, in `cfg.microbatches` parts summed in float32.

        Microbatch j takes rows j, j + m, j + 2m, ... so each device splits its own rows (no
        data moves) and every part spans the whole mesh. Equal parts make the mean of
        their means the batch's mean, so the update is the full batch's (to rounding).
        """
        grad_fn = jax.value_and_grad(functools.partial(
            loss_fn, shape=self.cfg.model, implementation=self.cfg.implementation, mesh=self.mesh,
            numerics=self.numerics()))
        m = self.cfg.microbatches
        if m == 1:
            return grad_fn(params, batch)
        rows, width = batch.shape
        parts = batch.reshape(rows // m, m, width).swapaxes(0, 1)  # [m, rows / m, width]
        parts = jax.lax.with_sharding_constraint(parts, NamedSharding(self.mesh, P(None, BATCH_AXES, None)))

        def add(carry, part):
            loss, grads = grad_fn(params, part)
            return jax.tree.map(jnp.add, carry, (loss, grads)), None

        zero = (jnp.float32(0), jax.tree.map(jnp.zeros_like, params))
        (loss, grads), _ = jax.lax.scan(add, zero, parts)
        return loss / m, jax.tree.map(lambda g: g / m, grads)

    def _step(self, state: dict, batch: jax.Array) -> tuple[dict, jax.Array]:
        loss, grads = self.gradients(state["params"], batch)
        updates, opt_state = self.optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, loss

    def compile(self):
        """The train step, compiled; after a restart, loaded without tracing it (`runtime.compile_keyed`)."""
        def lower():
            batch = jax.ShapeDtypeStruct((self.cfg.global_batch_size, self.cfg.seq_len + 1), jnp.int32,
                                         sharding=self.batch_sharding)
            step = jax.jit(self._step, in_shardings=(self.state_shardings, self.batch_sharding),
                           out_shardings=(self.state_shardings, self.replicated), donate_argnums=0)
            return step.lower(self.abstract_state, batch)

        return runtime.compile_keyed(self._program_id("train_step"), lower)

    def _program_id(self, name: str) -> str:
        """The program's key: everything in the config but where checkpoints go and how often."""
        skip = ("checkpoint_dir", "checkpoint_interval", "checkpoint_keep")
        return runtime.program_id(name, {k: v for k, v in self.cfg.to_dict().items() if k not in skip})

    def run(self) -> tuple[dict, int]:
        """Train from the latest checkpoint to `cfg.steps`; returns (state, completed steps).

        On a notice to any host (the context's `agreed_stop`) every host stops after the
        same step, with that step's checkpoint committed, and returns early.
        """
        ctx = self.ctx
        threading.Thread(target=lambda: ctx.dataset, daemon=True).start()  # read it while restoring and compiling
        state = self.restore_or_init()
        t0 = time.perf_counter()
        step_fn = self.compile()
        flops = self.cfg.model.flops_per_token(self.cfg.seq_len) * self.cfg.tokens_per_step
        with ctx.loop(state, flops_per_step=flops, compile_s=time.perf_counter() - t0) as loop:
            for step in loop:
                state, loss = step_fn(loop.state, ctx.batch(step))
                loop.done(state, loss=loss)
        return loop.state, loop.step


def context_for(cfg: TrainConfig, **hooks) -> api.Context:
    """The training API's context for the built-in trainer's config (`hooks`: the host's, if any)."""
    return api.Context(steps=cfg.steps, seq_len=cfg.seq_len, global_batch_size=cfg.global_batch_size,
                       seed=cfg.seed, mesh_shape=tuple(cfg.mesh_shape), data=cfg.data,
                       checkpoint_dir=cfg.checkpoint_dir, checkpoint_interval=cfg.checkpoint_interval,
                       checkpoint_keep=cfg.checkpoint_keep, precision=cfg.precision, remat=cfg.remat,
                       microbatches=cfg.microbatches, kernel_blocks=cfg.kernel_blocks, **hooks)


param_checksums = api.param_checksums
