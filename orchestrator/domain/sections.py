"""The job file's sections besides the workload: checkpoint, storage, recovery, gcp, autoscaling and a
replayed capacity trace (`orchestrator.domain.spec.JobSpec` holds them). Frozen, unknown keys refused,
numbers bounded; each section's docstring or comments are what `orchestrator schema` prints."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator

from orchestrator import catalog
from orchestrator.catalog import Tier
from orchestrator.domain.locations import check_bucket, check_checkpoint_directory, check_endpoint
from orchestrator.domain.workload import Count, Steps, Timeout, _Frozen
from orchestrator.errors import UnknownAcceleratorError
from workers.settings import TrainingSettings

MAX_SLICES = 4  # slices of one job (v4-16 x 4 is the 32 chips a job may take)


class CheckpointConfig(_Frozen):
    # An absolute path or a Cloud Storage URL gs://BUCKET/FOLDER; in a job file a relative path is
    # taken from the file's folder (not from where the command runs). None: on provider gcp
    # gs://<gcp.bucket>/checkpoints/<job name>, else $ORCHESTRATOR_HOME/checkpoints/<job name>.
    directory: str | None = None
    # With autoscaling, the longest interval: spot slices preempted often save sooner.
    interval_steps: Steps = TrainingSettings.checkpoint_interval
    # Each checkpoint is a full copy of the model and optimizer.
    keep: Annotated[int, Field(gt=0, le=1000)] = TrainingSettings.checkpoint_keep
    # A multi-slice job's copy of the state in its hosts' memory (what a lost slice is survived from):
    # auto, every step while that costs at most 2% of a step, else every k steps; or every N steps.
    memory_interval_steps: Literal["auto"] | Steps = "auto"

    @field_validator("directory")
    @classmethod
    def _path_or_bucket(cls, v: str | None) -> str | None:
        return None if v is None else check_checkpoint_directory(v)


class StorageConfig(_Frozen):
    """How every process of the job (controller side and hosts) reaches Cloud Storage (`workers.storage`)."""

    # The Cloud Storage JSON API's endpoint; None: Google's, with the machine's credentials. An
    # emulator's URL (http://127.0.0.1:PORT) for local runs and tests, whatever the provider.
    endpoint: str | None = None

    @field_validator("endpoint")
    @classmethod
    def _http_endpoint(cls, v: str | None) -> str | None:
        return None if v is None else check_endpoint(v)


class RecoveryConfig(_Frozen):
    max_preemptions: Count = 100  # preemptions and host losses
    max_failures: Count = 2  # the job's code raising or exiting non-zero, hangs, slices that could not start
    max_aborts: Count = 2  # worker processes that died on a live host (a native abort, a crash)
    heartbeat_timeout_s: Timeout = 120.0
    grace_period_s: Timeout = 30.0
    start_timeout_s: Timeout = 300.0  # for a slice's hosts to join and its workers to start
    # How often each host tells the controller it lives (`orchestrator.control.liveness`); a host is
    # probed after max(1 s, 4 periods) without one.
    beat_period_s: Annotated[float, Field(gt=0, le=5)] = 0.25
    # A multi-slice job that lost a slice asks for one again and, once it is READY beside the survivors,
    # goes back to `slices` at a committed step; false: it finishes on the survivors.
    regrow: bool = True
    # Where hosts long-poll for preemption notices; None: the GCE metadata server on gcp, none locally.
    metadata_url: str | None = None
    # Once a generation steps, each of its hosts starts the next generation's worker process, which a shrink
    # from memory or a relaunch on the same slices takes instead of starting one (`orchestrator.control.spares`).
    # None: the provider's default (on for gcp, off for local hosts, which are this machine's processes).
    spare_workers: bool | None = None


class GcpConfig(_Frozen):
    """Where and how `provider: gcp` gets slices (see the README's Google Cloud section)."""

    project: str
    zones: Annotated[list[str], Field(min_length=1)]  # tried in order when one has no capacity
    endpoint: str | None = None  # the TPU API; None: Google's. The emulator's URL for local runs
    reservation: str | None = None  # for tier: reserved
    service_account: str | None = None  # the TPU VMs' service account
    head_address: str | None = None  # the Ray head as the TPU VMs reach it; default: the cluster's address
    ray_token_secret: str | None = None  # Secret Manager secret with the Ray token, for the VMs
    # The bucket of the job's files when checkpoint.directory is left out: checkpoints go to
    # gs://<bucket>/checkpoints/<job name> (TPU VMs share no disk with this machine).
    bucket: str | None = None

    @field_validator("bucket")
    @classmethod
    def _bucket_name(cls, v: str | None) -> str | None:
        return None if v is None else check_bucket(v)


class AutoscalingConfig(_Frozen):
    """The slice types and tiers the cost policy may choose between (`orchestrator plan`)."""

    accelerators: Annotated[list[str], Field(min_length=1)] = ["v4-16", "v4-32", "v4-64"]
    tiers: Annotated[list[Tier], Field(min_length=1)] = [Tier.SPOT, Tier.ON_DEMAND]
    # Up to this many slices of one type at once (multi-slice, data parallel over DCN; 32 chips in all at
    # most): the policy chooses the count too. 1: one slice at a time.
    max_slices: Annotated[int, Field(ge=1, le=MAX_SLICES)] = 1

    @field_validator("accelerators")
    @classmethod
    def _known(cls, v: list[str]) -> list[str]:
        for name in v:
            try:
                catalog.lookup(name)
            except UnknownAcceleratorError as e:
                raise ValueError(str(e)) from None
        return v


class CapacityTraceConfig(_Frozen):
    """`provider: local` only: replay a spot trace as the job's spot capacity (`providers.capacity`)."""

    path: str  # a trace file, {"metadata": {"gap_seconds": G}, "data": [...]}; relative: from the job file's folder
    time_scale: Annotated[float, Field(gt=0, le=1e6)] = 60.0  # trace seconds per wall second (60: an hour a minute)
    start_s: Annotated[float, Field(ge=0)] = 0.0  # where in the trace the job starts
    grace_s: Annotated[float, Field(gt=0, le=3600)] = 30.0  # trace seconds from a reclaim notice to the hosts' end

    @field_validator("path")
    @classmethod
    def _a_trace(cls, v: str) -> str:
        from policies.evaluation.traces import load_trace

        load_trace(v)  # TraceError (a ValueError) names the file and what is wrong with it
        return v
