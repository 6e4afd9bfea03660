"""Where a running `orchestrator emulator --vms` is: $ORCHESTRATOR_HOME/emulator.json, written by
`cloud.LocalCloud` (mode 600: it holds the control token), read by the subcommands that act on it.

Light on purpose: `orchestrator emulator reclaim` and its kin import this and the control client only.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

from orchestrator.cluster.home import Home
from orchestrator.emulator.control import ControlClient

log = logging.getLogger(__name__)

RUN_FILE = "emulator.json"


@dataclass(frozen=True)
class Running:
    """Where a running `orchestrator emulator --vms` is: what `home`/emulator.json records."""

    pid: int
    url: str  # the TPU API (and its control API under /_emulator/)
    control_token: str
    storage_url: str
    project: str
    zone: str
    bucket: str

    def control(self) -> ControlClient:
        return ControlClient(self.url, token=self.control_token)


def find_running(home: Home) -> Running | None:
    """The emulator `home`/emulator.json names, if its process still runs; a stale file is removed."""
    path = home.root / RUN_FILE
    try:
        running = Running(**json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (ValueError, TypeError) as e:
        log.warning("%s is unreadable (%s); removed", path, e)
        path.unlink(missing_ok=True)
        return None
    if not _alive(running.pid):
        path.unlink(missing_ok=True)
        return None
    return running


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: it runs
        return True
    return True
