"""The policy sizes spot to what is there and does not chase short bursts (issue 38): a start
on spot takes every slice of its type that fits when that costs no more a token and the
stretch pays; leaving a running slice for spot needs a stretch longer than the move costs."""

from __future__ import annotations

from policies.cost.fluid_plan import plan_inputs
from policies.cost.policy import LOOKAHEAD_S, _every_slice_that_fits, decide, value_of
from policies.cost.restart_cost import RestartCost
from policies.cost.scaling_assumptions import DEFAULT, PESSIMISTIC
from policies.cost.slice_options import ON_DEMAND, SPOT, MultiSlice, Option, multi_slice_options
from policies.cost.snapshot import Snapshot
from policies.cost.spot_estimates import SpotAvailability

SPEED = {8: 143_453.0, 16: 269_691.0, 32: 507_019.0}
HOSTS = {8: 2, 16: 4, 32: 8}
SINGLE = tuple(Option(f"v4-{2 * c}", c, HOSTS[c], t, (0.92 if t == SPOT else 3.22) * c, SPEED[c])
               for c in (8, 16, 32) for t in (SPOT, ON_DEMAND))
HOUR = 3600.0


def options(scaling=DEFAULT):
    multi = MultiSlice(1.0e9, 512 * 2048, bytes_per_s_per_host=scaling.dcn_bytes_per_s_per_host,
                       hidden_share=scaling.hidden_share)
    return multi_slice_options(SINGLE, multi, 4)


def pick(opts, label: str) -> Option:
    return next(o for o in opts if o.label == label)


def seen_up_periods(hours: float, chips_sizes=(8, 16, 24, 32), periods: int = 6,
                    capacity: int = 32) -> SpotAvailability:
    """A zone whose spot came and went in stretches of `hours` (as long down), giving `capacity` chips when up."""
    a = SpotAvailability()
    for _ in range(periods):
        a = a.observe("default", chips_sizes, capacity, hours * HOUR)
        a = a.observe("default", chips_sizes, 0, hours * HOUR)
    return a.observe("default", chips_sizes, capacity, 60.0)


def snap(opts, *, availability: SpotAvailability, current=None, capacity=32, hours_left=30.0) -> Snapshot:
    return Snapshot(now_s=0.0, deadline_s=hours_left * HOUR, total_tokens=20e9, tokens_done=0.0,
                    tokens_committed=0.0, options=tuple(opts), spot_chips_available=capacity, current=current,
                    availability=availability, restart=RestartCost())


def test_a_start_on_spot_takes_every_slice_that_fits_when_stretches_are_long():
    opts = options()
    d = decide(snap(opts, availability=seen_up_periods(3.0)))
    assert d.option is not None and d.option.preemptible
    assert d.option.chips == 32, d.reason  # not 2 x v4-16 while 32 chips are there


def test_the_wider_start_needs_an_equal_price_a_token_and_a_stretch_that_pays():
    """Default assumptions: 4 x v4-16 costs what one v4-16 does a token, and is taken where the
    stretch pays the relaunch; not where stretches are shorter than it. Pessimistic (the all-reduce
    not hidden): N slices cost more a token than one, and the rule takes nothing."""
    for scaling, hours, wider in ((DEFAULT, 3.0, True), (DEFAULT, 1 / 60, False), (PESSIMISTIC, 3.0, False)):
        opts = options(scaling)
        s = snap(opts, availability=seen_up_periods(hours, periods=60))
        values = [value_of(o, s, plan_inputs(s), LOOKAHEAD_S) for o in opts if o.preemptible]
        one = next(v for v in values if v.option == pick(opts, "v4-16 spot"))
        taken = _every_slice_that_fits(s, one, values)
        assert (taken is not None) == wider, (scaling.name, hours)
        if taken is not None:
            assert taken.option == pick(opts, "4xv4-16 spot")


def test_a_running_slice_is_not_left_for_spot_bursts_shorter_than_the_move():
    opts = options()
    od = pick(opts, "v4-32 on-demand")
    short = seen_up_periods(3 / 60, periods=60)  # 3-minute stretches: shorter than two startups
    d = decide(snap(opts, availability=short, current=od, hours_left=12.0))
    assert d.option is None or not d.option.preemptible, d.reason
    long = seen_up_periods(3.0)
    d = decide(snap(opts, availability=long, current=od, hours_left=30.0))
    assert d.option is not None and d.option.preemptible, d.reason  # long stretches: spot pays


def test_a_running_spot_slice_kept_grows_to_every_slice_the_zone_was_seen_to_give():
    """One v4-16 running with the deadline far off: the values alone priced the grow's relaunch
    against a plan that counts on spot later, and kept one slice while the zone had more. Kept, it
    now grows to the count the zone has been seen to give: four where 32 chips were seen up, two
    where 16 were, and none past what fits now."""
    opts = options()
    one = pick(opts, "v4-16 spot")
    for seen, capacity, grown in ((32, 32, "4xv4-16 spot"), (16, 32, "2xv4-16 spot"), (32, 16, "2xv4-16 spot")):
        zone = seen_up_periods(3.0, capacity=seen)
        d = decide(snap(opts, availability=zone, current=one, capacity=capacity, hours_left=70.0))
        assert d.option == pick(opts, grown), (seen, capacity, d.reason)


def test_a_running_spot_slice_does_not_grow_where_it_costs_more_a_token_or_stretches_are_short():
    """Pessimistic assumptions (the all-reduce not hidden): more slices cost more a token, so the one
    running is kept as it is. Stretches of two minutes: the added slices would not pay the relaunch."""
    opts = options(PESSIMISTIC)
    one = pick(opts, "v4-16 spot")
    d = decide(snap(opts, availability=seen_up_periods(3.0), current=one, hours_left=70.0))
    assert d.option == one, d.reason
    opts = options()
    one = pick(opts, "v4-16 spot")
    d = decide(snap(opts, availability=seen_up_periods(2 / 60, periods=60), current=one, hours_left=70.0))
    assert d.option is not None and d.option.count == 1, d.reason
