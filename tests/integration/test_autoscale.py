"""The cost policy chooses a running job's slice: its decision is an event with a reason, and it is acted on."""

from __future__ import annotations

from orchestrator import JobState
from tests.integration.test_local_jobs import tiny_spec


def test_policy_picks_the_slice_and_says_why(client, tmp_path):
    spec = tiny_spec("auto", "v4-16", tmp_path, steps=8, interval=4,
                     autoscaling={"accelerators": ["v4-8", "v4-16"], "tiers": ["spot", "on-demand"]},
                     deadline="PT2H", budget_usd=50)
    job = client.submit(spec)
    st = job.wait(timeout_s=400)
    assert st.state is JobState.SUCCEEDED, st.reason
    decisions = [e for e in job.events() if e.kind == "autoscale"]
    assert decisions, "no autoscaling decision was recorded"
    first = decisions[0].data
    assert first["accelerator"] in ("v4-8", "v4-16") and first["tier"] in ("spot", "on-demand")
    assert first["reason"] and first["expected_cost_usd"] >= 0
    # The slice it ran on is the one the policy chose.
    slices = [e.data for e in job.events() if e.kind == "slice" and e.data["state"] == "READY"]
    assert (slices[0]["accelerator"], slices[0]["tier"]) == (first["accelerator"], first["tier"])
    # With a deadline of hours for a job of seconds, spot (the cheaper tier) is the choice.
    assert first["tier"] == "spot"
