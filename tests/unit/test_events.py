"""Typed events and the slice lifecycle the store enforces."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from orchestrator.errors import IllegalTransitionError
from orchestrator.state import events as ev
from orchestrator.state.events import EventKind
from orchestrator.state.states import SliceState
from orchestrator.state.store import Store
from tests.conftest import REPO

EXAMPLES = [
    ev.StateChange(outcome="preempted"), ev.SliceChanged("s1", "v4-16", 8, "spot", "READY", 7.36),
    ev.Launched("s1", ["n1", "n2"], [11, 12], 3), ev.Restored(1.5, 0.4, 8, [12]), ev.LostWork(2, 3.1, 10, 8),
    ev.CheckpointSaved(8, 0.5), ev.NoticeSeen(1, 9), ev.Disrupted("preempted", 9, "reclaimed", 3, 0.7),
    ev.Resumed(12.5, 10), ev.Adopted(), ev.Autoscaled("v4-32", "spot", 12.0, "cheapest", 40),
    ev.Profiled("20261125-120000-ab12", "/ckpt/profiles/20261125-120000-ab12", [0, 1], 12, 3, 3,
                {"0": {"bytes_in_use": 1024}}),
    ev.DeadlineForecast(240.0, 3840.0, 3600.0, 900, 0.4),
    ev.FolderClaimed("/ckpt", "resume-anyway", 300, "lm-3f2a1c", [["workload.seed", 0, 1]], None),
    ev.StoreFaulted("disk full", 12.5, "state store not writable: disk full (/h/state.db: database or disk is full)"),
    ev.MemoryCadence(2, 0.012, 0.4), ev.AheadCompiled(1, 6.2, True, 0), ev.Restored(0.2, 1.1, 40, [], "memory", None),
    ev.ProgramStored("v4:2x2x2/2h/1s", True, None, 42.5, 25_000_000),
    ev.ProgramStored("cpu:4/1h/2s", False, 0, reason="none stored for this program on cpu:4/1h/2s"),
    ev.Planned(3, "v4-16", "spot", 2, [4, 2, 1], 2, 50, None, 8, None),
    ev.ResizeAsked("v4-16", "v4-32", "spot", "more chips", 10),
]


def test_every_kind_has_a_record_and_each_reads_back_as_written(tmp_path):
    assert {type(p).KIND for p in EXAMPLES} == set(EventKind)
    store = Store(tmp_path / "s.db")
    store.create_job("j", "j", {})
    for p in EXAMPLES:
        store.add_event("j", p, f"a {p.KIND.value}")
    back = [e for e in store.events("j") if e.reason.startswith("a ")]
    assert [e.payload for e in back] == EXAMPLES
    assert [e.kind for e in back] == [p.KIND for p in EXAMPLES]
    assert back[-1].data["from"] == "v4-16"  # the stored JSON keeps its keys
    assert [e.kind for e in store.events("j", kind=EventKind.LAUNCHED)] == [EventKind.LAUNCHED]
    assert [e.payload.source for e in store.events("j", kind=EventKind.RESTORE)] == ["storage", "memory"]


def test_a_row_of_an_older_version_reads_back_with_what_it_has(tmp_path):
    store = Store(tmp_path / "s.db")
    store.create_job("j", "j", {})
    store.import_event("j", "slice", "old", {"name": "s1", "state": "READY", "retired": 1})
    (e,) = store.events("j", kind=EventKind.SLICE)
    assert e.payload == ev.SliceChanged(name="s1", state="READY")
    with pytest.raises(ValueError):
        store.import_event("j", "no-such-kind", "x")


def _slice(store: Store, state: str, **kw) -> None:
    store.put_slice("s1", "j", "local", "v4-8", "spot", state, {"pgids": []}, **kw)


def test_the_store_enforces_the_slice_lifecycle_row_and_event_together(tmp_path):
    store = Store(tmp_path / "s.db")
    store.create_job("j", "j", {})
    with pytest.raises(IllegalTransitionError, match="slice s1: cannot go from \\(new\\) to READY"):
        _slice(store, "READY")  # a slice starts REQUESTED
    event = ev.SliceChanged("s1", "v4-8", 4, "spot", "REQUESTED", 1.0)
    _slice(store, "REQUESTED", event=event)
    _slice(store, "PROVISIONING", event=dataclasses.replace(event, state="PROVISIONING"))
    _slice(store, "PROVISIONING")  # the same state again: data only
    with pytest.raises(IllegalTransitionError, match="from PROVISIONING to WAITING"):
        _slice(store, "WAITING", event=dataclasses.replace(event, state="WAITING"))
    assert [s.state for s in store.slices()] == [SliceState.PROVISIONING]  # refused: the row is as it was...
    assert [e.payload.state for e in store.events("j", kind=EventKind.SLICE)] == ["REQUESTED", "PROVISIONING"]
    _slice(store, "RELEASED")  # ...and nothing of the refused move was written
    with pytest.raises(IllegalTransitionError):
        _slice(store, "READY")  # released is final


def _string_event_kinds(path: Path) -> list[str]:
    """Comparisons of an event's `.kind` with a string, and add_event/import_event given a string kind."""
    kinds = {k.value for k in EventKind}
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(isinstance(s, ast.Attribute) and s.attr == "kind" for s in sides) and any(
                    isinstance(s, ast.Constant) and s.value in kinds for s in sides):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}")
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_event" and len(node.args) > 1 \
                and isinstance(node.args[1], ast.Constant):
            found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    return found


def test_no_string_event_kinds_outside_the_event_module():
    files = [f for pkg in ("orchestrator", "policies", "workers") for f in (REPO / pkg).rglob("*.py")
             if f != REPO / "orchestrator" / "state" / "events.py"]
    assert len(files) > 30
    assert [x for f in files for x in _string_event_kinds(f)] == []
