"""A job's checkpoints on disk: orbax saves of any pytree, with fencing and a fallback past bad ones.

Layout: an orbax `CheckpointManager` folder, local or in a bucket (``gs://bucket/folder``;
`workers.storage`), with one folder per committed step, holding two items:

- ``state``: the pytree (`ocp.args.StandardSave`): the built-in trainer's
  ``{"params", "opt_state", "step"}`` or whatever a user program keeps;
- ``meta``: a small JSON dict (`ocp.args.JsonSave`): ``step`` (steps complete), and what
  the batches depend on (``seed``, the data's ``fingerprint``), so a restore can check
  that the run continues on the same data.

Restores are resharded: the target's shapes, dtypes and shardings come from the caller
(an abstract pytree for this slice's mesh), whatever mesh wrote the checkpoint. Saves are
asynchronous; `close` waits until the last one is committed. A worker whose generation
is no longer the job's current one never writes (`may_write`, the fence).

Every host runs the same collectives in the same order, or gloo aborts the process
("Received data size doesn't match expected size. Is there a distributed collective
mismatch"). So what a host decides alone never changes which collectives it issues:

- orbax's barriers go through the runtime's coordination service (named barriers, a
  timeout that names the barrier), not through gloo (`_barriers_off_gloo`): JAX's
  collectives-based barrier is an all-gather that lands between the training step's
  own all-reduces, and any host that skips or repeats one (a save it alone declines,
  a restore it alone fails) corrupts every later collective;
- whether to write is agreed: a save goes ahead only if every host may write (`save`);
- which step is restored is agreed: process 0's list of steps, tried newest first, and a
  step is taken only if every host read it (`restore_newest`).

A step is committed when orbax says so: locally its folder is renamed from a temporary
name at the end of the save; in a bucket, where there is no rename, the step's folder gets
a ``commit_success.txt`` last. Either way a save cut short is no step (`steps` and
`restore_newest` never see it) and the next manager on process 0 removes what it left.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from workers import storage

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestoredCheckpoint:
    """What `Checkpoints.restore_newest` found."""

    state: Any
    meta: dict
    step: int


_DISTRIBUTED_BARRIER_FLAG = "experimental_orbax_use_distributed_barrier"


def _barriers_off_gloo() -> None:
    """orbax's barriers through the coordination service rather than a gloo all-gather (idempotent).

    orbax reads this from an absl flag, which nothing parses in a worker; parsing just
    this one marks it set without touching the others.
    """
    from absl import flags

    flag = flags.FLAGS[_DISTRIBUTED_BARRIER_FLAG]
    if not (flag.present and flag.value):
        flag.parse("true")


# A replicated array is split among its replicas to be saved only where each part is at least this many
# bytes; below that, one replica saves it whole.
REPLICA_PARALLEL_MIN_BYTES = 1 << 20


@functools.cache
def _small_arrays_whole() -> None:
    """Small replicated arrays saved whole by one replica (once a process).

    By default orbax splits every replicated array among its replicas (replica-parallel saves),
    and each replica's part is cut on its device by a program compiled for that shape and
    device. A process compiles them at its first save, and every generation is a new process:
    the built-in trainer's tiny model compiled 28 of them a host at each launch (JAX logged
    1.3-2.8 s a host, 11 s on a 4-host slice sharing two cores; the hosts of two local jobs'
    tests took 83.2 -> 77.5 CPU-s without them). Splitting pays for large arrays only, so a
    part under `REPLICA_PARALLEL_MIN_BYTES` (orbax's own threshold, which it leaves unset) is
    not split. The values a checkpoint holds are the same; only their chunks on disk differ,
    and a restore reads either (`tests/numerics/test_checkpoint_slices.py`).
    """
    from orbax.checkpoint._src.metadata import array_metadata_store  # the default handler's own store

    ocp.type_handlers.register_type_handler(
        jax.Array, ocp.type_handlers.ArrayHandler(min_slice_bytes_for_replica_parallel=REPLICA_PARALLEL_MIN_BYTES,
                                                  array_metadata_store=array_metadata_store.Store()),
        override=True)


def all_hosts(flag: bool) -> bool:
    """Whether `flag` holds on every host: one all-gather, which every host must call at the same point."""
    if jax.process_count() == 1:
        return bool(flag)
    from jax.experimental import multihost_utils

    votes = multihost_utils.process_allgather(np.array([int(bool(flag))], np.int32))
    return bool(np.asarray(votes).all())


def _steps_of_process_0(steps: list[int]) -> list[int]:
    """Process 0's list of committed steps, on every host (each host lists the folder at its own moment)."""
    if jax.process_count() == 1:
        return steps
    from jax.experimental import multihost_utils

    count = int(multihost_utils.broadcast_one_to_all(np.int32(len(steps))))
    padded = np.full(max(count, 1), -1, np.int32)
    padded[:min(count, len(steps))] = steps[:count]
    return [int(s) for s in np.asarray(multihost_utils.broadcast_one_to_all(padded))[:count]]


class Checkpoints:
    def __init__(self, directory: str, *, keep: int = 3, may_write: Callable[[], bool] | None = None):
        self.directory = directory
        self.may_write = may_write or (lambda: True)
        if jax.process_count() > 1:
            _barriers_off_gloo()
        _small_arrays_whole()
        self._manager = ocp.CheckpointManager(
            directory, options=ocp.CheckpointManagerOptions(
                max_to_keep=keep, enable_async_checkpointing=True, cleanup_tmp_directories=True, create=True))

    def steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def restore_newest(self, abstract_state: Any) -> tuple[RestoredCheckpoint | None, list[int]]:
        """The newest readable checkpoint, restored onto `abstract_state`'s shardings; and the unreadable ones.

        A checkpoint that cannot be read (cut short, corrupted, of another shape) is
        skipped for the one before it, then moved aside (kept for inspection) so that its
        step can be saved again.
        """
        unreadable: list[int] = []
        found = None
        for step in reversed(_steps_of_process_0(self.steps())):
            out: Any = None
            error: Exception | None = None
            try:
                out = self._manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
            except Exception as e:  # noqa: BLE001 -- whatever makes a checkpoint unreadable: try the one before
                error = e
                self._pass_restore_barrier()
            if not all_hosts(error is None):  # taken only if every host read it: all hosts go on from one step
                log.warning("checkpoint at step %d is unreadable (%s); trying the one before",
                            step, f"{type(error).__name__}: {str(error)[:300]}" if error else "on another host")
                unreadable.append(int(step))
                continue
            assert out is not None  # every host read it, this one too
            found = RestoredCheckpoint(out["state"], dict(out["meta"] or {}), int(step))
            break
        self._set_aside(unreadable)
        return found, unreadable

    def _pass_restore_barrier(self) -> None:
        """A restore that raised on this host skipped the barrier orbax's restore ends with, where the
        other hosts wait (a host-local failure: a read, a missing file); meet them there, under the
        name orbax gives it (its checkpointer's prefix: "" for the async one)."""
        if jax.process_count() > 1:
            from orbax.checkpoint._src.multihost import multihost

            prefix = getattr(getattr(self._manager, "_checkpointer", None), "_barrier_sync_key_prefix", None)
            multihost.sync_global_processes(multihost.unique_barrier_key("Checkpointer:restore", prefix=prefix))

    def _set_aside(self, steps: list[int]) -> None:
        """Move unreadable steps to ``<step>.unreadable-<time>`` (no step name, so orbax ignores them).

        In a bucket the move is a copy of every object and then a delete (no rename there);
        until the delete the step is still there, unreadable, and the next restore moves it again.
        """
        if not steps:
            return
        from jax.experimental import multihost_utils

        if jax.process_index() == 0:
            for step in steps:
                target = storage.join(self.directory, f"{step}.unreadable-{int(time.time())}")
                storage.move_tree(storage.join(self.directory, str(step)), target)
                log.warning("moved unreadable checkpoint %d aside to %s", step, target)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("checkpoints set aside")
        self._manager.reload()

    def save(self, step: int, state: Any, meta: dict) -> bool:
        """Start an async save of `state` after `step` complete steps; False when fenced off."""
        mine = self.may_write()  # reads the fence: on one host a read can fail while the others' succeed
        if not all_hosts(mine):  # orbax's save is collective: every host saves, or none does
            log.warning("not saving step %d: %s", step, "this worker's generation is no longer current" if not mine
                        else "another host may not write (its generation is no longer current, or it cannot read "
                             "the fence)")
            return False
        return self._manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave({**meta, "step": step})), force=True)

    def close(self) -> None:
        """Wait until the last save is committed, then let go of the folder."""
        self._manager.wait_until_finished()
        self._manager.close()
