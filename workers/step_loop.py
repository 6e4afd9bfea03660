"""The step loop of the training API (`workers.api.Context.loop` makes one): it counts steps, saves at the
interval it is handed, agrees on stops across hosts, keeps the copy in memory and reports each step.

It reads its context through `LoopContext`, the part of `workers.api.Context` it needs, so this module does
not import the API it serves.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import jax
import numpy as np

from workers.checkpoints import Checkpoints
from workers.protocol import Report, Saved, StepDone
from workers.settings import TrainingSettings


class LoopContext(Protocol):
    """What the loop reads from its context (`workers.api.Context` is one)."""

    @property
    def settings(self) -> TrainingSettings: ...

    @property
    def restored_from(self) -> str: ...  # "memory" when the hosts' copies were restored

    @property
    def profiler(self) -> Any: ...  # `workers.profiling.Profiler`, or None

    @property
    def keeping(self) -> Any: ...  # `workers.memory.Keeping`, or None

    @property
    def agreed_stop(self) -> Callable[[], bool] | None: ...  # whether any host got a notice (all must call)

    @property
    def stop_requested(self) -> Callable[[], bool]: ...  # whether this host got one

    @property
    def send(self) -> Callable[[Report], None]: ...  # to the controller

    @property
    def checkpoints(self) -> Checkpoints | None: ...

    def data_meta(self) -> dict: ...

    def close_checkpoints(self) -> None: ...


@dataclasses.dataclass
class _Pending:
    step: int
    loss: Any
    metrics: dict


class Loop:
    """Iterates step indices; `done(state, loss=...)` after each step saves, stops and reports.

    A step's loss and metrics are read (a device-to-host copy) one step later, so the
    loop never waits for the device between steps; a step's time is the time between
    the moments its loss and the previous step's were ready. Every host must run the same steps:
    on a notice to any host, all stop after the same step, with it committed.

    Every host issues the same gloo collectives in the same order, all from this thread (the
    CPU client runs one multi-device program at a time, in the order they were dispatched):
    step s's program; the vote (`agreed_stop`, one all-gather that also carries profile
    requests); at a save step, the write agreement (`Checkpoints.save`, one all-gather) and
    orbax's save, whose barriers go through the coordination service. What decides whether a
    save happens (the step, the total, the voted stop) is the same on every host; what one
    host sees alone (its notice, its fence, its clock) reaches the decision only through an
    all-gather. The lagged loss read is a copy from this host's own device, no collective.
    """

    def __init__(self, ctx: LoopContext, state: Any, start: int, *, flops_per_step: float | None,
                 tokens_per_step: int | None):
        self.ctx, self.state, self.step = ctx, state, start
        assert ctx.settings.steps is not None, "made by Context.loop, which checks workload.steps"
        self.total = ctx.settings.steps
        self.flops_per_step, self.tokens_per_step = flops_per_step, tokens_per_step
        self.stopped = False  # stopped early on a notice (the step is committed)
        self.closed = False
        self._awaiting_done = False
        self._pending: _Pending | None = None
        self._ready_at = time.perf_counter()  # when the previous step's values were on the host
        # Restored from the hosts' memory (every host alike, `workers.memory.recall`): storage holds an older step,
        # so the first step after it is saved, and a later loss of every copy goes back no further.
        self._behind_memory = ctx.restored_from == "memory"
        self._step_s: float | None = None  # the last step's time

    def __iter__(self) -> Iterator[int]:
        profiler = self.ctx.profiler
        try:
            while self.step < self.total and not self.stopped:
                self._awaiting_done = True
                if profiler is not None and profiler.busy and profiler.boundary(self):  # a capture traces this step
                    with jax.profiler.StepTraceAnnotation("train", step_num=self.step):
                        yield self.step
                else:
                    yield self.step
                if self._awaiting_done:
                    raise RuntimeError(f"step {self.step}: call loop.done(state, loss=...) once after each step")
        finally:
            self.close()

    def __enter__(self) -> Loop:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def completed(self) -> bool:
        return self.step >= self.total

    def done(self, state: Any, *, loss: Any, **metrics: Any) -> None:
        """Step `self.step` is done and gave `state`: count it, save if due, agree on a stop, report."""
        if not self._awaiting_done:
            raise RuntimeError("loop.done() called twice for one step, or outside the loop")
        self._awaiting_done = False
        self.state = state
        self.step += 1
        ctx = self.ctx
        self._flush()  # the previous step, before a save can wait for this one
        stop = bool(ctx.agreed_stop()) if ctx.agreed_stop else bool(ctx.stop_requested())  # all hosts ask
        self._pending = _Pending(self.step - 1, loss, metrics)
        if self.step % ctx.settings.checkpoint_interval == 0 or self.step == self.total or stop or self._behind_memory:
            if self._behind_memory:  # the first step after a restore from memory is reported before the save that
                self._flush()  # puts storage level with memory: the job is seen going on (one wait on the device)
            self._behind_memory = False
            self._save()
        if ctx.keeping is not None:  # the first tier: this host's shards, in its memory
            ctx.keeping.after_step(self.step, state, self._step_s)
        if stop:
            self.stopped = True

    def _save(self) -> None:
        ckpts = self.ctx.checkpoints
        if ckpts is None:
            return
        t = time.perf_counter()
        if ckpts.save(self.step, self.state, self.ctx.data_meta()):
            self.ctx.send(Saved(self.step, time.perf_counter() - t))  # the blocking part; the write goes on

    def _flush(self) -> None:
        """Report the previous step, whose values are on the host by now."""
        p, self._pending = self._pending, None
        if p is None:
            return
        loss = _scalar(p.loss)  # waits for the step
        if not math.isfinite(loss):  # deterministic from here on: restarting would only spend money
            raise FloatingPointError(f"step {p.step}: the loss is {loss}; training cannot go on from a non-finite "
                                     "loss (a learning rate too high, or tokens beyond the vocabulary?)")
        metrics = {k: _scalar(v) for k, v in p.metrics.items()}
        now = time.perf_counter()
        step_time, self._ready_at = now - self._ready_at, now
        self._step_s = step_time
        tokens_per_s = self.tokens_per_step / step_time if self.tokens_per_step and step_time > 0 else None
        metrics.update(self._utilisation(step_time))
        self.ctx.send(StepDone(p.step, loss, tokens_per_s, step_time, metrics))

    def _utilisation(self, step_time_s: float) -> dict[str, float]:
        out: dict[str, float] = {}
        chips = len(jax.devices())
        if self.flops_per_step and step_time_s > 0:
            per_chip = self.flops_per_step / step_time_s / chips
            out["tflops_per_chip"] = per_chip / 1e12
            peak = self.ctx.settings.peak_flops_per_chip
            if peak:
                out["mfu"] = per_chip / peak
        stats = _memory_stats()
        if stats:
            out.update(stats)
        return out

    def close(self) -> None:
        """Report the last step and wait until the last save is committed (idempotent)."""
        if self.closed:
            return
        self.closed = True
        self._flush()
        if self.ctx.profiler is not None:  # a capture under way ends with the steps it traced
            self.ctx.profiler.close(self)
        self.ctx.close_checkpoints()


def _scalar(x: Any) -> float:
    """A host float of a (replicated) scalar, without gathering from other processes."""
    if isinstance(x, jax.Array):
        return float(np.asarray(x.addressable_data(0)))
    return float(x)


def _memory_stats() -> dict[str, float]:
    """HBM in use and its peak on this host's first device, in GiB (backends that keep no stats: none)."""
    try:
        stats = jax.local_devices()[0].memory_stats()
    except jax.errors.JaxRuntimeError:  # the backend's allocator could not say (one that keeps none says None)
        return {}
    if not stats or "bytes_in_use" not in stats:
        return {}
    gib = 1024 ** 3
    out = {"hbm_in_use_gib": stats["bytes_in_use"] / gib}
    if "peak_bytes_in_use" in stats:
        out["hbm_peak_gib"] = stats["peak_bytes_in_use"] / gib
    if "bytes_limit" in stats:
        out["hbm_limit_gib"] = stats["bytes_limit"] / gib
    return out
