"""What the controller keeps between reads so that hundreds of drivers do not read and parse the same rows again
and again: the pooled slice events the cost policy reads (`autoscaler._PooledSlices`) and the typed spec of a job
read again unchanged (`Store._parsed_once`). Each must give what a fresh read gives, as the store changes."""

from __future__ import annotations

from orchestrator.control.autoscaler import _pooled, _slice_changes
from orchestrator.domain.shape import Shape
from orchestrator.state.events import SliceChanged
from orchestrator.state.store import Store

SPEC = {"name": "j", "accelerator": "v4-8", "tier": "spot", "workload": {"type": "lm", "steps": 10}}


def _slice(store: Store, job: str, name: str, state: str, at: float, zone: str | None = None) -> None:
    store.put_slice(name, job, "gcp", "v4-8", "spot", state, {"hosts": []},
                    event=SliceChanged(name, "v4-8", 4, "spot", state, 1.0, zone=zone))
    store._conn().execute("UPDATE events SET at=? WHERE seq=(SELECT MAX(seq) FROM events)", (at,))


def _fresh(store: Store, *, since: float, exclude_job: str,
           zone: str = "default") -> list[tuple[float, str, str, str]]:
    return [(at, job, p.name, p.state) for at, job, p in
            _slice_changes(store.slice_events(since=since, exclude_job=exclude_job)) if (p.zone or "default") == zone]


def _kept(store: Store, *, since: float, exclude_job: str, zone: str = "default") -> list[tuple[float, str, str, str]]:
    return [(at, job, p.name, p.state) for at, job, p in
            _pooled(store).others(store, zone=zone, since=since, exclude_job=exclude_job)]


def test_pooled_slice_events_are_what_a_fresh_read_gives_as_events_come(tmp_path):
    store = Store(tmp_path / "state.db")
    for job in ("a", "b", "c"):
        store.create_job(job, job, SPEC)
    _slice(store, "a", "a-1", "REQUESTED", 100.0)
    _slice(store, "b", "b-1", "REQUESTED", 50.0)  # an earlier time written later: ordered by time, not by write
    assert _kept(store, since=0.0, exclude_job="c") == _fresh(store, since=0.0, exclude_job="c")
    _slice(store, "b", "b-1", "WAITING", 120.0)
    _slice(store, "c", "c-1", "REQUESTED", 130.0)
    _slice(store, "a", "a-1", "PROVISIONING", 140.0)
    for since, exclude in ((0.0, "a"), (60.0, "b"), (125.0, "c"), (1000.0, "a")):
        assert _kept(store, since=since, exclude_job=exclude) == _fresh(store, since=since, exclude_job=exclude)
    assert [x[2:] for x in _kept(store, since=0.0, exclude_job="c")] == [
        ("b-1", "REQUESTED"), ("a-1", "REQUESTED"), ("b-1", "WAITING"), ("a-1", "PROVISIONING")]


def test_pooled_slice_events_are_kept_by_zone_and_a_decision_reads_its_zone_s_alone(tmp_path):
    store = Store(tmp_path / "state.db")
    for job in ("a", "b", "c"):
        store.create_job(job, job, SPEC)
    _slice(store, "a", "a-1", "REQUESTED", 100.0, zone="us-central2-b")
    _slice(store, "b", "b-1", "REQUESTED", 90.0, zone="europe-west4-a")
    _slice(store, "c", "c-1", "REQUESTED", 95.0)  # no zone: the "default" zone's
    assert _kept(store, since=0.0, exclude_job="x", zone="us-central2-b") == [(100.0, "a", "a-1", "REQUESTED")]
    _slice(store, "b", "b-2", "REQUESTED", 80.0, zone="us-central2-b")  # earlier, written later
    _slice(store, "a", "a-1", "PROVISIONING", 110.0, zone="us-central2-b")
    for zone in ("us-central2-b", "europe-west4-a", "default", "nowhere"):
        for since, exclude in ((0.0, "x"), (0.0, "a"), (85.0, "b"), (100.0, "c"), (200.0, "a")):
            assert (_kept(store, since=since, exclude_job=exclude, zone=zone)
                    == _fresh(store, since=since, exclude_job=exclude, zone=zone))
    assert [x[2] for x in _kept(store, since=0.0, exclude_job="x", zone="us-central2-b")] == ["b-2", "a-1", "a-1"]


def test_a_job_read_again_keeps_its_parsed_spec_only_while_the_stored_spec_is_the_same(tmp_path):
    store = Store(tmp_path / "state.db")
    store.create_job("a", "a", SPEC)
    first = store.job("a").spec
    again = store.job("a").spec
    assert again is first  # the same text: parsed once
    assert store.job("a").stored_spec is store.job("a").stored_spec  # its JSON too
    store.place("a", Shape("v4-16", "on-demand", 1))
    moved = store.job("a").spec
    assert (moved.accelerator, moved.tier.value) == ("v4-16", "on-demand")
    fresh = Store(tmp_path / "state.db").job("a")
    assert store.job("a").stored_shape == ["v4-16", "on-demand", 1] == fresh.stored_shape
    assert store.job("a").spec is moved and Store(tmp_path / "state.db").job("a").spec == moved
