"""Waiting in tests: on a condition with a deadline, never on a guessed while.

A test that sleeps a guessed time and then asserts is slow when the guess is long and flaky
when it is short. `wait_for` returns as soon as the condition holds and, past its timeout,
fails with what it waited for.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(condition: Callable[[], T], timeout_s: float, what: str, poll_s: float = 0.05) -> T:
    """The first truthy value of `condition()`; AssertionError naming `what` once `timeout_s` has passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(poll_s)


def wait_step(job, step: int, timeout_s: float = 300) -> None:
    """Until `job` (a `Job` handle) has done `step`; AssertionError with its reason if it ended first."""
    wait_for(lambda: job.status().step >= step or job.status().done, timeout_s, f"{job.id} to reach step {step}")
    assert not job.status().done, job.status().reason
