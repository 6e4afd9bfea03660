"""What the emulator stores, and how each record is rendered as the real API's JSON.

Records are frozen; the world replaces a record on every change. Rendering builds the
client library's own message types (``google.cloud.tpu_v2``) and serializes them, so
every field name in a response is one the real client knows.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass
from typing import Any

from google.cloud import tpu_v2

from orchestrator.emulator.errors import ApiError

_TYPE_PREFIX = "type.googleapis.com/"


def _ts(t: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(t, tz=dt.timezone.utc)


def _copy(msg):
    return type(msg).deserialize(type(msg).serialize(msg))


def to_dict(msg, int_enums: bool = False) -> dict[str, Any]:
    # No empty defaults, and enums by name unless the client asked for numbers
    # (the REST transport sends ``$alt=json;enum-encoding=int``): as the service does.
    return json.loads(
        type(msg).to_json(msg, use_integers_for_enums=int_enums, always_print_fields_with_no_presence=False)
    )


@dataclass(frozen=True)
class NodeRecord:
    name: str  # projects/P/locations/Z/nodes/N
    zone: str
    spec: tpu_v2.Node  # the node as requested; never mutated
    worker_count: int
    state: str
    uid: int
    create_time: float
    queued_resource: str = ""  # the owning queued resource's name, or ""
    spot: bool = False
    due: float | None = None  # monotonic time of this node's next automatic move
    announced: bool = False  # on_node_ready was called, so on_node_gone is owed

    @property
    def node_id(self) -> str:
        return self.name.rsplit("/", 1)[1]

    def render(self, int_enums: bool = False) -> dict[str, Any]:
        node = _copy(self.spec)
        node.name = self.name
        node.state = tpu_v2.Node.State[self.state]  # type: ignore[misc]  # proto-plus enums are typed as plain classes
        node.id = self.uid
        node.create_time = _ts(self.create_time)
        node.api_version = tpu_v2.Node.ApiVersion.V2
        node.queued_resource = self.queued_resource
        if self.spot:
            node.scheduling_config = tpu_v2.SchedulingConfig(spot=True)
        if self.state == "READY":
            node.health = tpu_v2.Node.Health.HEALTHY
            # One endpoint per worker (host), in worker order, as on a real slice.
            node.network_endpoints = [
                tpu_v2.NetworkEndpoint(ip_address=f"10.{(self.uid >> 8) & 255}.{self.uid & 255}.{i + 2}", port=8470)
                for i in range(self.worker_count)
            ]
        return to_dict(node, int_enums)


@dataclass(frozen=True)
class QueuedResourceRecord:
    name: str  # projects/P/locations/Z/queuedResources/Q
    zone: str
    spec: tpu_v2.QueuedResource  # as requested; never mutated
    accelerator_type: str
    node_name: str  # the one node this queued resource requests
    state: str
    create_time: float  # wall time, as rendered
    queued_at: float  # the world's clock (monotonic or manual) at creation: validUntil counts from it
    initiator: str = "STATE_INITIATOR_UNSPECIFIED"
    error: tuple[int, str] | None = None  # (google.rpc.Code, message) once FAILED
    due: float | None = None

    def render(self, int_enums: bool = False) -> dict[str, Any]:
        qr = _copy(self.spec)
        qr.name = self.name
        qr.create_time = _ts(self.create_time)
        S = tpu_v2.QueuedResourceState
        # proto-plus enums are typed as plain classes, so mypy takes an enum's [name] for a generic's.
        state = S(state=S.State[self.state], state_initiator=S.StateInitiator[self.initiator])  # type: ignore[misc]
        # The oneof state_data names the state's own data message, as the service fills it.
        data_field = {
            "CREATING": "creating_data",
            "ACCEPTED": "accepted_data",
            "PROVISIONING": "provisioning_data",
            "FAILED": "failed_data",
            "DELETING": "deleting_data",
            "ACTIVE": "active_data",
            "SUSPENDING": "suspending_data",
            "SUSPENDED": "suspended_data",
        }.get(self.state)
        if self.state == "FAILED" and self.error:
            state.failed_data = S.FailedData(error={"code": self.error[0], "message": self.error[1]})
        elif data_field:
            setattr(state, data_field, getattr(S, _camel_class(data_field))())
        qr.state = state
        return to_dict(qr, int_enums)


def _camel_class(field: str) -> str:
    return "".join(p.capitalize() for p in field.split("_"))


@dataclass(frozen=True)
class OperationRecord:
    name: str  # projects/P/locations/Z/operations/operation-N
    verb: str  # create | delete
    target: str  # the resource's name
    create_time: float
    done: bool = False
    response: NodeRecord | QueuedResourceRecord | None = None  # the resource as it was when done
    error: ApiError | None = None
    end_time: float | None = None

    def render(self, int_enums: bool = False) -> dict[str, Any]:
        meta = tpu_v2.OperationMetadata(
            create_time=_ts(self.create_time), target=self.target, verb=self.verb, api_version="v2"
        )
        if self.end_time is not None:
            meta.end_time = _ts(self.end_time)
        out: dict[str, Any] = {
            "name": self.name,
            "metadata": {"@type": _TYPE_PREFIX + "google.cloud.tpu.v2.OperationMetadata", **to_dict(meta)},
            "done": self.done,
        }
        if self.done and self.error is not None:
            out["error"] = {"code": _RPC_CODES.get(self.error.status, 2), "message": self.error.message}
        elif self.done and self.response is not None:
            # A google.protobuf.Any: the message's type URL beside its fields.
            kind = "Node" if isinstance(self.response, NodeRecord) else "QueuedResource"
            out["response"] = {"@type": f"{_TYPE_PREFIX}google.cloud.tpu.v2.{kind}", **self.response.render(int_enums)}
        elif self.done:
            out["response"] = {"@type": _TYPE_PREFIX + "google.protobuf.Empty"}
        return out


# google.rpc.Code numbers of the statuses the emulator uses in operation errors.
_RPC_CODES = {
    "INVALID_ARGUMENT": 3,
    "DEADLINE_EXCEEDED": 4,
    "NOT_FOUND": 5,
    "ALREADY_EXISTS": 6,
    "PERMISSION_DENIED": 7,
    "RESOURCE_EXHAUSTED": 8,
    "FAILED_PRECONDITION": 9,
    "ABORTED": 10,
    "INTERNAL": 13,
    "UNAVAILABLE": 14,
}
RESOURCE_EXHAUSTED = _RPC_CODES["RESOURCE_EXHAUSTED"]
