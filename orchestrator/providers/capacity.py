"""A replayed spot trace as the local provider's spot capacity, on a compressed clock.

For demos and tests of the autoscaler on one machine: `provider: local` with a
`capacity_trace:` makes the job's spot capacity that of a recorded trace (see
`policies.evaluation.traces`), replayed `time_scale` times faster than wall time (60: one trace
hour per wall minute). A spot request above the capacity waits with no host started; a
READY spot slice above it gets a notice, and its hosts are killed `grace_s` trace
seconds later. On-demand is always there, as in the simulator.

`TraceClock` is the one conversion between wall time and trace time; the controller
scales its own intervals (decisions, queue timeouts) with the same clock, so the
policy sees the same world the simulator replays.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import lru_cache

from policies.evaluation.traces import SpotTrace, load_trace


@dataclass(frozen=True)
class TraceClock:
    """Trace time `start_s + (wall - origin) * scale`: `scale` trace seconds per wall second."""

    origin: float  # wall time (time.time()) at which the replay starts
    scale: float = 1.0
    start_s: float = 0.0  # where in the trace the replay starts

    def trace_s(self, wall: float | None = None) -> float:
        """Seconds into the trace at wall time `wall` (now if None)."""
        wall = time.time() if wall is None else wall
        return self.start_s + (wall - self.origin) * self.scale

    def elapsed_s(self, wall: float | None = None) -> float:
        """Trace seconds since the replay started."""
        return self.trace_s(wall) - self.start_s

    def wall_seconds(self, trace_seconds: float) -> float:
        """How long `trace_seconds` of trace time last on the wall clock."""
        return trace_seconds / self.scale


REAL_TIME = TraceClock(origin=0.0)  # scale 1: what a job without a replayed trace runs on


@dataclass(frozen=True)
class SpotCapacity:
    """One job's replayed spot capacity: the largest spot slice (chips) it can have, when."""

    path: str
    clock: TraceClock
    grace_s: float = 30.0  # trace seconds between a notice and the end of the hosts

    @property
    def trace(self) -> SpotTrace:
        return _load(self.path)

    def chips(self, wall: float | None = None) -> int:
        """The largest spot slice in chips at wall time `wall` (now if None); the trace wraps around."""
        t = self.trace
        tick = int(self.clock.trace_s(wall) // t.gap_s) % len(t.counts)
        return t.mapping.chips(t.counts[tick])

    def grace_wall_s(self) -> float:
        return self.clock.wall_seconds(self.grace_s)


@lru_cache(maxsize=16)
def _load(path: str) -> SpotTrace:
    return load_trace(path)
