"""Policy time, and how often the policy is asked.

Every duration the cost policy reasons about (restart costs, refusal holds, its
priors in hours, the deadline) is in policy seconds. In production they are wall
seconds. A provider that replays a spot trace in compressed time (`scale` trace
seconds a wall second; 60: one trace hour a wall minute) runs the same policy on trace
time: the autoscaler turns what it measured into policy seconds with a `Clock`, and
the controller waits `Clock.wall_s` of each policy interval, so a replay decides at
the same trace moments as the simulator does.
"""

from __future__ import annotations

from dataclasses import dataclass

# How often the policy is asked while nothing happens, in policy seconds, by the
# simulator and the controller alike. Events ask it at once (a preemption, a refused or
# expired request); a restart costs minutes, so a few minutes between looks loses little.
DECISION_INTERVAL_S = 300.0


@dataclass(frozen=True)
class Clock:
    """`scale` policy seconds pass each wall second (1: real time)."""

    scale: float = 1.0

    def __post_init__(self):
        if not self.scale > 0:
            raise ValueError(f"Clock.scale must be > 0, not {self.scale!r}")

    def policy_s(self, wall_s: float) -> float:
        """A wall-clock duration in policy seconds."""
        return wall_s * self.scale

    def wall_s(self, policy_s: float) -> float:
        """A policy duration in wall-clock seconds (what the controller sleeps)."""
        return policy_s / self.scale

    @property
    def decision_interval_wall_s(self) -> float:
        return self.wall_s(DECISION_INTERVAL_S)
