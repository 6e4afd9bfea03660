"""The emulator's control API as one table (`orchestrator.emulator.routes._CONTROL_OPERATIONS`): each call of the
Python control client reaches the emulator method of the same name with the arguments it was given, through the
JSON the client sends, and the table has no operation the client cannot ask for."""

from __future__ import annotations

import json
from typing import Any

import pytest

from orchestrator.emulator.control import ControlClient
from orchestrator.emulator.routes import _CONTROL_OPERATIONS


class _Recording:
    """An emulator that records what it is asked and answers as the real one's types do."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def __getattr__(self, name: str) -> Any:
        def method(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, args, kwargs))
            return [0, 2] if name == "notice" else f"{name}-answer" if name in ANSWERS_A_NAME else None
        return method


ANSWERS_A_NAME = {"reclaim", "terminate", "power_off"}

CALLS = [  # (the client's method, its arguments, what the emulator is asked: method, args, kwargs)
    ("fail", ("nodes.get", "permission"), {"count": 3, "zone": "us-central2-b"},
     ("fail", ("nodes.get", "permission"), {"count": 3, "zone": "us-central2-b"})),
    ("random_errors", (0.25,), {"codes": (503,), "seed": 7, "methods": ("nodes.get",)},
     ("random_errors", (0.25,), {"codes": (503,), "seed": 7, "methods": ("nodes.get",)})),
    ("random_errors", (0.5,), {}, ("random_errors", (0.5,), {"codes": (503, 429), "seed": None, "methods": None})),
    ("stockout", ("us-central2-b",), {"accelerator_type": "v4-16", "mode": "fail"},
     ("stockout", ("us-central2-b",), {"accelerator_type": "v4-16", "mode": "fail"})),
    ("clear_stockout", (), {}, ("clear_stockout", (None,), {})),
    ("clear_faults", (), {}, ("clear_faults", (), {})),
    ("reclaim", ("q1",), {}, ("reclaim", ("q1",), {})),
    ("terminate", ("q1",), {}, ("terminate", ("q1",), {})),
    ("power_off", ("q1",), {"host": 1}, ("power_off", ("q1",), {"host": 1, "silent": False})),
    ("power_off", ("q1",), {"host": 1, "silent": True}, ("power_off", ("q1",), {"host": 1, "silent": True})),
    ("notice", ("q1",), {"event": "maintenance"}, ("notice", ("q1",), {"host": None, "event": "maintenance"})),
]


def _client_against(emulator: _Recording, sent: list[str]) -> ControlClient:
    client = ControlClient("http://127.0.0.1:1", token="t")

    def call(verb: str, what: str, args: dict[str, Any] | None) -> dict[str, Any]:
        assert verb == "POST"
        sent.append(what)
        answer = _CONTROL_OPERATIONS[what](emulator, json.loads(json.dumps(args)))  # the JSON the wire carries
        return {} if answer is None else answer

    client._call = call
    return client


@pytest.mark.parametrize("method, args, kwargs, asked", CALLS, ids=[f"{c[0]}-{i}" for i, c in enumerate(CALLS)])
def test_each_client_call_reaches_the_emulator_method_with_its_arguments(method, args, kwargs, asked):
    emulator, sent = _Recording(), []
    answer = getattr(_client_against(emulator, sent), method)(*args, **kwargs)
    assert emulator.calls == [asked]
    if method in ANSWERS_A_NAME:
        assert answer == f"{method}-answer"
    elif method == "notice":
        assert answer == [0, 2]


def test_the_table_has_no_operation_the_client_cannot_ask_for():
    sent: list[str] = []
    client = _client_against(_Recording(), sent)
    for method, args, kwargs, _ in CALLS:
        getattr(client, method)(*args, **kwargs)
    assert set(sent) == set(_CONTROL_OPERATIONS)
