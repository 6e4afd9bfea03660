"""Baseline policies the cost policy is measured against in the simulator and the
benchmark: one fixed option, and Can't Be Late's greedy rule."""

from __future__ import annotations

import math
from dataclasses import dataclass

from policies.cost.policy import SAFETY_MARGIN_S
from policies.cost.slice_options import Option
from policies.cost.snapshot import Decision, Snapshot


@dataclass(frozen=True)
class FixedPolicy:
    """Always the same option; for spot, wait whenever it cannot be had and restart after."""

    option: Option
    name: str = "fixed"

    def decide(self, snap: Snapshot) -> Decision:
        if self.option.preemptible and self.option.chips > snap.spot_chips_available:
            return Decision(None, f"wait for spot {self.option.name}", math.nan, math.nan)
        return Decision(self.option, f"always {self.option.label}", math.nan, math.nan)


@dataclass(frozen=True)
class GreedyPolicy:
    """Can't Be Late's greedy rule: spot whenever it can be had, else wait; once the slack
    to finish on on-demand falls under the margin, on-demand until the end."""

    spot: Option
    on_demand: Option
    safety_margin_s: float = SAFETY_MARGIN_S
    name: str = "greedy"

    def decide(self, snap: Snapshot) -> Decision:
        left = snap.total_tokens - snap.tokens_committed
        fallback_s = (snap.decision_interval_s + snap.restart.overhead_s
                      + snap.restart.train_s(left, self.on_demand.tokens_per_s))
        if snap.current == self.on_demand or snap.deadline_s - snap.now_s - fallback_s < self.safety_margin_s:
            return Decision(self.on_demand, "slack exhausted: on-demand to the end", math.nan, math.nan)
        if self.spot.chips <= snap.spot_chips_available:
            return Decision(self.spot, "spot available", math.nan, math.nan)
        return Decision(None, "wait for spot", math.nan, math.nan)
