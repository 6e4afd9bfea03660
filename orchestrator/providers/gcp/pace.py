"""How often the gcp provider talks to the TPU API: its looks and listings (`Polling`), and how fast one project
may create queued resources (`CreatePace`, a token bucket shared by every job of a controller).

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
from dataclasses import dataclass

from orchestrator.providers.base import Abandoned, giving_up


@dataclass(frozen=True)
class Polling:
    poll_s: float = 5.0  # between two looks at a slice in wait_ready
    capacity_wait_s: float = 900.0  # queued longer than this in one zone counts as no capacity
    accept_grace_s: float = 30.0  # a just-created queued resource may not be readable yet
    request_timeout_s: float = 30.0  # one HTTP call
    # Following more than `list_over` slices in a zone, the provider looks at them all through one listing of
    # the zone's queued resources and nodes, at most every `list_s` (2 calls, however many slices), not 1-2
    # GETs per slice per look: every running job's driver looks at its slices every second (`watch.LOOK_S`).
    list_over: int = 8
    list_s: float = 1.0
    # Queued resources created a minute in the project, by every job of this controller (`pace.CreatePace`:
    # 60, under the 91 a minute one team reports as the project's create quota); None: no limit.
    creates_per_minute: float | None = 60.0
    create_burst: int = 10
    # A released slice is forgotten this long after (its record, its events not taken): a controller that
    # runs for weeks follows what is live, not every slice it ever asked for.
    forget_after_s: float = 600.0
    # HTTP connections to the API kept open for reuse. Every job's driver calls the API from its own thread, and
    # a call made while all kept ones are in use opens one of its own and closes it after (requests keeps 10 by
    # default: at 1,000 jobs 700 such closes a run were logged, and each new one is a TLS handshake on the real
    # API). Calls beyond this many at once still open their own.
    connections: int = 64


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
        Returns the seconds this caller waited.

        A caller whose thread gives up (`providers.base.give_up_on`: its job was cancelled) while it waits
        gets `Abandoned`, and its turn goes back to the bucket for the next caller."""
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
            give_up = giving_up()
            if give_up is None:
                self._sleep(delay)
            elif give_up.wait(delay):
                with self._lock:
                    self._tokens += 1.0  # the turn it reserved, for whoever asks next
                raise Abandoned(f"cancelled after {delay:.0f} s in the project's create pace; nothing was created")
        return delay
