"""A slice's readings are judged in the order their data was read, not the order they came back: a zone listing
begun before the slice's last reading (a GET that saw its node READY, or a newer listing) is not used for it (nor
is it asked for by name: the next listing will do), and a READY slice is not read as lost from such a listing's
older view (at N=1,000, 18 jobs launched on slices the store had called GONE that way, and their queued resources
were left in the API). A slice made after a listing began waits for the next listing; one missing from a listing
begun after its create is gone."""

from __future__ import annotations

import time

from google.cloud import tpu_v2

from orchestrator import catalog
from orchestrator.providers.base import Host, Slice, SliceRequest
from orchestrator.providers.gcp import GcpTpuProvider
from orchestrator.providers.gcp.api import QRS
from orchestrator.providers.gcp.looks import ZoneListing
from orchestrator.providers.startup import WorkerSetup
from orchestrator.state.states import SliceState

ZONE, NAME = "us-central2-b", "j-1"
NODE = f"projects/p/locations/{ZONE}/nodes/{NAME}"


def _qr(state=QRS.ACTIVE) -> tpu_v2.QueuedResource:
    return tpu_v2.QueuedResource(name=f"projects/p/locations/{ZONE}/queuedResources/{NAME}",
                                 state=tpu_v2.QueuedResourceState(state=state))


def _node(state) -> tpu_v2.Node:
    return tpu_v2.Node(state=state, network_endpoints=[tpu_v2.NetworkEndpoint(ip_address="10.0.0.1")])


class _Api:
    """The TPU API as the provider's looks ask it: the slice's queued resource and node by name (the node READY)."""

    def __init__(self):
        self.gets: list[str] = []
        self.created: list[str] = []

    def parent(self, zone: str) -> str:
        return f"projects/p/locations/{zone}"

    def create_queued_resource(self, zone: str, name: str, qr) -> None:
        self.created.append(name)

    def full_name(self, zone: str, kind: str, name: str) -> str:
        return f"projects/p/locations/{zone}/{'queuedResources' if kind == 'qr' else 'nodes'}/{name}"

    def get(self, zone: str, kind: str, name: str):
        self.gets.append(kind)
        return _qr() if kind == "qr" else _node(tpu_v2.Node.State.READY)


class _Listings:
    """The zone's listing a look is handed (whatever `listing` is set to)."""

    listing: ZoneListing | None = None

    def get(self, zone: str, *, followed) -> ZoneListing | None:
        return self.listing


def _provider() -> tuple[GcpTpuProvider, _Api, _Listings]:
    provider = GcpTpuProvider("p", [ZONE], endpoint="http://127.0.0.1:9")
    api, listings = _Api(), _Listings()
    provider._api, provider._listings = api, listings  # type: ignore[assignment]
    t = catalog.lookup("v4-16")
    provider.adopt(Slice(NAME, "j", t, catalog.Tier.SPOT, ZONE, SliceState.READY,
                         (Host(0, "h0", address="10.0.0.1"), Host(1, "h1", address="10.0.0.2")), "gcp"), ZONE)
    return provider, api, listings


def _listing(at: float, node_state) -> ZoneListing:
    return ZoneListing(at, {NAME: _qr()}, {NODE: _node(node_state)}, fresh_for=1e9)


def test_a_listing_begun_before_a_get_that_saw_the_node_ready_is_not_read_for_that_slice():
    provider, api, listings = _provider()
    assert provider.poll_events(slices=[NAME]) == [] and api.gets == ["qr", "node"]  # no listing: by name
    listings.listing = _listing(time.monotonic() - 2.0, tpu_v2.Node.State.CREATING)  # begun before that GET
    assert provider.poll_events(slices=[NAME]) == []
    assert api.gets == ["qr", "node"]  # not read from the older listing, nor asked by name: the next listing will
    assert provider.get(NAME).state is SliceState.READY


def test_an_older_listing_after_a_newer_one_is_not_read_and_a_newer_one_is():
    provider, api, listings = _provider()
    newer = time.monotonic()
    listings.listing = _listing(newer, tpu_v2.Node.State.READY)
    assert provider.poll_events(slices=[NAME]) == [] and api.gets == []  # read from the listing
    listings.listing = _listing(newer - 1.0, tpu_v2.Node.State.CREATING)  # the one before it, handed out late
    assert provider.poll_events(slices=[NAME]) == [] and api.gets == []
    assert provider.get(NAME).state is SliceState.READY
    listings.listing = _listing(time.monotonic(), tpu_v2.Node.State.CREATING)  # a newer one that says so: believed
    events = provider.poll_events(slices=[NAME])
    assert [e.kind.value for e in events] == ["host_lost"] and provider.get(NAME).state is SliceState.GONE


def _requested() -> tuple[GcpTpuProvider, _Api, _Listings, float]:
    """A provider that has just asked for slice NAME, and when (monotonic) it began asking."""
    provider = GcpTpuProvider("p", [ZONE], endpoint="http://127.0.0.1:9", worker_setup=WorkerSetup("10.0.0.9:6379"))
    api, listings = _Api(), _Listings()
    provider._api, provider._listings = api, listings  # type: ignore[assignment]
    before = time.monotonic()
    provider.request(SliceRequest("j", NAME, catalog.lookup("v4-16"), catalog.Tier.SPOT, zone=ZONE))
    assert api.created == [NAME]
    return provider, api, listings, before


def test_a_slice_made_after_the_listing_began_waits_for_the_next_one_and_is_not_asked_for_by_name():
    provider, api, listings, before = _requested()
    listings.listing = ZoneListing(before - 0.5, {}, {}, fresh_for=1e9)  # begun before the create
    assert provider.check(NAME).state is SliceState.REQUESTED  # not in it, and not gone
    listings.listing = ZoneListing(time.monotonic(), {NAME: _qr(QRS.WAITING_FOR_RESOURCES)}, {}, fresh_for=1e9)
    assert provider.check(NAME).state is SliceState.WAITING
    assert api.gets == []


def test_a_slice_missing_from_a_listing_begun_after_its_create_is_gone_as_a_404_says():
    provider, api, listings, _ = _requested()
    listings.listing = ZoneListing(time.monotonic(), {NAME: _qr(QRS.WAITING_FOR_RESOURCES)}, {}, fresh_for=1e9)
    assert provider.check(NAME).state is SliceState.WAITING
    listings.listing = ZoneListing(time.monotonic(), {}, {}, fresh_for=1e9)  # deleted by someone else
    assert provider.check(NAME).state is SliceState.GONE
    assert api.gets == []
