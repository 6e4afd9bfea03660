"""tpu-orchestrator: run JAX training jobs on spot Cloud TPU slices, recovering from preemptions."""

from orchestrator.domain.spec import JobSpec
from orchestrator.errors import OrchestratorError, SpecError
from orchestrator.state.states import JobState
from orchestrator.user.client import Client, Job, JobStatus

__all__ = ["Client", "Job", "JobSpec", "JobState", "JobStatus", "OrchestratorError", "SpecError"]
