"""The training API: a user's own JAX program gets every guarantee the built-in trainer has.

A job file with ``workload: {type: entrypoint, entrypoint: "train:main", ...}`` names a
function that every host of the slice calls with a `Context` once the multi-host JAX
runtime is up. Around the user's own ``init`` and ``train_step`` it gives::

    from workers import api

    def main(ctx: api.Context):
        optimizer = optax.adamw(1e-3)

        def init(key):                                  # the user's own model and optimizer
            params = my_model.init(key)
            return {"params": params, "opt_state": optimizer.init(params)}

        state = ctx.restore_or_init(init)               # newest checkpoint, resharded; or fresh
        step_fn = jax.jit(train_step, donate_argnums=0)
        with ctx.loop(state, step=step_fn) as loop:     # step=: what `plan --compile` compiles
            for step in loop:                           # from the restored step to ctx.steps
                state, loss = step_fn(loop.state, ctx.batch(step))
                loop.done(state, loss=loss)             # saves, agrees on stops, reports

- the job file's training settings on this slice (`ctx.settings`, a frozen
  `workers.settings.TrainingSettings` resolved once per launch; `ctx.steps`, `ctx.seq_len`,
  ... read its fields);
- the slice's mesh (`ctx.mesh`, axes ``data, fsdp, model`` from the spec's mesh wishes)
  and shardings for any pytree (`ctx.shardings`: FSDP over the ``fsdp`` axis by default);
- `restore_or_init`: the newest committed checkpoint of the whole pytree restored onto
  this slice's mesh, whatever mesh wrote it, falling back past unreadable ones;
- the step loop (`Loop`): it saves at the interval the controller hands it (on spot, the
  cost policy's), stops every host after the same step on a preemption notice or a
  cancel with that step committed, never writes from a fenced-off generation, and
  reports step, loss, tokens/s and the user's metrics to `status`, Prometheus and the report;
  and it traces the steps `orchestrator profile` asks for, on every chosen host from the
  same step (`workers.profiling`);
- the compile before paying: a program that gives `ctx.loop` its step (``step=``) is traced
  without running (`Context.trace_only`: abstract state and batch, nothing read or written)
  and its step compiled by XLA's TPU compiler for each slice the job may use
  (``orchestrator plan --compile``), so it learns whether it fits and how fast it could go;
- the data position (`ctx.batch`): batch ``s`` is a pure function of ``(seed, s)`` and the
  global batch, each host reading only its rows, so a resumed or resized run sees
  exactly the batches an uninterrupted run would. The checkpoint records the seed and
  the data's fingerprint; a restore onto other data is refused.

The built-in trainer (`workers.train`) runs on this same API. Programs written for the
older 7-field context keep working: `rank`, `num_hosts`, `args`, `checkpoint_dir`,
`stop_requested`, `may_write` and `report` are still here.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from policies.model.sharding import AXES, BATCH_AXES
from workers.checkpoints import Checkpoints
from workers.protocol import Report, StepDone, Timings
from workers.settings import TrainingSettings
from workers.step_loop import Loop

log = logging.getLogger(__name__)

__all__ = ["Context", "DataMismatch", "DeclaredStep", "Loop", "StepNotDeclared", "TrainingSettings", "local_context",
           "param_checksums"]

_SETTING_NAMES = frozenset(f.name for f in dataclasses.fields(TrainingSettings))


class DeclaredStep(BaseException):
    """What a program declared to `Context.loop` of a context that only traces (`Context.trace_only`): its step
    function and the abstract state and batch it takes.

    A BaseException, as `SystemExit` is: it ends the program at its loop, and a program's own
    ``except Exception`` does not catch it."""

    def __init__(self, step: Callable[..., Any], state: Any, batch: Any, *, flops_per_step: float | None,
                 tokens_per_step: int | None):
        super().__init__("the program's step, declared for a compile")
        self.step, self.state, self.batch = step, state, batch
        self.flops_per_step, self.tokens_per_step = flops_per_step, tokens_per_step


class StepNotDeclared(ValueError):
    """A program traced for a compile reached its loop without declaring its step (`Context.loop`'s `step`)."""


class DataMismatch(ValueError):
    """A checkpoint was trained on other data (or another seed) than this run reads."""


@dataclasses.dataclass
class Context:
    """What a host's program gets: who it is, its settings on this slice, and the services above."""

    rank: int = 0  # this host's worker id (0 is the coordinator)
    num_hosts: int = 1
    args: dict[str, Any] = dataclasses.field(default_factory=dict)  # the job file's `workload.args`
    settings: TrainingSettings = dataclasses.field(default_factory=TrainingSettings)
    # Hooks to the host (defaults: a plain process with no controller).
    stop_requested: Callable[[], bool] = lambda: False  # True once this host got a notice
    may_write: Callable[[], bool] = lambda: True  # False once a newer generation was launched
    agreed_stop: Callable[[], bool] | None = None  # whether any host got a notice (all must call it)
    send: Callable[[Report], None] = lambda report: None  # to the controller
    profiler: Any = None  # the host's `workers.profiling.Profiler`: captures asked for from outside
    keeper: Any = None  # this host's `workers.memory.HostMemory` (a multi-slice job's first tier), or None
    # The devices the mesh lays over: None, this runtime's (`jax.devices()`); a TPU topology's to compile the
    # program for a slice that is not here (`workers.tpu_target`).
    devices: Sequence[Any] | None = None
    # The program is traced for a compile, not run (`workers.tpu_target.compile_program`): `restore_or_init`
    # gives the state's shapes and shardings, `batch` the batch's, and `loop` hands the step it is given to the
    # compiler and ends the program there (`DeclaredStep`). Nothing is read, restored, trained or saved.
    trace_only: bool = False

    def __post_init__(self):
        self._mesh: Mesh | None = None
        self._dataset = None
        self._checkpoints: Checkpoints | None = None
        self.restored_step: int | None = None
        self.unreadable: tuple[int, ...] = ()
        self.restore_s = 0.0
        self.restored_from = "storage"
        self.memory_miss: str | None = None
        self.last_loop: Loop | None = None
        self.keeping = None
        if self.keeper is not None and self.settings.slices > 1:  # one slice left: its loss takes its memory
            from workers.memory import Keeping

            self.keeping = Keeping(self.keeper, self.send, every=self.settings.memory_interval)

    def __getattr__(self, name: str) -> Any:
        """The settings read through (`ctx.steps` is `ctx.settings.steps`), as programs written
        before `settings` read them; declared once, in `TrainingSettings`."""
        if name in _SETTING_NAMES:
            return getattr(self.settings, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def compute_dtype(self) -> str:
        """`precision` on this backend: "auto" is bfloat16 on TPU and GPU, float32 on CPU."""
        if self.settings.precision != "auto":
            return self.settings.precision
        return "float32" if self._devices()[0].platform == "cpu" else "bfloat16"

    # -- the old context's report, kept for programs that call it --------------

    def report(self, step: int, loss: float, tokens_per_s: float | None = None) -> None:
        self.send(StepDone(step, float(loss), tokens_per_s))

    # -- mesh and shardings ----------------------------------------------------

    @property
    def mesh(self) -> Mesh:
        """The slice's devices as a mesh with axes ``(data, fsdp, model)``, hosts in order."""
        if self._mesh is None:
            devices = sorted(self._devices(), key=lambda d: (d.process_index, d.id))  # host-major
            shape = self.settings.mesh_shape or (len(devices), 1, 1)
            self._mesh = Mesh(np.array(devices).reshape(shape), AXES)
        return self._mesh

    def _devices(self) -> Sequence[Any]:
        return self.devices if self.devices is not None else jax.devices()

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    @property
    def batch_sharding(self) -> NamedSharding:
        """Rows over the data and fsdp axes: each host holds the rows its devices train on."""
        return NamedSharding(self.mesh, P(BATCH_AXES))

    def shardings(self, tree: Any, rule: Callable[[jax.ShapeDtypeStruct], P] | None = None) -> Any:
        """A `NamedSharding` for every leaf of `tree` (arrays or shape structs) on this mesh.

        `rule` maps a leaf to its `PartitionSpec`; the default, `fsdp_spec`, shards each
        array's largest axis that the ``fsdp`` axis divides and replicates the rest (with
        ``fsdp: 1``, the default mesh, everything is replicated and the batch is split).
        """
        rule = rule or (lambda leaf: fsdp_spec(leaf.shape, self.mesh.shape["fsdp"]))
        return jax.tree.map(lambda leaf: NamedSharding(self.mesh, rule(leaf)), tree)

    # -- state -----------------------------------------------------------------

    @property
    def checkpoints(self) -> Checkpoints | None:
        s = self.settings
        if self._checkpoints is None and s.checkpoint_dir:
            self._checkpoints = Checkpoints(s.checkpoint_dir, keep=s.checkpoint_keep, may_write=self.may_write)
        return self._checkpoints

    def restore_or_init(self, init: Callable[[jax.Array], Any], shardings: Any = None, *,
                        initialize: Callable[[], Any] | None = None) -> Any:
        """The newest readable checkpoint restored onto this mesh, or ``init(PRNGKey(seed))``.

        `shardings`: a pytree of `NamedSharding` matching the state (default:
        `self.shardings` of its shapes). `initialize`: how to make the fresh state, when
        the caller has its own compiled initializer (the built-in trainer's is cached).
        """
        t0 = time.perf_counter()
        key = jax.random.key(self.settings.seed)
        abstract = jax.eval_shape(init, key)
        if shardings is None:
            shardings = self.shardings(abstract)
        state = None
        target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings)
        if self.trace_only:  # the state as the compiler sees it: its shapes, dtypes and shardings
            return target
        step = self.settings.memory_step
        if step is not None:  # the survivors of a lost slice: their own copy
            from workers.memory import MemoryMiss, recall

            try:
                if self.keeper is None:
                    raise MemoryMiss("this host has no keeper")
                state, self.restored_step, self.restored_from = recall(self.keeper, step, target), step, "memory"
            except MemoryMiss as e:
                self.memory_miss = str(e)
                log.warning("host memory: no usable copy of step %d (%s); restoring from storage", step, e)
        if state is None and self.checkpoints is not None:
            found, unreadable = self.checkpoints.restore_newest(target)
            self.unreadable = tuple(unreadable)
            if found is not None:
                self._check_same_data(found.meta, found.step)
                state, self.restored_step = found.state, found.step
        if state is None:
            state = initialize() if initialize else jax.jit(init, out_shardings=shardings)(key)
        self.restore_s = time.perf_counter() - t0
        return state

    def close_checkpoints(self) -> None:
        """Wait for the last save to be committed and let the checkpoints go (the loop's close)."""
        if self._checkpoints is not None:
            self._checkpoints.close()
            self._checkpoints = None

    def data_meta(self) -> dict:
        """What the batches depend on, recorded in every checkpoint."""
        meta: dict[str, Any] = {"seed": self.settings.seed}
        if self.settings.seq_len is not None:
            meta["data"] = self.dataset.fingerprint
        return meta

    def _check_same_data(self, meta: dict, step: int) -> None:
        mine = self.data_meta()
        for key in ("seed", "data"):
            if key in meta and key in mine and meta[key] != mine[key]:
                raise DataMismatch(
                    f"the checkpoint of step {step} in {self.settings.checkpoint_dir} was trained with {key} "
                    f"{meta[key]!r}, this run has {mine[key]!r}: continuing would not see the batches an "
                    "uninterrupted run would (use a new checkpoint directory for a new run)")

    # -- data ------------------------------------------------------------------

    @property
    def dataset(self):
        """The job's token files (`workers.tokens`), opened once."""
        if self._dataset is None:
            from workers import data, tokens

            s = self.settings
            if s.data is not None:  # names the file that is missing, truncated or too short, before step 0
                tokens.check(s.data, vocab_size=None, seq_len=s.seq_len)
            self._dataset = data.open_dataset(s.data)
        return self._dataset

    def batch(self, step: int) -> jax.Array:
        """Batch `step`: int32 tokens ``[global_batch_size, seq_len + 1]``, rows over the batch axes (a context
        that only traces gives its shape, dtype and sharding: a `jax.ShapeDtypeStruct`).

        Each host reads only the rows its devices hold; the values depend only on
        ``(seed, step)``, not on the mesh or on how many times the job restarted.
        """
        n, s, seed = self.settings.global_batch_size, self.settings.seq_len, self.settings.seed
        if s is None or n is None:
            raise ValueError("ctx.batch needs workload.seq_len and workload.global_batch_size in the job file")
        if self.trace_only:
            shape = jax.ShapeDtypeStruct((n, s + 1), np.int32, sharding=NamedSharding(self.mesh, P(BATCH_AXES, None)))
            return shape  # type: ignore[return-value]  # what the compiler takes in its place
        dataset = self.dataset
        return jax.make_array_from_callback(
            (n, s + 1), NamedSharding(self.mesh, P(BATCH_AXES, None)),
            # JAX types the index as optional but never passes None (it asserts so before the call).
            lambda index: dataset.rows(seed, step, n, s, index[0]))  # type: ignore[index]

    # -- the loop --------------------------------------------------------------

    def loop(self, state: Any, *, step: Callable[..., Any] | None = None, batch: Any = None,
             start: int | None = None, flops_per_step: float | None = None, tokens_per_step: int | None = None,
             compile_s: float = 0.0) -> Loop:
        """The step loop from the restored step (or `start`) to the settings' `steps`.

        `step` declares the program's step function, ``step(state, batch) -> (state, metrics)``
        (jitted or not), and `batch` an example of its batch (default: `batch`'s): with them,
        ``orchestrator plan --compile`` compiles the program's own step for every slice the job
        may use with XLA's TPU compiler. A training run does not use them.
        """
        if self.settings.steps is None:
            raise ValueError("ctx.loop needs workload.steps in the job file")
        if tokens_per_step is None:
            tokens_per_step = self.settings.tokens_per_step
        if self.trace_only:
            if step is None:
                raise StepNotDeclared("the program does not declare its step: it calls ctx.loop(state) without "
                                      "step=, so the compiler cannot see it (ctx.loop(state, step=train_step))")
            example = self.batch(start or 0) if batch is None else jax.tree.map(_abstract, batch)
            raise DeclaredStep(step, jax.tree.map(_abstract, state), example, flops_per_step=flops_per_step,
                               tokens_per_step=tokens_per_step)
        first = start if start is not None else (self.restored_step or 0)
        self.send(Timings(self.restore_s, compile_s, self.restored_step, self.unreadable, self.restored_from,
                          self.memory_miss))
        self.last_loop = Loop(self, state, first, flops_per_step=flops_per_step, tokens_per_step=tokens_per_step)
        return self.last_loop


def fsdp_spec(shape: tuple[int, ...], fsdp: int) -> P:
    """Shard the largest axis that `fsdp` divides (the first of equals); replicate if none does."""
    if fsdp <= 1 or not shape:
        return P()
    candidates = [i for i, n in enumerate(shape) if n % fsdp == 0 and n >= fsdp]
    if not candidates:
        return P()
    axis = max(candidates, key=lambda i: (shape[i], -i))
    return P(*[("fsdp" if i == axis else None) for i in range(len(shape))])


def _abstract(x: Any) -> Any:
    """A leaf as the compiler takes it: its shape, dtype and (where it has one) sharding."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype,
                                sharding=getattr(x, "sharding", None))


def param_checksums(tree: Any) -> dict[str, float]:
    """The sum of each array of `tree`, for comparing two runs' final models (all processes must call)."""
    import jax.numpy as jnp

    sums = jax.jit(lambda t: jax.tree.map(lambda x: jnp.sum(x.astype(jnp.float32)), t))(tree)
    flat, _ = jax.tree_util.tree_flatten_with_path(sums)
    return {jax.tree_util.keystr(path): float(np.asarray(x.addressable_data(0))) for path, x in flat}


def local_context(**given: Any) -> Context:
    """A context for a plain process with no controller: scripts, notebooks, tests, the bare baseline.

    `given`: `TrainingSettings` fields (``steps=30, seq_len=128``) and `Context` fields, by name.
    """
    settings = {k: v for k, v in given.items() if k in _SETTING_NAMES}
    rest = {k: v for k, v in given.items() if k not in _SETTING_NAMES}
    return Context(settings=TrainingSettings(**settings), **rest)
