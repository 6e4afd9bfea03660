"""A pytest fixture factory that runs the TPU API emulator for one test.

    from tests.emulator_fixture import emulator_fixture
    emulator = emulator_fixture(time_scale=0.005)      # in a test module or conftest

    def test_x(emulator):
        client = emulator.client()

The fixture stops the server and its threads on teardown and fails loudly if a thread
survives (`orchestrator.emulator.running_emulator`), so a test can never leave an
emulator running behind it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from orchestrator.emulator import Emulator, running_emulator


def emulator_fixture(name: str = "emulator", **kwargs: Any) -> Any:
    """A pytest fixture (function scope) that yields a running `Emulator`; kwargs go to `serve`."""

    @pytest.fixture(name=name)
    def _emulator() -> Iterator[Emulator]:
        with running_emulator(**kwargs) as emu:
            yield emu

    return _emulator
