"""Running the emulator inside tests: a context manager and a pytest fixture factory.

    from orchestrator.emulator.fixture import emulator_fixture
    emulator = emulator_fixture(time_scale=0.005)      # in a test module or conftest

    def test_x(emulator):
        client = emulator.client()

Both stop the server and its threads on exit and fail loudly if a thread survives,
so a test can never leave an emulator running behind it.
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


def emulator_fixture(name: str = "emulator", **kwargs: Any) -> Any:
    """A pytest fixture (function scope) that yields a running `Emulator`."""
    import pytest

    @pytest.fixture(name=name)
    def _emulator() -> Iterator[Emulator]:
        with running_emulator(**kwargs) as emu:
            yield emu

    return _emulator
