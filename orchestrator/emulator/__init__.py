"""A local emulator of the Cloud TPU API v2 (queued resources, nodes, operations).

It serves the REST paths that ``google.cloud.tpu_v2.TpuClient(transport="rest")``
calls, on 127.0.0.1 only, with the real service's state machines at a scaled-down
pace, and a control API to inject stockouts, reclaims and errors. See `server` for the
handle, `routes` for the paths, `machines` for the lifecycles.
"""

from orchestrator.emulator.control import ControlClient, ControlError
from orchestrator.emulator.fixture import running_emulator
from orchestrator.emulator.machines import Timings
from orchestrator.emulator.routes import RequestRecord
from orchestrator.emulator.server import DEFAULT_TIME_SCALE, Emulator, EmulatorConfig, serve
from orchestrator.emulator.world import Hooks

__all__ = [
    "DEFAULT_TIME_SCALE",
    "ControlClient",
    "ControlError",
    "Emulator",
    "EmulatorConfig",
    "Hooks",
    "RequestRecord",
    "Timings",
    "running_emulator",
    "serve",
]
