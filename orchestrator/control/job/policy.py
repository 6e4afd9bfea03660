"""The cost policy as the job's loop sees it: one question, injected (a test passes a scripted one).

`current` is the shape of the running slices (None before a provisioning), `waiting` the shape of
the request waiting beside them, `ready` whether that request is READY. The answer is a `Choice`:
what to run, its checkpoint interval, and the `Move` that gets there (`orchestrator.control.job.moves`).
"""

from __future__ import annotations

import time
from typing import Protocol

from orchestrator import catalog
from orchestrator.control.autoscaler import Choice, Key, decide
from orchestrator.control.job.services import JobServices
from orchestrator.domain.spec import JobSpec
from policies.cost.slice_options import MAX_CHIPS


class JobPolicy(Protocol):
    def choose(self, spec: JobSpec, current: Key | None, *, waiting: Key | None, ready: bool) -> Choice: ...


class StoredFactsPolicy:
    """The real policy (`orchestrator.control.autoscaler.decide`) over the facts the store holds of the job."""

    def __init__(self, services: JobServices, job_id: str):
        self.services, self.job_id = services, job_id

    def choose(self, spec: JobSpec, current: Key | None, *, waiting: Key | None, ready: bool) -> Choice:
        return decide(self.services.store, self.job_id, now=time.time(), current=current, waiting=waiting,
                      waiting_ready=ready and waiting is not None,
                      spot_chips_available=self.spot_chips_available(spec))

    def spot_chips_available(self, spec: JobSpec) -> int:
        """The most spot chips the job may ask for at once: the largest allowed slice, times the
        slices of it it may hold (`max_slices`, 32 chips in all; the autoscaler takes off what the
        zone refused it lately)."""
        auto = spec.autoscaling
        assert auto is not None, "asked only for a job that autoscales (the moves check)"
        hosts = self.services.provider.max_hosts if spec.provider_facts.limited_by_local_hosts else None
        most = 0
        for t in (catalog.lookup(a) for a in auto.accelerators):
            for n in range(1, auto.max_slices + 1):
                if (n == 1 or n * t.chips <= MAX_CHIPS) and (hosts is None or n * t.hosts <= hosts):
                    most = max(most, n * t.chips)
        return most
