"""A zone's listing is read once per queued resource: every driver's look at its slice while one listing is fresh
gets what the first look read from the listed messages, unless that look had to ask for the node by name."""

from __future__ import annotations

from google.cloud import tpu_v2

from orchestrator.providers.gcp.api import QRS
from orchestrator.providers.gcp.looks import ZoneListing, ZoneListings

NODE = "projects/p/locations/z/nodes/"


def _qr(state) -> tpu_v2.QueuedResource:
    return tpu_v2.QueuedResource(state=tpu_v2.QueuedResourceState(state=state))


def _node(ip: str) -> tpu_v2.Node:
    return tpu_v2.Node(state=tpu_v2.Node.State.READY,
                       network_endpoints=[tpu_v2.NetworkEndpoint(ip_address=ip)])


def test_a_listed_slice_is_read_from_the_listing_once_and_the_same_look_is_given_again():
    listing = ZoneListing(0.0, {"a": _qr(QRS.ACTIVE), "w": _qr(QRS.WAITING_FOR_RESOURCES)},
                          {NODE + "a": _node("10.0.0.1")}, fresh_for=2.0)
    asked: list[str] = []
    first = listing.seen("a", NODE + "a", lambda: asked.append("a"))
    assert (first.qr, first.node, first.addresses) == ("ACTIVE", "READY", ("10.0.0.1",))
    listing.qrs["a"].state.state = QRS.FAILED  # were it read again, this would show
    assert listing.seen("a", NODE + "a", lambda: asked.append("a")) is first
    waiting = listing.seen("w", NODE + "w", lambda: asked.append("w"))
    assert (waiting.qr, waiting.node) == ("WAITING_FOR_RESOURCES", None)  # no node in that state: none asked for
    assert listing.seen("gone", NODE + "gone", lambda: asked.append("gone")) is None  # not listed: `look` decides
    assert asked == []


def test_a_node_made_after_the_listing_is_asked_for_by_name_on_every_look():
    listing = ZoneListing(0.0, {"a": _qr(QRS.ACTIVE)}, {}, fresh_for=2.0)
    answers = iter([None, _node("10.0.0.2")])
    asked = 0

    def get_node():
        nonlocal asked
        asked += 1
        return next(answers)

    assert listing.seen("a", NODE + "a", get_node).node is None  # not made yet
    again = listing.seen("a", NODE + "a", get_node)
    assert (again.node, again.addresses, asked) == ("READY", ("10.0.0.2",), 2)  # asked again, not kept


class _Zone:
    """What `ZoneListings` asks of the API: one listing of a zone (queued resources, nodes by full name)."""

    def __init__(self):
        self.listed = 0

    def list_zone(self, zone, *, states_only=False):
        self.listed += 1
        return [tpu_v2.QueuedResource(name=f"projects/p/locations/{zone}/queuedResources/a")], {}


def test_the_slices_followed_are_counted_once_a_second_not_once_a_look():
    api, counted = _Zone(), []

    def followed() -> int:
        counted.append(1)
        return 20

    listings = ZoneListings(api, "p", list_over=8, list_s=1.0)
    for _ in range(50):  # every look of a moment, the listing fresh or not
        listing = listings.get("z", followed=followed)
        listings._latest.pop("z")  # as if stale again at once
    assert listing is not None and set(listing.qrs) == {"a"}
    assert api.listed == 50 and len(counted) == 1
    few = ZoneListings(api, "p", list_over=8, list_s=1.0)
    assert [few.get("z", followed=lambda: counted.append(1) or 3) for _ in range(20)] == [None] * 20
    assert len(counted) == 2  # too few to list: each look GETs its own, and that was counted once too
