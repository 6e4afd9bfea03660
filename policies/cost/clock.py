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
    """`scale` policy seconds pass each wall second (1: real time). A replay also places policy time
    in its trace: trace time is `start_s + (wall - origin) * scale`, where `origin` is the wall time
    (`time.time()`) at which the replay starts and `start_s` where in the trace it starts. The one
    conversion between wall, policy and trace time: the controller, the replayed capacity and the
    autoscaler all use it."""

    scale: float = 1.0
    origin: float = 0.0
    start_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.scale > 0:
            raise ValueError(f"Clock.scale must be > 0, not {self.scale!r}")

    def policy_s(self, wall_s: float) -> float:
        """A wall-clock duration in policy seconds."""
        return wall_s * self.scale

    def wall_s(self, policy_s: float) -> float:
        """A policy duration in wall-clock seconds (what the controller sleeps)."""
        return policy_s / self.scale

    def trace_s(self, wall: float) -> float:
        """Seconds into the trace at wall time `wall`."""
        return self.start_s + (wall - self.origin) * self.scale

    def elapsed_s(self, wall: float) -> float:
        """Trace seconds since the replay started."""
        return self.trace_s(wall) - self.start_s

    @property
    def decision_interval_wall_s(self) -> float:
        return self.wall_s(DECISION_INTERVAL_S)
