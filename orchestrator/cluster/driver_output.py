"""What Ray prints in a driver's terminal goes to the state directory's logs instead.

A Python API user's terminal is theirs: Ray's driver prints the cluster's error messages
there ("(raylet) The node with node id ... has been marked dead", printed by a thread
of its own whatever `log_to_driver` says) and its logger's warnings reach stderr through
Python's last-resort handler when the program configured no logging. The orchestrator
says what happened to the job itself (events, `status`, the progress line), so both go to
``$ORCHESTRATOR_HOME/logs/driver.log``.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from orchestrator.cluster.home import Home

_MESSAGES = logging.getLogger("ray.driver_messages")  # a child of "ray": written where Ray's own log goes


def keep_ray_quiet(home: Home) -> Path:
    """Send Ray's driver-side messages and log records to `home`'s logs/driver.log (idempotent); returns its path.

    Call it before `ray.init` and again after it: connecting sets Ray's logging up anew.
    """
    import ray._private.worker as ray_worker

    path = home.root / "logs" / "driver.log"
    ray_logger = logging.getLogger("ray")
    if not any(getattr(h, "_orchestrator_driver_log", None) == str(path) for h in ray_logger.handlers):
        for h in [h for h in ray_logger.handlers if getattr(h, "_orchestrator_driver_log", None)]:
            ray_logger.removeHandler(h)  # another state directory's, earlier in this process
            h.close()
        path.parent.mkdir(parents=True, exist_ok=True)
        handler = _DriverLog(path)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        for h in [h for h in ray_logger.handlers
                  if isinstance(h, logging.StreamHandler) and getattr(h, "stream", None) in (sys.stderr, sys.stdout)]:
            ray_logger.removeHandler(h)  # the stderr handler Ray adds when imported
        ray_logger.addHandler(handler)
        ray_logger.propagate = False  # not to the program's root handlers, nor to the last-resort stderr one
    if not getattr(ray_worker.print_to_stdstream, "_orchestrator", False):
        ray_worker.print_to_stdstream = _to_log
    return path


def _to_log(data: dict, ignore_prefix: bool = False) -> None:
    """Ray's `print_to_stdstream`, into the log: each line with the process it came from."""
    for line in data.get("lines") or []:  # at WARNING: `ray.init(logging_level=WARNING)` drops anything less
        _MESSAGES.warning("(%s) %s", data.get("pid", "?"), line)


setattr(_to_log, "_orchestrator", True)  # noqa: B010 -- mypy refuses a function attribute written plainly


class _DriverLog(logging.FileHandler):
    """The driver log's handler; `_orchestrator_driver_log` names its file (a later call finds it by that)."""

    def __init__(self, path: Path):
        super().__init__(path, delay=True)
        self._orchestrator_driver_log = str(path)
