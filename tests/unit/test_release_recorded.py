"""A slice known only from the store (an earlier controller's) and released by a later one ends its billing then.

Its record goes RELEASED with a slice event, as a provider's own release writes: the bill and the capacity
memory read the events, so a record moved without one stayed billed until the job's end (or until now).
"""

from __future__ import annotations

from orchestrator.catalog import lookup
from orchestrator.cluster import Home
from orchestrator.observe.billing import billed_slices
from orchestrator.providers.local import release_recorded
from orchestrator.state.events import EventKind, SliceChanged
from orchestrator.state.store import Store


def held_slice(store: Store, name: str, job: str) -> None:
    price = lookup("v4-16").usd_per_hour("spot")
    for state in ("REQUESTED", "PROVISIONING", "READY"):
        store.put_slice(name, job, "local", "v4-16", "spot", state, {"pgids": [], "zone": "local"},
                        event=SliceChanged(name, "v4-16", 8, "spot", state, price, "local"))


def test_a_recorded_slice_released_by_a_later_controller_ends_its_billing(tmp_path):
    home = Home(tmp_path / "home").ensure()
    store = Store(home.db)
    store.create_job("run-0a0b0c", "run", {"name": "run", "accelerator": "v4-16", "tier": "spot",
                                          "workload": {"type": "lm", "steps": 100}})
    held_slice(store, "run-0a0b0c-1", "run-0a0b0c")
    [rec] = store.slices(job_id="run-0a0b0c")

    assert release_recorded(home, store, rec) == []

    [after] = store.slices(job_id="run-0a0b0c")
    assert after.state.value == "RELEASED"
    last = store.events("run-0a0b0c", kind=EventKind.SLICE)[-1]
    released = last.payload_as(SliceChanged)
    assert (released.name, released.state, released.chips, released.zone) == ("run-0a0b0c-1", "RELEASED", 8, "local")
    assert "earlier controller" in last.reason
    [bill] = billed_slices(store.events("run-0a0b0c"), end=last.at + 3600.0)
    assert bill.end == last.at  # not the hour after: billing ended at the release

    # Released again (a second restart finds the same record): no second event.
    release_recorded(home, store, after)
    assert len(store.events("run-0a0b0c", kind=EventKind.SLICE)) == 4
