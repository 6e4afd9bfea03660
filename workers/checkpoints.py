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

A step is committed when orbax says so: locally its folder is renamed from a temporary
name at the end of the save; in a bucket, where there is no rename, the step's folder gets
a ``commit_success.txt`` last. Either way a save cut short is no step (`steps` and
`restore_newest` never see it) and the next manager on process 0 removes what it left.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import orbax.checkpoint as ocp

from workers import storage

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Restored:
    """What `Checkpoints.restore_newest` found."""

    state: Any
    meta: dict
    step: int


class Checkpoints:
    def __init__(self, directory: str, *, keep: int = 3, may_write: Callable[[], bool] | None = None):
        self.directory = directory
        self.may_write = may_write or (lambda: True)
        self._manager = ocp.CheckpointManager(
            directory, options=ocp.CheckpointManagerOptions(
                max_to_keep=keep, enable_async_checkpointing=True, cleanup_tmp_directories=True, create=True))

    def steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def restore_newest(self, abstract_state: Any) -> tuple[Restored | None, list[int]]:
        """The newest readable checkpoint, restored onto `abstract_state`'s shardings; and the unreadable ones.

        A checkpoint that cannot be read (cut short, corrupted, of another shape) is
        skipped for the one before it, then moved aside (kept for inspection) so that its
        step can be saved again.
        """
        unreadable: list[int] = []
        found = None
        for step in reversed(self.steps()):
            try:
                out = self._manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
            except Exception as e:  # an unreadable checkpoint: try the one before
                log.warning("checkpoint at step %d is unreadable (%s: %s); trying the one before",
                            step, type(e).__name__, str(e)[:300])
                unreadable.append(int(step))
                continue
            found = Restored(out["state"], dict(out["meta"] or {}), int(step))
            break
        self._set_aside(unreadable)
        return found, unreadable

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
        if not self.may_write():
            log.warning("not saving step %d: this worker's generation is no longer current", step)
            return False
        return self._manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave({**meta, "step": step})), force=True)

    def close(self) -> None:
        """Wait until the last save is committed, then let go of the folder."""
        self._manager.wait_until_finished()
        self._manager.close()
