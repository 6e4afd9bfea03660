"""The store's records as its readers get them: a job, a slice, an event, a step's metrics, each frozen,
and how each is read from its SQLite row (`orchestrator.state.store` writes and reads the rows)."""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, TypeVar

from orchestrator.domain.shape import Shape
from orchestrator.domain.spec import JobSpec
from orchestrator.state.events import PAYLOADS, EventKind, Payload
from orchestrator.state.states import FailedBecause, JobState, SliceState

P = TypeVar("P", bound=Payload)


@dataclass(frozen=True)
class JobRecord:
    id: str
    name: str
    stored_spec: dict[str, Any]  # the spec's JSON as the store keeps it (`spec` is it parsed)
    state: JobState
    reason: str
    created_at: float
    updated_at: float
    generation: int
    preemptions: int
    failures: int
    cancel_requested: bool
    error: str | None
    result: dict[str, Any] | None
    cause: FailedBecause | None = None  # why a FAILED job failed
    stored_shape: list[Any] | None = None  # where the job runs now, if not where it was submitted to run

    @cached_property
    def submitted(self) -> JobSpec:
        """The spec as the user submitted it, typed (parsed on first read: a listing that shows names and
        states parses none). Never rewritten: a move, resize or autoscale changes `shape` only."""
        return JobSpec.from_stored(self.stored_spec)

    @cached_property
    def shape(self) -> Shape:
        """Where the job runs now (or would next): the slices of its last placement, else as submitted."""
        if self.stored_shape is not None:
            accelerator, tier, count = self.stored_shape
            return Shape(accelerator, tier, count)
        s = self.submitted
        return Shape(s.accelerator, s.tier.value, s.slices)

    @property
    def placed_json(self) -> dict[str, Any]:
        """The stored spec's JSON placed where the job runs now, unparsed: what views that must never fail
        on a row they cannot parse (status, the dashboard, metrics) show as its slices."""
        if self.stored_shape is None:
            return self.stored_spec
        accelerator, tier, count = self.stored_shape
        return {**self.stored_spec, "accelerator": accelerator, "tier": tier, "slices": count}

    @cached_property
    def spec(self) -> JobSpec:
        """The submitted spec placed on `shape`: what the next launch runs (everything but the slices is
        the user's)."""
        s, shape = self.submitted, self.shape
        if shape == Shape(s.accelerator, s.tier.value, s.slices):
            return s
        return s.moved(shape.accelerator, shape.tier, slices=shape.count)


@dataclass(frozen=True)
class SliceRow:
    """A slice as the store keeps it: the provider's last word on it."""

    name: str
    job_id: str
    provider: str  # "local" or "gcp"
    accelerator: str
    tier: str
    state: SliceState
    data: dict[str, Any]  # the provider's: "hosts" (each host's resource, rank order), "pgids" (local), "zone"
    updated_at: float


@dataclass(frozen=True)
class Event:
    seq: int
    job_id: str
    at: float
    kind: EventKind
    from_state: JobState | None  # a STATE event's move; None for every other kind
    to_state: JobState | None
    reason: str
    data: dict[str, Any] | None

    @property
    def payload(self) -> Payload:
        """The event's record (`orchestrator.state.events`), as it was written."""
        return PAYLOADS[self.kind].from_data(self.data)

    def payload_as(self, cls: type[P]) -> P:
        """The event's record as `cls`, the record class of the kind the caller checked (any other is a bug)."""
        payload = self.payload
        if not isinstance(payload, cls):
            raise TypeError(f"job {self.job_id}: event {self.seq} is a {self.kind.value} event, not {cls.__name__}")
        return payload


@dataclass(frozen=True)
class StepMetric:
    step: int
    generation: int
    loss: float
    tokens_per_s: float | None
    step_time_s: float | None
    at: float
    # The program's own metrics and the loop's (tflops_per_chip, mfu, hbm_in_use_gib, hbm_peak_gib).
    metrics: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_row(cls, row: sqlite3.Row | tuple[Any, ...]) -> StepMetric:
        step, generation, loss, tokens_per_s, step_time_s, at, metrics = tuple(row)
        return cls(step, generation, loss, tokens_per_s, step_time_s, at, json.loads(metrics) if metrics else {})


def event_from_row(r: sqlite3.Row) -> Event:
    return Event(r["seq"], r["job_id"], r["at"], EventKind(r["kind"]),
                 JobState(r["from_state"]) if r["from_state"] else None,
                 JobState(r["to_state"]) if r["to_state"] else None,
                 r["reason"], json.loads(r["data"]) if r["data"] else None)


def job_from_row(row: sqlite3.Row, *, same_spec_as: JobRecord | None = None) -> JobRecord:
    """The job of `row`; `same_spec_as`: a record read from the same spec and shape text, whose JSON is
    taken as parsed (never changed in place) instead of parsing it again."""
    like = same_spec_as
    return JobRecord(
        id=row["id"], name=row["name"], stored_spec=like.stored_spec if like else json.loads(row["spec"]),
        state=JobState(row["state"]),
        reason=row["reason"], created_at=row["created_at"], updated_at=row["updated_at"],
        generation=row["generation"], preemptions=row["preemptions"], failures=row["failures"],
        cancel_requested=bool(row["cancel_requested"]), error=row["error"],
        result=json.loads(row["result"]) if row["result"] else None,
        cause=FailedBecause(row["cause"]) if row["cause"] in FailedBecause._value2member_map_ else None,
        stored_shape=like.stored_shape if like else json.loads(row["shape"]) if row["shape"] else None,
    )
