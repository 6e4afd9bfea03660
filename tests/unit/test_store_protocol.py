"""The store's interface (`orchestrator.state.protocol`) against its two implementations: every public method
of the SQLite store is a read or a write of the Protocol, and the driver's `HoldingStore` holds every write
(it waits out a refusing store, after the writes held before it) and passes every read straight through."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from orchestrator.control.store_faults import HeldWrites, HoldingStore, StoreHealth
from orchestrator.errors import StoreFaultError
from orchestrator.state.protocol import READS, WRITES, JobStore
from orchestrator.state.store import Store
from tests.waiting import wait_for


def _public_methods(cls: type) -> set[str]:
    return {name for name, value in vars(cls).items() if callable(value) and not name.startswith("_")}


def test_every_public_method_of_the_store_is_a_read_or_a_write_of_the_protocol():
    assert READS and WRITES and not READS & WRITES
    # `batch` is how the controller's writer thread writes (`HeldWrites`), not a read or a write of its own.
    assert _public_methods(Store) == READS | WRITES | {"batch"}, \
        "a Store method the Protocol does not name (or the reverse)"


def test_the_holding_store_writes_out_every_member_and_forwards_nothing_by_name():
    assert READS | WRITES <= _public_methods(HoldingStore)
    assert not hasattr(HoldingStore, "__getattr__")


def _parameters(cls: type, name: str) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(getattr(cls, name)).parameters.values()]


@pytest.mark.parametrize("name", sorted(READS | WRITES))
def test_the_store_the_protocol_and_the_holding_store_take_the_same_parameters(name):
    # A parameter the Store takes and the Protocol lacks is one the HoldingStore would not pass on.
    assert _parameters(JobStore, name) == _parameters(Store, name) == _parameters(HoldingStore, name)


class _Refusing:
    """A store whose every method refuses its first call (`StoreFaultError`) and records the calls it takes."""

    def __init__(self) -> None:
        self.taken: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self.tries: dict[str, int] = {}

    def __getattr__(self, name: str) -> Any:
        def method(*args: Any, **kwargs: Any) -> str:
            self.tries[name] = self.tries.get(name, 0) + 1
            if self.tries[name] == 1:
                raise StoreFaultError("state.db", "disk full", "no space left on device")
            self.taken.append((name, args, kwargs))
            return f"{name} done"
        return method


def _answer(name: str) -> str | None:
    """What `_Refusing` answers, passed back by a method that returns something (annotations are strings here)."""
    return None if inspect.signature(getattr(JobStore, name)).return_annotation == "None" else f"{name} done"


def _arguments(name: str) -> tuple[tuple[object, ...], dict[str, object]]:
    """One distinct object for each parameter of the Protocol's method (defaults too), as a caller passes it."""
    args: list[object] = []
    kwargs: dict[str, object] = {}
    for p in list(inspect.signature(getattr(JobStore, name)).parameters.values())[1:]:
        if p.kind is p.POSITIONAL_OR_KEYWORD:
            args.append(object())
        elif p.kind is p.KEYWORD_ONLY:
            kwargs[p.name] = object()
    return tuple(args), kwargs


@pytest.mark.parametrize("name", sorted(WRITES))
def test_every_write_is_held_until_the_store_takes_it_after_the_writes_held_before_it(name):
    raw = _Refusing()
    health = StoreHealth()
    refused: list[tuple[str, StoreFaultError]] = []
    tell = health.failed
    health.failed = lambda e: (refused.append((sorted(raw.tries)[-1], e)), tell(e))
    held = HeldWrites(health, first_wait_s=0.5)
    held.add(lambda: raw.report("a worker's report"))  # refused once: held
    wait_for(lambda: refused, 10, "the report refused", poll_s=0.01)
    assert health.held == 1 and health.fault is not None
    store = HoldingStore(raw, health, held)
    args, kwargs = _arguments(name)

    assert getattr(store, name)(*args, **kwargs) == _answer(name)  # asked while the report waits its retry

    assert [t[0] for t in raw.taken] == ["report", name]  # the held report first, then this write
    assert raw.taken[1][1:] == (args, kwargs)  # each argument passed on as given
    assert raw.tries == {"report": 2, name: 2}  # each refused, then tried again
    assert len(refused) == 2  # each refusal was told to the store's health, which knows it ended
    assert health.fault is None and health.held == 0


@pytest.mark.parametrize("name", sorted(READS))
def test_every_read_is_answered_at_once_even_by_a_refusing_store(name):
    raw = _Refusing()
    health = StoreHealth()
    store = HoldingStore(raw, health, HeldWrites(health))
    args, kwargs = _arguments(name)
    with pytest.raises(StoreFaultError):
        getattr(store, name)(*args, **kwargs)
    assert raw.tries == {name: 1}  # not tried again: a read does not wait
    assert getattr(store, name)(*args, **kwargs) == _answer(name)
    assert raw.taken == [(name, args, kwargs)]
