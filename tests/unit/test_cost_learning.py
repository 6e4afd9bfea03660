"""What the cost policy learns of a zone's up periods from its own slice records (issue 38): a
reclaim ends an up period of the size reclaimed and of every size above it, even where the job
never waits for that size afterwards."""

from __future__ import annotations

import pytest

from policies.cost.capacity_memory import learn
from policies.cost.slice_history import SliceRecord
from policies.cost.slice_options import ON_DEMAND, SPOT
from policies.cost.spot_estimates import PRIOR_UPTIME_HOURS


def group_reclaimed(name: str, start_s: float, up_s: float) -> list[SliceRecord]:
    """Two v4-16 slices (16 chips, 4 hosts) up for `up_s`, then reclaimed together: the simulator's
    and the controller's records say even one slice could not be kept (a zero-length wait for 8 chips)."""
    return [SliceRecord(start_s, name, "READY", SPOT, 16, 4),
            SliceRecord(start_s + up_s, name, "GONE", SPOT, 16, 4),
            SliceRecord(start_s + up_s, f"{name}-one", "WAITING", SPOT, 8, 2),
            SliceRecord(start_s + up_s, f"{name}-one", "RELEASED", SPOT, 8, 2)]


def test_reclaims_end_the_up_periods_of_one_slice_too():
    # Three half-hour stretches, each reclaimed, an hour on on-demand between them (no spot wait).
    records = []
    for k in range(3):
        records += group_reclaimed(f"s{k}", k * 5400.0, 1800.0)
        records += [SliceRecord(k * 5400.0 + 1800.0, f"od{k}", "READY", ON_DEMAND, 16, 4),
                    SliceRecord(k * 5400.0 + 5400.0, f"od{k}", "RELEASED", ON_DEMAND, 16, 4)]
    _, availability, _ = learn(records, now_s=3 * 5400.0, sizes=[8, 16, 32])
    for chips in (8, 16):  # the prior period and three of half an hour each
        mean, _ = availability.uptime_h("default", chips)
        assert mean == pytest.approx((PRIOR_UPTIME_HOURS + 3 * 0.5) / 4)
        # No outage was seen (the job never waited): none of zero length is counted either.
        assert availability.outage_h("default", chips)[0] == pytest.approx(availability.prior_outage_h)


def test_an_up_period_goes_on_through_a_planned_stop():
    """A slice released by the job (no reclaim) says nothing about the zone: the period goes on."""
    records = [SliceRecord(0.0, "a", "READY", SPOT, 8, 2), SliceRecord(1800.0, "a", "RELEASED", SPOT, 8, 2),
               SliceRecord(1800.0, "b", "READY", SPOT, 8, 2), SliceRecord(3600.0, "b", "RELEASED", SPOT, 8, 2)]
    _, availability, _ = learn(records, now_s=3600.0, sizes=[8])
    mean, _ = availability.uptime_h("default", 8)
    assert mean == pytest.approx((PRIOR_UPTIME_HOURS + 1.0) / 2)  # one period of an hour, under way
