"""`budget_usd` and `deadline` on a job without autoscaling, through the real controller on a local cluster.

The budget is a cap: the job stops at a committed step before what it spent (its slice's
billed time at catalog prices, as `status` counts it) would pass it, and ends FAILED_BUDGET
with the figures in its reason. A deadline the job will miss at its measured speed shows in
`status` while it runs, and as an event.
"""

from __future__ import annotations

import time

from orchestrator import JobState
from orchestrator.observe.goodput import goodput
from orchestrator.state.states import FailedBecause
from orchestrator.user.cli import status_lines
from tests.integration.test_local_jobs import tiny_spec

USD_PER_HOUR = 3.68  # v4-8 spot in the catalog
BUDGET_USD = 0.05  # about 49 s of the slice: the start, some training and the stop (13 s at grace 3 s)


def test_a_job_stops_at_its_budget_and_says_it_will_miss_its_deadline(client, tmp_path):
    spec = tiny_spec("capped", "v4-8", tmp_path, steps=100_000, interval=4, budget_usd=BUDGET_USD, deadline="PT30S",
                     recovery={"start_timeout_s": 120, "grace_period_s": 3})
    job = client.submit(spec)
    warning = None
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        st = job.status()
        warning = warning or st.warning
        if st.done:
            break
        time.sleep(0.5)
    assert st.state is JobState.FAILED and st.cause is FailedBecause.BUDGET, (st.state, st.reason)
    assert st.state_name == "FAILED_BUDGET"
    assert st.reason.startswith(f"budget_usd is ${BUDGET_USD:.2f}: $"), st.reason
    assert st.reason.endswith("with its checkpoint committed"), st.reason
    assert (st.preemptions, st.failures) == (0, 0)  # a stop the user's cap asked for spends no budget of failures

    spent = goodput(client.store, job.id).usd_total
    assert 0 < spent <= BUDGET_USD, spent
    done = job.metrics()[-1].step + 1  # steps done (a checkpoint is named by the steps it holds)
    saved = [e.data["step"] for e in job.events() if e.kind == "checkpoint"]
    assert saved and saved[-1] == done, (saved[-1:], done)  # stopped at a committed step: nothing lost
    assert not [e for e in job.events() if e.kind == "disruption"]

    # At its speed, 100,000 steps end long after a deadline 30 s from submission: status said so while it ran.
    assert warning is not None and warning.startswith("will miss its deadline: at "), warning
    [late] = [e for e in job.events() if e.kind == "deadline"]
    assert late.data["late_by_s"] > 0 and late.data["deadline_s"] == 30.0
    assert late.data["steps_left"] > 90_000
    lines = status_lines(st, goodput(client.store, job.id), width=80)
    assert lines[0].startswith(f"{job.id}  FAILED_BUDGET  (budget_usd is $0.05"), lines[0]
    assert all(len(line) <= 80 for line in lines)


def test_a_budget_that_cannot_pay_for_a_start_starts_nothing(client, tmp_path):
    spec = tiny_spec("broke", "v4-8", tmp_path, steps=8, budget_usd=0.01)  # < 45 s of v4-8 spot
    job = client.submit(spec)
    st = job.wait(timeout_s=60)
    assert (st.state, st.cause) == (JobState.FAILED, FailedBecause.BUDGET)
    assert st.reason.endswith("; no slice started"), st.reason
    assert not [e for e in job.events() if e.kind == "slice"]  # nothing was requested, nothing billed
    assert goodput(client.store, job.id).usd_total == 0
