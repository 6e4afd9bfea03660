"""What happened to a job, as a person reads it: labelled markers, disruption causes, a move under way.

Shared by the report (`orchestrator.observe.report`), the dashboard
(`orchestrator.observe.dashboard`) and the terminal (`orchestrator status`), so the three
name each event the same way. Pure functions over store rows.

Marker kinds (each has its own colour and line style wherever it is drawn):

- ``preemption``: the provider took the slice back (with or without a notice)
- ``host_lost``: a host of the slice vanished
- ``worker_crash``: a worker process died, or stopped answering, on a host still up
- ``hung``: no progress for the heartbeat timeout
- ``failure``: the job's own code raised on healthy hosts
- ``restore``: the workers restored a checkpoint
- ``checkpoint``: a checkpoint was saved
- ``move``: a resize or a move to another slice type or tier
- ``adoption``: a restarted controller adopted the running workers
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass
from typing import TypeVar

from orchestrator.state.events import (
    CheckpointSaved,
    DeadlineForecast,
    Disrupted,
    EventKind,
    Launched,
    Planned,
    ResizeAsked,
    Restored,
    StateChange,
)
from orchestrator.state.states import JobState, SliceState
from orchestrator.state.store import Event, JobRecord, StepMetric, Store
from policies.decisions.recovery import HUNG, WORKER_DIED, WORKER_UNREACHABLE

G = TypeVar("G", Launched, Planned)  # an event's record that names its generation

MARKER_KINDS = ("preemption", "host_lost", "worker_crash", "hung", "failure", "restore", "checkpoint", "move",
                "adoption")
MARKER_TITLES = {"preemption": "preemption", "host_lost": "host lost", "worker_crash": "worker crash",
                 "hung": "worker hung", "failure": "program failed", "restore": "restore",
                 "checkpoint": "checkpoint saved", "move": "move", "adoption": "controller adopted"}
DISRUPTION_KINDS = ("preemption", "host_lost", "worker_crash", "hung", "failure")
SAVE = "checkpoint"  # the marker kind of a checkpoint save (a marker kind, not an event kind)


@dataclass(frozen=True)
class Marker:
    at: float  # Unix seconds
    step: int | None  # the step it happened at (the first step after it), where known
    kind: str  # one of MARKER_KINDS
    label: str  # short, for the picture ("preempted", "restored step 40")
    reason: str = ""  # the event's own sentence


def disruption_cause(kind: str | None, reason: str | None) -> str | None:
    """The marker kind of a disruption (an `OutcomeKind` value and its reason), or None if not one.

    A host that vanished and a worker process that died on a host still up are both
    INFRA_LOST to the recovery rules (both count against `max_preemptions`), but they
    are different stories: the reason says which.
    """
    reason = reason or ""
    if kind == "preempted":
        return "preemption"
    if kind in ("app_failed", "user_exit", "import_error", "storage_failed", "platform_failed"):
        return "failure"
    if kind == "worker_aborted":
        return "worker_crash"
    if kind == "hung":
        return "hung"
    if kind == "infra_lost":
        if reason.startswith((WORKER_DIED, WORKER_UNREACHABLE)):
            return "worker_crash"
        if reason.rstrip().endswith(HUNG):
            return "hung"
        return "host_lost"
    return None


def step_at(steps_at: list[float], steps: list[int], t: float) -> int | None:
    """The step a job had reached (steps done) at time `t`, from its step rows (sorted by time)."""
    i = bisect.bisect_right(steps_at, t)
    return steps[i - 1] + 1 if i else (0 if steps else None)


def markers(events: list[Event], steps: list[StepMetric] | None = None, *,
            checkpoints: bool = True) -> list[Marker]:
    """Every marker of the job's life, oldest first (see the module doc); `steps` places the
    markers whose event names no step."""
    rows = sorted(steps or [], key=lambda s: s.at)
    steps_at, step_no = [s.at for s in rows], [s.step for s in rows]

    def where(e: Event, step: int | None) -> int | None:
        return int(step) if step is not None else step_at(steps_at, step_no, e.at)

    out: list[Marker] = []
    recorded = any(e.kind is EventKind.DISRUPTION for e in events)
    has_resize_events = any(e.kind is EventKind.RESIZE for e in events)
    for e in events:
        k = e.kind
        if k is EventKind.DISRUPTION:
            p = e.payload_as(Disrupted)
            cause = disruption_cause(p.kind, p.reason)
            if cause is not None:
                after = None if p.step is None else int(p.step) + 1
                out.append(Marker(e.at, where(e, after), cause, _CAUSE_LABEL[cause], e.reason))
        elif k is EventKind.STATE and e.to_state is JobState.RECOVERING and not recorded:  # an older store's record
            cause = disruption_cause(e.payload_as(StateChange).outcome, e.reason)
            if cause is not None:
                out.append(Marker(e.at, where(e, None), cause, _CAUSE_LABEL[cause], e.reason))
        elif k is EventKind.STATE and e.to_state is JobState.RESIZING and not has_resize_events:
            out.append(Marker(e.at, where(e, None), "move", "resizing", e.reason))
        elif k is EventKind.RESTORE and (restored := e.payload_as(Restored).restored_step) is not None:
            step = int(restored)  # a fresh start (no restored step) is nothing to mark
            out.append(Marker(e.at, step, "restore", f"restored step {step}", e.reason))
        elif k is EventKind.CHECKPOINT and checkpoints and (saved := e.payload_as(CheckpointSaved).step) is not None:
            step = int(saved)
            out.append(Marker(e.at, step, "checkpoint", f"saved step {step}", e.reason))
        elif k is EventKind.RESIZE:
            r = e.payload_as(ResizeAsked)
            tier = f" {r.tier}" if r.tier else ""
            out.append(Marker(e.at, where(e, r.step), "move", f"move {r.from_accelerator or '?'} → {r.to or '?'}{tier}",
                              e.reason))
        elif k is EventKind.ADOPTED:
            out.append(Marker(e.at, where(e, None), "adoption", "controller restarted, adopted", e.reason))
    return sorted(out, key=lambda m: m.at)


_CAUSE_LABEL = {"preemption": "preempted", "host_lost": "host lost", "worker_crash": "worker crashed",
                "hung": "worker hung", "failure": "program failed"}


def wall_time(store: Store, job: JobRecord, *, now: float | None = None) -> float:
    """Seconds from the job's submission to its end (its last state change), or to `now` while it runs."""
    if job.state.terminal:
        change = store.last_event(job.id, EventKind.STATE)
        end = change.at if change is not None else job.updated_at
    else:
        end = time.time() if now is None else now
    return max(0.0, end - job.created_at)


# -- a move under way ----------------------------------------------------------------------

_WAITING_PHASE = {SliceState.REQUESTED: "requesting the slice",
                  SliceState.WAITING: "waiting for capacity",
                  SliceState.PROVISIONING: "starting its hosts",
                  SliceState.READY: "slice ready, switching at the next checkpoint"}


def move_line(store: Store, job: JobRecord) -> str | None:
    """What a move of the job is doing now ("moving to v4-32 spot: waiting for capacity"), or None.

    A move is under way from a resize (the user's, or a switch the cost policy makes) or a
    request waiting beside the running slice (make-before-break), until the job runs again.
    """
    if job.state.terminal or job.state in (JobState.PENDING, JobState.RECOVERING):
        return None
    ran = store.last_event(job.id, EventKind.STATE, to_state=JobState.RUNNING)
    running_since = ran.seq if ran is not None else 0
    since = store.events(job.id, after_seq=running_since)  # what happened since the job last ran: a few events
    asked = [e for e in since if e.kind is EventKind.RESIZE]
    live = store.slices(job_id=job.id, live_only=True)
    if job.state is JobState.RUNNING:
        launch = _of_generation(store, job, EventKind.LAUNCHED, Launched)
        running = set(launch.slice_names or [launch.slice or ""]) if launch is not None else set()
        beside = [r for r in live if r.name not in running]  # a multi-slice job's other slices are not a move
        if asked:
            r = asked[-1].payload_as(ResizeAsked)
            target = f"{r.to} {r.tier}" if r.tier else str(r.to)
            step = f" (step {r.step})" if r.step is not None else ""
            return f"moving to {target}: checkpointing{step}, then the old slice goes"
        if beside:
            b = beside[-1]
            return f"moving to {b.accelerator} {b.tier}: {_WAITING_PHASE.get(b.state, b.state.value.lower())}"
        return None
    # RESIZING, QUEUED, PROVISIONING, STARTING: only after a resize since the job last ran
    moved = [e for e in since if e.kind is EventKind.STATE and e.to_state is JobState.RESIZING]
    if not moved and not asked:
        return None
    target = f"{job.placed_json.get('accelerator', '?')} {job.placed_json.get('tier', '')}".strip()
    phase = {JobState.RESIZING: "releasing the old slice",
             JobState.QUEUED: "waiting for capacity",
             JobState.PROVISIONING: "provisioning",
             JobState.STARTING: "starting the workers, then restoring resharded"}[job.state]
    if job.state is JobState.PROVISIONING and live:
        phase = _WAITING_PHASE.get(live[-1].state, phase) if live[-1].state is not SliceState.READY else phase
    return f"moving to {target}: {phase}"


def _of_generation(store: Store, job: JobRecord, kind: EventKind, record: type[G]) -> G | None:
    """The newest `kind` event of the job's current generation, as `record`: the newest of its kind is (one row
    read), but for a job already launching its next generation, whose events are then looked through."""
    newest = store.last_event(job.id, kind)
    if newest is None or (got := newest.payload_as(record)).generation == job.generation:
        return None if newest is None else got
    found = [p for e in store.events(job.id, kind=kind) if (p := e.payload_as(record)).generation == job.generation]
    return found[-1] if found else None


def deadline_line(store: Store, job: JobRecord) -> str | None:
    """While the job's last deadline forecast says it is late: "will miss its deadline: ..."; else None."""
    forecast = store.last_event(job.id, EventKind.DEADLINE)
    if forecast is None or (forecast.payload_as(DeadlineForecast).late_by_s or 0.0) <= 0:
        return None
    return f"will miss its deadline: {forecast.reason}"


def plan_line(store: Store, job: JobRecord) -> str | None:
    """The launch plan of the job's current generation, as it was recorded when that generation was launched
    ("gen 3 on 2 x v4-16 spot, mesh (4,2,1), 2 microbatches, checkpoint every 50 steps"); None before its first
    launch, or for a generation launched by a version that recorded none."""
    plan = _of_generation(store, job, EventKind.PLAN, Planned)
    return plan.line if plan is not None else None
