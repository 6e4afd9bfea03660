"""A local emulator of the Cloud TPU API v2 (queued resources, nodes, operations).

It serves the REST paths that ``google.cloud.tpu_v2.TpuClient(transport="rest")``
calls, on 127.0.0.1 only, with the real service's state machines at a scaled-down
pace, and a control API to inject stockouts, reclaims and errors. See `server` for the
handle, `routes` for the paths, `machines` for the lifecycles, `cloud` for the whole GCP
world (`orchestrator emulator --vms`) and `cli` for its command.

The names below load on first use: `orchestrator emulator reclaim` and its kin need only
the control client, not the TPU client library the server is built on.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from orchestrator.emulator.control import ControlClient, ControlError
    from orchestrator.emulator.fixture import running_emulator
    from orchestrator.emulator.machines import MachineTimings
    from orchestrator.emulator.routes import RequestRecord
    from orchestrator.emulator.server import DEFAULT_TIME_SCALE, Emulator, EmulatorConfig, serve
    from orchestrator.emulator.world import Hooks

_WHERE = {
    "DEFAULT_TIME_SCALE": "server",
    "ControlClient": "control",
    "ControlError": "control",
    "Emulator": "server",
    "EmulatorConfig": "server",
    "Hooks": "world",
    "RequestRecord": "routes",
    "MachineTimings": "machines",
    "running_emulator": "fixture",
    "serve": "server",
}

__all__ = [
    "DEFAULT_TIME_SCALE",
    "ControlClient",
    "ControlError",
    "Emulator",
    "EmulatorConfig",
    "Hooks",
    "RequestRecord",
    "MachineTimings",
    "running_emulator",
    "serve",
]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
