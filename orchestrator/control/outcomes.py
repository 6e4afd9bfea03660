"""How one attempt at running a job ended, as a typed outcome (never a string search)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field


class OutcomeKind(str, enum.Enum):
    SUCCEEDED = "succeeded"
    PREEMPTED = "preempted"  # the provider took hosts back, with or without notice
    INFRA_LOST = "infra_lost"  # a host or worker process died, or hung past the heartbeat timeout
    APP_FAILED = "app_failed"  # the user's code raised (or exited non-zero) on healthy hosts
    PROVISION_FAILED = "provision_failed"  # no slice, or its workers could not all start
    CANCELLED = "cancelled"
    RESIZED = "resized"  # stopped on purpose at a committed checkpoint, to go on on another slice size


@dataclass(frozen=True)
class Outcome:
    kind: OutcomeKind
    reason: str
    traceback: str | None = None
    transient: bool = True  # for PROVISION_FAILED: may a retry (later, elsewhere) work?
    at: float = field(default_factory=time.time)  # when the controller knew (before tearing the group down)

    @property
    def counts_as_preemption(self) -> bool:
        return self.kind in (OutcomeKind.PREEMPTED, OutcomeKind.INFRA_LOST)
