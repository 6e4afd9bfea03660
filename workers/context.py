"""The older name of what a user entrypoint receives: `WorkerContext` is now `workers.api.Context`.

Programs written for the 7-field context (rank, num_hosts, args, checkpoint_dir,
stop_requested, may_write, report) keep working unchanged: those fields are all on
`workers.api.Context`, which adds the mesh, `restore_or_init`, the step loop and the
dataset. To migrate, import `from workers import api` and let `ctx.loop` save, stop and
report instead of doing it by hand (see `examples/user-train/train.py`).
"""

from workers.api import Context as WorkerContext

__all__ = ["WorkerContext"]
