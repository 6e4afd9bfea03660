"""The liveness soak's figures (`benchmarks/liveness_soak.py`): the loss comparison and the spread of a kill's
timings."""

from __future__ import annotations

import math

from benchmarks.liveness_soak import max_relative_difference, spread


def test_the_largest_relative_difference_over_the_steps_the_killed_job_ran():
    want = {0: 4.0, 1: 2.0, 2: 1.0, 3: 0.5}  # the reference trained on
    assert max_relative_difference({0: 4.0, 1: 2.0, 2: 1.0}, want) == 0.0
    assert math.isclose(max_relative_difference({0: 4.0, 1: 2.002, 2: 0.9999}, want), 1e-3)


def test_a_step_missing_or_beyond_the_reference_never_compares_equal():
    want = {0: 4.0, 1: 2.0}
    assert max_relative_difference({0: 4.0, 2: 1.0}, {**want, 2: 1.0}) == float("inf")  # step 1 skipped
    assert max_relative_difference({1: 2.0}, want) == float("inf")  # not from step 0
    assert max_relative_difference({0: 4.0, 1: 2.0, 2: 1.0}, want) == float("inf")  # the reference has no step 2
    assert max_relative_difference({}, want) == float("inf")  # nothing trained is no match


def test_spread_is_min_median_max():
    assert spread([3.0, 1.0, 2.0, 10.0]) == {"min": 1.0, "median": 2.5, "max": 10.0}
    assert spread([]) == {"min": None, "median": None, "max": None}
