"""What a slice provider is: the interface the controller drives, and the records it returns.

A provider turns "a v4-32 on spot in us-central2-b" into hosts that have joined the
Ray cluster with the resources and labels that real TPU hosts get from Ray, so the
controller's scheduling code is the same on a laptop and on a pod:

- resource ``TPU: <chips per host>`` on every host,
- resource ``TPU-<type>-head: 1`` on worker 0 only,
- resource ``<slice name>: 1`` on every host (unique to the slice) and
  ``<slice name>-w<i>: 1`` on host i (unique to the host),
- labels ``ray.io/tpu-slice-name``, ``ray.io/tpu-worker-id``, ``ray.io/tpu-pod-type``.
"""

from __future__ import annotations

import builtins
import enum
import re
import threading
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from orchestrator.catalog import Tier, TpuType
from orchestrator.errors import ProvisioningError
from orchestrator.providers.capacity import SpotCapacity
from orchestrator.state.states import SliceState

SLICE_NAME_RE = re.compile(r"^[a-z][a-z0-9-]{0,61}[a-z0-9]$")


_calls = threading.local()


def give_up_on(event: threading.Event) -> None:
    """A provider call made on this thread that has to wait its turn (the gcp create pace) gives up once `event` is
    set, with `Abandoned`: a job's driver sets its cancel here, so a job cancelled while it waits ends at once."""
    _calls.give_up = event


def giving_up() -> threading.Event | None:
    """The event this thread's waiting provider calls give up on (`give_up_on`), if any."""
    return getattr(_calls, "give_up", None)


class CapacityError(ProvisioningError):
    """The provider has no room for the slice now (its hosts are busy, a zone is out of
    capacity): a fact about capacity, not a failure. The job waits in the queue and asks again."""

    def __init__(self, message: str, *, slice_name: str | None = None):
        super().__init__(message, slice_name=slice_name, transient=True)


class Abandoned(CapacityError):
    """A request given up before it reached the cloud: its job was cancelled while it waited its turn."""


@dataclass(frozen=True)
class SliceRequest:
    job_id: str
    name: str  # unique slice name, valid as a GCP resource id (lowercase, digits, dashes)
    tpu_type: TpuType
    tier: Tier
    zone: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    # How long the request may wait for capacity before it expires, unbilled (on GCP the queued
    # resource's own `validUntil`, so it expires even if the controller is gone); None: no limit.
    queue_timeout_s: float | None = None
    spot_capacity: SpotCapacity | None = None  # local provider only: a replayed trace as spot capacity


@dataclass(frozen=True)
class Host:
    worker_id: int
    resource: str  # the Ray resource unique to this host
    node_id: str | None = None  # the Ray node id once the host joined
    address: str | None = None  # the host's IP as Ray sees it


@dataclass(frozen=True)
class Slice:
    name: str
    job_id: str
    tpu_type: TpuType
    tier: Tier
    zone: str | None
    state: SliceState
    hosts: tuple[Host, ...] = ()
    provider: str = ""
    created_at: float = field(default_factory=time.time)


class SliceEventKind(str, enum.Enum):
    HOST_LOST = "host_lost"  # a host vanished without notice
    PREEMPTION_NOTICE = "preemption_notice"  # hosts still up, going away within the grace window
    RECLAIMED = "reclaimed"  # the provider took the slice back (queued resource suspended)
    NO_CAPACITY = "no_capacity"  # the request waits for capacity past its limit, or a stockout


@dataclass(frozen=True)
class SliceEvent:
    slice_name: str
    kind: SliceEventKind
    reason: str
    worker_id: int | None = None
    at: float = field(default_factory=time.time)


@runtime_checkable
class SliceProvider(Protocol):
    """Provision, watch and release TPU slices."""

    name: str

    def request(self, req: SliceRequest) -> Slice:
        """Start provisioning; returns at once with the slice in REQUESTED/WAITING/PROVISIONING."""

    def check(self, name: str) -> Slice:
        """One look, without blocking: the slice as it is now (moved on where it can be: hosts
        started once capacity came, READY once they joined). A request that expired or was
        refused is GONE, with a NO_CAPACITY event. Make-before-break polls this while the job
        trains on its current slice."""

    def wait_ready(self, name: str, *, timeout_s: float) -> Slice:
        """Block until every host of the slice has joined the Ray cluster.

        Raises ProvisioningError (``transient=True`` when the cause is capacity and another
        zone or size may work) and leaves nothing behind on failure.
        """

    def get(self, name: str) -> Slice:
        """The slice's current record; raises KeyError for an unknown name."""

    def release(self, name: str) -> None:
        """Give the slice back and remove its hosts; idempotent."""

    def list(self, *, job_id: str | None = None) -> list[Slice]:
        """Slices this provider knows of (those labelled by this tool, for cloud providers)."""

    def poll_events(self, *, slices: Collection[str] | None = None) -> builtins.list[SliceEvent]:
        """Events (host lost, notice, reclaim, no capacity) seen since the previous call, of the
        named slices only (all if None): a job's driver takes its own slices' events and leaves
        every other slice's for its own job."""


def slice_resource(slice_name: str) -> str:
    return f"slice-{slice_name}"


def host_resource(slice_name: str, worker_id: int) -> str:
    return f"slice-{slice_name}-w{worker_id}"


def host_node_resources(tpu_type: TpuType, slice_name: str, worker_id: int) -> dict[str, float]:
    """The Ray resources host `worker_id` of a slice carries, as on a real TPU VM."""
    res = {
        "TPU": float(tpu_type.chips_per_host),
        slice_resource(slice_name): 1.0,
        host_resource(slice_name, worker_id): 1.0,
    }
    if worker_id == 0:
        res[f"TPU-{tpu_type.name}-head"] = 1.0
    return res


def host_node_labels(tpu_type: TpuType, slice_name: str, worker_id: int) -> dict[str, str]:
    return {
        "ray.io/tpu-slice-name": slice_name,
        "ray.io/tpu-worker-id": str(worker_id),
        "ray.io/tpu-pod-type": tpu_type.name,
    }
