"""The cost policy's input and output: a `Snapshot` of every fact a decision depends on,
and the `Decision` taken on it.

The orchestrator's autoscaler builds snapshots from what a running job has shown; the
trace simulator builds them at every decision point of a replay. Either way the policy
sees the same record, so what it does in the simulator is what it does in production.
"""

from __future__ import annotations

from dataclasses import dataclass

from policies.cost.restart_cost import RestartCost
from policies.cost.slice_options import Option
from policies.cost.spot_estimates import SpotAvailability, SpotHazard


@dataclass(frozen=True)
class Snapshot:
    """Every fact a decision depends on, at one moment (`now_s`, same clock as `deadline_s`)."""

    now_s: float
    deadline_s: float
    total_tokens: float
    tokens_done: float  # trained so far, including steps after the last checkpoint
    tokens_committed: float  # in the last committed checkpoint
    options: tuple[Option, ...]
    spot_chips_available: int  # largest spot slice the zone can give now; 0: none
    current: Option | None = None  # the slice the job holds, if any
    current_ready_in_s: float = 0.0  # > 0 while the current slice is provisioning or starting
    hazard: SpotHazard = SpotHazard()
    availability: SpotAvailability = SpotAvailability()
    restart: RestartCost = RestartCost()
    spent_usd: float = 0.0
    budget_usd: float | None = None
    decision_interval_s: float = 60.0  # time until the policy is asked again
    ready: Option | None = None  # a requested slice that is READY beside the current one: only its startup is left

    def overhead_s(self, option: Option) -> float:
        """Time before `option` trains if the job moves to it (or stays on it) now."""
        if option == self.current:
            return self.current_ready_in_s
        return self.restart.startup_s if option == self.ready else self.restart.overhead_s


@dataclass(frozen=True)
class Decision:
    """What to run next (None: hold no slice and wait for spot), why, and what it should cost."""

    option: Option | None
    reason: str
    expected_cost_usd: float  # expected spend from now to completion
    expected_finish_s: float  # expected completion time, same clock as Snapshot.now_s
    resize: bool = False  # replaces a slice the job holds
    within_budget: bool = True
    checkpoint_interval_s: float | None = None  # how often to checkpoint on `option`
    wait_for: Option | None = None  # a spot slice the plan waits for that the zone cannot give now (keep it requested)


def slice_hazard_per_hour(option: Option, snap: Snapshot) -> float:
    """Preemptions per hour of holding `option`: the job's own estimate (`SpotHazard`), or,
    if shorter-lived, what the zone's capacity says (one drop per mean up period of the
    size), since the capacity signal is seen even while the job holds no spot slice."""
    if not option.preemptible:
        return 0.0
    mean_up_h = snap.availability.uptime_h(option.zone, option.chips)[0]
    return max(snap.hazard.per_slice_hour(option), 1 / max(mean_up_h, 1e-3))
