"""The fleet benchmark's split of a reaction to a lost READY slice (`benchmarks.fleet._reclaim_latencies`):
from the loss seen to the job's RECOVERING, to its PROVISIONING, to its next request; only READY slices'
reactions are split, and a reaction without both transitions is not."""

from __future__ import annotations

import pytest

from benchmarks.fleet import _reclaim_latencies


def test_a_ready_slices_reaction_is_split_at_the_jobs_transitions():
    slice_job = {"a-1": "a", "b-1": "b", "c-1": "c"}
    events = {  # job -> (at, slice, state)
        "a": [(0.0, "a-1", "READY"), (10.5, "a-1", "PREEMPTING"), (17.0, "a-2", "REQUESTED")],
        "b": [(0.0, "b-1", "WAITING"), (10.2, "b-1", "GONE"), (30.0, "b-2", "REQUESTED")],  # a request: not split
        "c": [(0.0, "c-1", "READY"), (11.0, "c-1", "GONE"), (20.0, "c-2", "REQUESTED")],  # no RECOVERING: not split
    }
    states = {"a": [(5.0, "PROVISIONING"), (14.5, "RECOVERING"), (16.0, "PROVISIONING")],
              "b": [(12.0, "RECOVERING"), (29.0, "PROVISIONING")],
              "c": [(19.0, "PROVISIONING")]}
    out = _reclaim_latencies([("a-1", 10.0), ("b-1", 10.0), ("c-1", 10.0)], slice_job, events, states)
    parts = out["seen_to_next_request_s"]["ready_parts"]
    assert {k: v["n"] for k, v in parts.items()} == {"seen_to_recovering": 1, "recovering_to_provisioning": 1,
                                                     "provisioning_to_request": 1}
    assert parts["seen_to_recovering"]["p50"] == pytest.approx(4.0)  # 10.5 -> 14.5
    assert parts["recovering_to_provisioning"]["p50"] == pytest.approx(1.5)  # the PROVISIONING after it, not before
    assert parts["provisioning_to_request"]["p50"] == pytest.approx(1.0)
    assert out["seen_to_next_request_s"]["by_controller_view"]["READY"]["n"] == 2  # both READY reactions counted
