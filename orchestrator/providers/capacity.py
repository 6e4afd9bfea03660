"""A replayed spot trace as the local provider's spot capacity, on a compressed clock.

For demos and tests of the autoscaler on one machine: `provider: local` with a
`capacity_trace:` makes the job's spot capacity that of a recorded trace (see
`policies.evaluation.traces`), replayed `time_scale` times faster than wall time (60: one trace
hour per wall minute). A spot request above the capacity waits with no host started; a
READY spot slice above it gets a notice, and its hosts are killed `grace_s` trace
seconds later. On-demand is always there, as in the simulator.

`policies.cost.clock.Clock` is the one conversion between wall time and trace time; the controller
scales its own intervals (decisions, queue timeouts) with the same clock, so the
policy sees the same world the simulator replays.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import lru_cache

from policies.cost.clock import Clock
from policies.evaluation.traces import SpotTrace, load_trace


@dataclass(frozen=True)
class SpotCapacity:
    """One job's replayed spot capacity: the largest spot slice (chips) it can have, when."""

    path: str
    clock: Clock
    grace_s: float = 30.0  # trace seconds between a notice and the end of the hosts

    @property
    def trace(self) -> SpotTrace:
        return _load(self.path)

    def chips(self, wall: float | None = None) -> int:
        """The largest spot slice in chips at wall time `wall` (now if None); the trace wraps around."""
        t = self.trace
        tick = int(self.clock.trace_s(time.time() if wall is None else wall) // t.gap_s) % len(t.counts)
        return t.mapping.chips(t.counts[tick])

    def grace_wall_s(self) -> float:
        return self.clock.wall_s(self.grace_s)


@lru_cache(maxsize=16)
def _load(path: str) -> SpotTrace:
    return load_trace(path)
