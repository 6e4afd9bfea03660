"""tpu-orchestrator: run JAX training jobs on spot Cloud TPU slices, recovering from preemptions.

The public names are imported when first used, not with the package: a host node's process
(`python -m orchestrator.cluster.raynode`) imports this package first, and needs none of them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from orchestrator.domain.spec import JobSpec
    from orchestrator.errors import OrchestratorError, SpecError
    from orchestrator.state.states import JobState
    from orchestrator.user.client import Client, Job, JobStatus

_WHERE = {"JobSpec": "orchestrator.domain.spec", "OrchestratorError": "orchestrator.errors",
          "SpecError": "orchestrator.errors", "JobState": "orchestrator.state.states",
          "Client": "orchestrator.user.client", "Job": "orchestrator.user.client",
          "JobStatus": "orchestrator.user.client"}

__all__ = ["Client", "Job", "JobSpec", "JobState", "JobStatus", "OrchestratorError", "SpecError"]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'orchestrator' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value  # once: later lookups find it as a plain attribute
    return value
