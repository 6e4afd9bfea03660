"""How fast one project may create queued resources: a token bucket shared by every job of a controller.

The TPU API counts create calls per project and minute (`tpu.googleapis.com/qps/create`). Google's quota page
lists chips only; one team reports 91 a minute in their project and throttles itself to 60 across all its
scale groups (marin-community/marin PR #6198). A fleet hits it in a mass reclaim: at 300 jobs half of them
asked again within a minute (`benchmarks/fleet.py`: 182 creates a minute), and every create past the quota
is a 429 to retry while the jobs wait anyway. So creates wait here first, in the order they came.

A burst of `burst` creates goes at once; after that one every ``60 / per_minute`` seconds. A caller that
has to wait reserves its turn under the lock and sleeps outside it, so callers never spin and never
overtake each other.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class CreatePace:
    """At most `per_minute` creates a minute from this process (None: no limit), `burst` of them at once."""

    def __init__(self, per_minute: float | None, *, burst: int = 10,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep):
        if per_minute is not None and per_minute <= 0:
            raise ValueError(f"creates per minute must be positive or None, not {per_minute}")
        if burst < 1:
            raise ValueError(f"a burst of at least one create, not {burst}")
        self.per_minute, self.burst = per_minute, burst
        self._clock, self._sleep = clock, sleep
        self._lock = threading.Lock()
        self._tokens = float(burst)
        self._at = clock()
        self.waited_s = 0.0  # in all, by every caller (what the fleet benchmark reports)
        self.waits = 0  # creates that had to wait

    def wait(self) -> float:
        """Take a turn to create: at once while the bucket holds one, else after the turns before it.
        Returns the seconds this caller waited."""
        if self.per_minute is None:
            return 0.0
        rate = self.per_minute / 60.0
        with self._lock:
            now = self._clock()
            self._tokens = min(float(self.burst), self._tokens + (now - self._at) * rate)
            self._at = now
            self._tokens -= 1.0  # below zero: turns reserved by callers now sleeping
            delay = -self._tokens / rate if self._tokens < 0 else 0.0
            if delay > 0:
                self.waited_s += delay
                self.waits += 1
        if delay > 0:
            self._sleep(delay)
        return delay
