"""The policy's path over the integration replay's trace, on fixed facts instead of a wall clock.

`tests/integration/test_autoscale_replay.py` runs the real controller over a spot trace with one
outage, replayed at 60 trace seconds a wall second: what the job measures (its speed, its restart
costs, in trace time) depends on this machine's load, and so does the path the policy chooses. Here
the same policy decides over the same trace and job in the simulator (the autoscaler and the simulator
build the policy's snapshot with one function: `test_decision_path`), at the speed and restart costs
that run measures on a quiet machine and at the speed it measured under load, so the path each gives
is asserted exactly.
"""

from __future__ import annotations

import pytest

from benchmarks.autoscale_replay import ACCELERATORS, TIERS, outage_trace, sim_slices
from orchestrator.domain.options import job_options
from policies.cost.policy import CostPolicy
from policies.cost.restart_cost import RestartCost
from policies.evaluation.simulator import SimJob, simulate
from policies.evaluation.traces import SpotTrace
from tests.integration.test_autoscale_replay import DEADLINE_S, STEPS

TOKENS_PER_STEP = 16 * 32  # the replayed job's global batch times its sequence length
TRACE = outage_trace(up=12, down=6, cycles=1)  # 60 s ticks: spot for 720 s, gone for 360 s, then back


def policy_path(steps_per_s: float, provisioning_s: float, startup_s: float):
    """The simulator's run of the replayed job at `steps_per_s` (trace time) with these restart costs."""
    options = tuple(job_options(ACCELERATORS, TIERS, measured_tokens_per_s={"v4-8": steps_per_s * TOKENS_PER_STEP}))
    restart = RestartCost(provisioning_s=provisioning_s, startup_s=startup_s,
                          checkpoint_interval_s=100 / steps_per_s, save_s=0.0)
    return simulate(CostPolicy(), SimJob(STEPS * TOKENS_PER_STEP, DEADLINE_S, options),
                    SpotTrace("one-outage", 60.0, tuple(TRACE), nodes=1), restart=restart, knowledge="own",
                    release_first=False)


def test_at_the_quiet_machine_s_speed_the_job_goes_spot_on_demand_and_back_to_spot_in_time():
    # 1.8 steps a trace second; a slice READY in about 1 wall second and the first step 5 wall seconds later.
    run = policy_path(1.8, provisioning_s=60.0, startup_s=300.0)
    assert sim_slices(run) == ["v4-8 spot", "v4-8 on-demand", "v4-8 spot"]
    assert run.deadline_met and run.finish_s <= DEADLINE_S


@pytest.mark.parametrize("provisioning_s, startup_s", [(60.0, 300.0), (120.0, 600.0)])
def test_at_the_speed_measured_under_load_the_safety_net_runs_on_demand_from_the_start(provisioning_s, startup_s):
    """What the clean-clone run's job did (1.0 steps a trace second): on-demand to the end, the policy's answer
    at that speed, and the deadline still met."""
    run = policy_path(1.0, provisioning_s, startup_s)
    assert sim_slices(run) == ["v4-8 on-demand"]
    assert run.deadline_met
