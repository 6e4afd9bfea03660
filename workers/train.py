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

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kernels.blocks import KernelBlocks
from policies.model.sharding import BATCH_AXES, PARAM_RULES
from workers import api, programs
from workers.model import Numerics, init_params, loss_fn, param_roles
from workers.settings import LmSettings, TrainingSettings

log = logging.getLogger(__name__)


class Trainer:
    """The built-in trainer: its model, optimizer and shardings around the training API's loop.

    `lm`: its own settings; the ones every program shares (steps, batch, mesh, numerics, ...)
    are the context's (`ctx.settings`), as a user program's are.
    """

    def __init__(self, lm: LmSettings, ctx: api.Context):
        self.lm, self.ctx, self.settings = lm, ctx, ctx.settings
        self.mesh = ctx.mesh
        self.replicated = NamedSharding(self.mesh, P())
        self.batch_sharding = NamedSharding(self.mesh, P(BATCH_AXES, None))
        assert self.settings.steps is not None, "the lm workload always has its steps (`LmWorkload.steps`)"
        schedule = optax.warmup_cosine_decay_schedule(
            init_value=0.0, peak_value=lm.lr_peak, warmup_steps=lm.warmup_steps,
            decay_steps=max(self.settings.steps, lm.warmup_steps + 1), end_value=lm.lr_end)
        self.optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                                     optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=lm.weight_decay))
        self.param_shardings = jax.tree.map(self._param_sharding, param_roles(lm.model),
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
        params = init_params(key, self.lm.model)
        return {"params": params, "opt_state": self.optimizer.init(params), "step": jnp.int32(0)}

    def init_state(self) -> dict:
        """A fresh state, compiled once per program and kept (`programs.compile_keyed`)."""
        key = jax.random.key(self.settings.seed)
        lower = lambda: jax.jit(self._init, out_shardings=self.state_shardings).lower(key)  # noqa: E731
        return programs.compile_keyed(self.program_id("init_state"), lower)(key)

    def restore_or_init(self) -> dict:
        """The newest readable committed checkpoint, falling back step by step; else a fresh state."""
        return self.ctx.restore_or_init(self._init, self.state_shardings, initialize=self.init_state)

    # -- steps -------------------------------------------------------------------

    def numerics(self) -> Numerics:
        s = self.settings
        return Numerics(compute_dtype=self.ctx.compute_dtype, remat=s.remat,
                        blocks=KernelBlocks.from_mapping(s.kernel_blocks))

    def gradients(self, params: dict, batch: jax.Array) -> tuple[jax.Array, dict]:
        """Mean loss and its gradient over `batch`, in `settings.microbatches` parts summed in float32.

        Microbatch j takes rows j, j + m, j + 2m, ... so each device splits its own rows (no
        data moves) and every part spans the whole mesh. Equal parts make the mean of
        their means the batch's mean, so the update is the full batch's (to rounding).
        """
        grad_fn = jax.value_and_grad(functools.partial(
            loss_fn, shape=self.lm.model, implementation=self.lm.implementation, mesh=self.mesh,
            numerics=self.numerics()))
        m = self.settings.microbatches
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

    def lower_step(self) -> "jax.stages.Lowered":
        """The train step on this mesh, traced and lowered for abstract inputs (nothing runs)."""
        s = self.settings
        assert s.global_batch_size is not None and s.seq_len is not None, "the lm workload always has both"
        batch = jax.ShapeDtypeStruct((s.global_batch_size, s.seq_len + 1), jnp.int32, sharding=self.batch_sharding)
        step = jax.jit(self._step, in_shardings=(self.state_shardings, self.batch_sharding),
                       out_shardings=(self.state_shardings, self.replicated), donate_argnums=0)
        return step.lower(self.abstract_state, batch)

    def compile(self):
        """The train step, compiled; after a restart, loaded without tracing it (`programs.compile_keyed`)."""
        key = self.program_id("train_step")
        if jax.process_index() == 0 and (path := programs.kept_program_path(key)) is not None and path.exists():
            log.info("the train step for %d slice(s) was kept (compiled ahead, or by an earlier run): loading it",
                     self.settings.slices)
        return programs.compile_keyed(key, self.lower_step)

    def program_id(self, name: str) -> str:
        """The program's key on this runtime (`programs.program_id` of `program_config`)."""
        return programs.program_id(name, program_config(self.lm, self.settings))

    def run(self, ahead=None) -> tuple[dict, int]:
        """Train from the latest checkpoint to the settings' `steps`; returns (state, completed steps).

        `ahead`: the host's `workers.ahead.CompileAhead`, told after each step (a multi-slice job's).

        On a notice to any host (the context's `agreed_stop`) every host stops after the
        same step, with that step's checkpoint committed, and returns early.
        """
        ctx = self.ctx
        threading.Thread(target=lambda: ctx.dataset, daemon=True).start()  # read it while restoring and compiling
        state = self.restore_or_init()
        t0 = time.perf_counter()
        step_fn = self.compile()
        s = self.settings
        assert s.seq_len is not None and s.tokens_per_step is not None, "the lm workload always has both"
        flops = self.lm.model.flops_per_token(s.seq_len) * s.tokens_per_step
        with ctx.loop(state, flops_per_step=flops, compile_s=time.perf_counter() - t0) as loop:
            for step in loop:
                state, loss = step_fn(loop.state, ctx.batch(step))
                loop.done(state, loss=loss)
                if ahead is not None:
                    ahead.after_step()
        return loop.state, loop.step


def program_config(lm: LmSettings, settings: TrainingSettings) -> dict:
    """What makes the trainer's programs: every setting but where checkpoints go, how often, and the chip's peak."""
    skip = ("checkpoint_dir", "checkpoint_interval", "checkpoint_keep", "peak_flops_per_chip", "memory_step",
            "memory_interval")
    shared = {k: v for k, v in dataclasses.asdict(settings).items() if k not in skip}
    return {**shared, **dataclasses.asdict(lm)}


param_checksums = api.param_checksums
