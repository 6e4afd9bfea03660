"""Running the emulator for the duration of a block (tests, benchmarks, scripts).

    from orchestrator.emulator import running_emulator

    with running_emulator(time_scale=0.005) as emu:
        client = emu.client()

On exit it stops the server and its threads and fails loudly if a thread survives, so
a caller can never leave an emulator running behind it. The pytest fixture built on it
lives with the tests (`tests/emulator_fixture.py`): nothing here needs pytest.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from orchestrator.emulator.server import Emulator, serve

_THREAD_PREFIX = "tpu-emulator"


@contextlib.contextmanager
def running_emulator(**kwargs: Any) -> Iterator[Emulator]:
    """`serve(**kwargs)` for the duration of the block."""
    emu = serve(**kwargs)
    try:
        yield emu
    finally:
        emu.stop()
        left = [t.name for t in threading.enumerate() if t.name.startswith(_THREAD_PREFIX)]
        if left:
            raise RuntimeError(f"emulator threads still running after stop: {left}")
