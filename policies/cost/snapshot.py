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
    waiting: Option | None = None  # a request beside the current slice not READY yet (the job's one request)

    def overhead_s(self, option: Option) -> float:
        """Time before `option` trains if the job moves to it (or stays on it) now."""
        if option == self.current:
            return self.current_ready_in_s
        if self.is_grow(option):  # the added slices start beside the running ones
            return self.restart.reshape_s
        return self.restart.startup_s if option == self.ready else self.restart.overhead_s

    def trains_on_while_provisioning_s(self, option: Option) -> float:
        """How long the running slices go on training before a move to `option` pauses them: slices to
        add provision beside them (unless READY already); any other move stops them at once."""
        return self.restart.provisioning_s if self.is_grow(option) and option != self.ready else 0.0

    def is_grow(self, option: Option) -> bool:
        """Whether `option` is the running slices and more of the same type (a slice added back)."""
        c = self.current
        return (c is not None and self.current_ready_in_s <= 0 and option.count > c.count
                and (option.name, option.tier, option.zone) == (c.name, c.tier, c.zone))

    def billed_move_usd(self, option: Option) -> float:
        """What the move to `option` bills before it trains: its startup (or what is left of the
        current one's), or for a slice added back, the added slices' startup and the pause."""
        c = self.current
        if c is not None and self.is_grow(option):
            return ((option.usd_per_hour - c.usd_per_hour) * self.restart.startup_s
                    + option.usd_per_hour * self.restart.reshape_s) / 3600
        return option.usd_per_hour / 3600 * min(self.overhead_s(option), self.restart.startup_s)


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
    """Full restarts per hour of holding `option` (every slice of it lost): the job's own
    estimate (`SpotHazard`), or, if shorter-lived, what the zone's capacity says (one drop
    per mean up period of the size), since the capacity signal is seen even while the job
    holds no spot slice. For several slices the size that counts is one slice's: while one
    can be had the job trains on (`slice_shrink_per_hour`)."""
    if not option.preemptible:
        return 0.0
    mean_up_h = snap.availability.uptime_h(option.zone, option.slice_chips)[0]
    own = snap.hazard.per_host_hour(option.tier, option.zone) * option.slice_hosts
    return max(own, 1 / max(mean_up_h, 1e-3))


def slice_shrink_per_hour(option: Option, snap: Snapshot) -> float:
    """Losses per hour of one slice of several that leave the job training on the rest: the
    rate at which any slice of `option` is lost (hosts x host hazard, or the drops of its
    whole size), less the full restarts. 0 for one slice."""
    if not option.preemptible or option.count == 1:
        return 0.0
    mean_up_h = snap.availability.uptime_h(option.zone, option.chips)[0]
    any_loss = max(snap.hazard.per_slice_hour(option), 1 / max(mean_up_h, 1e-3))
    return max(any_loss - slice_hazard_per_hour(option, snap), 0.0)
