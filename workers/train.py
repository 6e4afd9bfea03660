"""The sharded train loop of the built-in language-model trainer, with orbax checkpoints.

`Trainer` runs the same way in a plain script (the benchmarks' bare baseline, the
tests' single-process reference) and on every host of a slice under the controller.
Batch `step` depends only on `(seed, step)` and the optimizer's schedule only on the
step count in its state, so a run restored at step k continues exactly as an
uninterrupted run would, on any mesh.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from policies.model_shape import ModelShape
from policies.sharding import AXES, BATCH_AXES, PARAM_RULES
from workers import data, runtime
from workers.model import init_params, loss_fn, param_roles

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


@dataclass(frozen=True)
class StepReport:
    step: int  # index of the step just done (0-based); `step + 1` steps are complete
    loss: float
    step_time_s: float
    tokens_per_s: float


@dataclass(frozen=True)
class Timings:
    restore_s: float = 0.0  # reading the checkpoint, or initializing parameters on a fresh start
    compile_s: float = 0.0
    restored_step: int | None = None
    unreadable: tuple[int, ...] = ()  # newer checkpoints that could not be read, newest first


class Trainer:
    def __init__(self, cfg: TrainConfig, *, may_write: Callable[[], bool] | None = None):
        self.cfg = cfg
        self.may_write = may_write or (lambda: True)
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))  # host-major
        self.mesh = Mesh(np.array(devices).reshape(cfg.mesh_shape), AXES)
        self.replicated = NamedSharding(self.mesh, P())
        self.batch_sharding = NamedSharding(self.mesh, P(BATCH_AXES, None))
        schedule = optax.warmup_cosine_decay_schedule(
            init_value=0.0, peak_value=cfg.lr_peak, warmup_steps=cfg.warmup_steps,
            decay_steps=max(cfg.steps, cfg.warmup_steps + 1), end_value=cfg.lr_end)
        self.optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                                     optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay))
        self.param_shardings = jax.tree.map(self._param_sharding, param_roles(cfg.model),
                                            is_leaf=lambda x: isinstance(x, (str, tuple)))
        abstract_params = jax.eval_shape(lambda: init_params(jax.random.key(0), cfg.model))
        abstract_opt = jax.eval_shape(self.optimizer.init, abstract_params)
        opt_shardings = optax.tree_map_params(self.optimizer, lambda _, s: s, abstract_opt, self.param_shardings,
                                              transform_non_params=lambda _: self.replicated)
        self.state_shardings = {"params": self.param_shardings, "opt_state": opt_shardings,
                                "step": self.replicated}
        self.abstract_state = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            {"params": abstract_params, "opt_state": abstract_opt,
             "step": jax.ShapeDtypeStruct((), jnp.int32)},
            self.state_shardings)
        self._manager: ocp.CheckpointManager | None = None

    def _param_sharding(self, role) -> NamedSharding:
        if isinstance(role, tuple):  # ("stacked", role): a leading layer axis, replicated
            return NamedSharding(self.mesh, P(None, *PARAM_RULES[role[1]]))
        return NamedSharding(self.mesh, P(*PARAM_RULES[role]))

    # -- state -------------------------------------------------------------------

    def init_state(self) -> dict:
        def init():
            params = init_params(jax.random.key(self.cfg.seed), self.cfg.model)
            return {"params": params, "opt_state": self.optimizer.init(params), "step": jnp.int32(0)}

        lower = jax.jit(init, out_shardings=self.state_shardings).lower
        return runtime.compile_keyed(self._program_id("init_state"), lower)()

    @property
    def manager(self) -> ocp.CheckpointManager | None:
        if self._manager is None and self.cfg.checkpoint_dir:
            self._manager = ocp.CheckpointManager(
                self.cfg.checkpoint_dir,
                options=ocp.CheckpointManagerOptions(
                    max_to_keep=self.cfg.checkpoint_keep, enable_async_checkpointing=True,
                    cleanup_tmp_directories=True, create=True))
        return self._manager

    def restore_or_init(self) -> tuple[dict, Timings]:
        """The newest readable committed checkpoint, falling back step by step; else a fresh state."""
        t0 = time.perf_counter()
        mngr = self.manager
        unreadable: list[int] = []
        for step in sorted(mngr.all_steps(), reverse=True) if mngr else []:
            try:
                state = mngr.restore(step, args=ocp.args.StandardRestore(self.abstract_state))
            except Exception as e:  # an unreadable checkpoint: try the one before
                log.warning("checkpoint at step %d is unreadable (%s: %s); trying the one before",
                            step, type(e).__name__, str(e)[:300])
                unreadable.append(int(step))
                continue
            self._set_aside(unreadable)
            return state, Timings(restore_s=time.perf_counter() - t0, restored_step=int(step),
                                  unreadable=tuple(unreadable))
        self._set_aside(unreadable)
        return self.init_state(), Timings(restore_s=time.perf_counter() - t0, unreadable=tuple(unreadable))

    def _set_aside(self, steps: list[int]) -> None:
        """Move unreadable checkpoints out of orbax's sight (kept for inspection), so the steps can be saved again."""
        if not steps:
            return
        from etils import epath
        from jax.experimental import multihost_utils

        if jax.process_index() == 0:
            root = epath.Path(self.cfg.checkpoint_dir)
            for step in steps:
                target = root / f"{step}.unreadable-{int(time.time())}"
                (root / str(step)).rename(target)
                log.warning("moved unreadable checkpoint %d aside to %s", step, target)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("checkpoints set aside")
        self.manager.reload()

    def save(self, step: int, state: dict, *, force: bool = False) -> bool:
        """Start an async save of `state` after `step` complete steps; False when fenced off."""
        mngr = self.manager
        if mngr is None:
            return False
        if not self.may_write():
            log.warning("not saving step %d: this worker's generation is no longer current", step)
            return False
        return mngr.save(step, args=ocp.args.StandardSave(state), force=force)

    def close(self) -> None:
        if self._manager is not None:
            self._manager.wait_until_finished()
            self._manager.close()
            self._manager = None

    # -- steps -------------------------------------------------------------------

    def _step(self, state: dict, batch: jax.Array) -> tuple[dict, jax.Array]:
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch, self.cfg.model,
                                                  implementation=self.cfg.implementation, mesh=self.mesh)
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

    def batch(self, step: int) -> jax.Array:
        c = self.cfg
        shape = (c.global_batch_size, c.seq_len + 1)
        return jax.make_array_from_callback(
            shape, self.batch_sharding,
            lambda index: data.batch_rows(c.seed, step, c.global_batch_size, c.seq_len, index[0]))

    def run(self, *, on_step: Callable[[StepReport], None] | None = None,
            should_stop: Callable[[], bool] | None = None,
            on_ready: Callable[[Timings], None] | None = None,
            on_save: Callable[[int, float], None] | None = None) -> tuple[dict, int]:
        """Train from the latest checkpoint to `cfg.steps`; returns (state, completed steps).

        `should_stop` is asked after every step (a preemption notice): the state is then
        saved at the current step, the save committed, and the loop returns early.
        """
        c = self.cfg
        threading.Thread(target=data.corpus, daemon=True).start()  # read it while restoring and compiling
        state, timings = self.restore_or_init()
        t0 = time.perf_counter()
        step_fn = self.compile()
        timings = dataclasses.replace(timings, compile_s=time.perf_counter() - t0)
        if on_ready:
            on_ready(timings)
        done = int(np.asarray(state["step"].addressable_data(0)))
        while done < c.steps:
            t = time.perf_counter()
            state, loss = step_fn(state, self.batch(done))
            loss_v = float(np.asarray(loss.addressable_data(0)))
            dt = time.perf_counter() - t
            done += 1
            stop = bool(should_stop and should_stop())  # every process must ask, every step (a collective)
            if done % c.checkpoint_interval == 0 or done == c.steps or stop:
                t = time.perf_counter()
                if self.save(done, state, force=True) and on_save:
                    on_save(done, time.perf_counter() - t)  # the blocking part; the write goes on behind
            if on_step:
                on_step(StepReport(done - 1, loss_v, dt, c.tokens_per_step / dt))
            if stop:
                break
        self.close()  # waits until the last save is committed
        return state, done


def param_checksums(params: dict) -> dict[str, float]:
    """The sum of each parameter array, for comparing two runs' final models (all processes must call)."""
    sums = jax.jit(lambda p: jax.tree.map(jnp.sum, p))(params)
    flat, _ = jax.tree_util.tree_flatten_with_path(sums)
    return {jax.tree_util.keystr(path): float(np.asarray(x.addressable_data(0))) for path, x in flat}
