"""How goodput cuts a job's wall time: its state intervals, and the measured work each interval holds."""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from orchestrator.state.events import CheckpointSaved, EventKind, LostWork, Restored, SliceChanged, StateChange
from orchestrator.state.store import Event, JobRecord, StepMetric

# The only state in which the job's workers are up: the controller enters RESIZING and
# RECOVERING after it has stopped them, so work reported then is late news of the run before.
_WORK_STATES = ("RUNNING",)
_BASE_CATEGORY = {"PENDING": "waiting_for_capacity", "QUEUED": "waiting_for_capacity", "PROVISIONING": "provisioning",
                  "STARTING": "runtime_init"}


@dataclass(frozen=True)
class StateInterval:
    """The job was in `state` from `start` to `end`."""

    state: str
    start: float
    end: float
    entry_outcome: str | None  # `outcome` of the event that began it (set on ->RECOVERING)
    exit_outcome: str | None  # `outcome` of the event that ended it

    @property
    def base_category(self) -> str:
        if self.state == "PROVISIONING" and self.exit_outcome in ("provision_failed", "no_capacity"):
            return "waiting_for_capacity"  # asked for a slice that did not come
        if self.state == "RECOVERING" and self.entry_outcome == "provision_failed":
            return "waiting_for_capacity"  # the back-off before asking again
        return _BASE_CATEGORY.get(self.state, "idle")


def state_intervals(job: JobRecord, events: list[Event], *, now: float) -> list[StateInterval]:
    """The job's states as intervals tiling [created, end]; a terminal state's interval is empty."""
    changes = [e for e in events if e.kind is EventKind.STATE and e.to_state]
    if not changes:  # a job row without its creation event: all of it is one PENDING stretch
        return [StateInterval("PENDING", job.created_at, max(now, job.created_at), None, None)]
    starts = [job.created_at]
    for e in changes[1:]:
        starts.append(max(e.at, starts[-1]))  # a clock step backwards must not make a negative interval
    end = starts[-1] if job.state.terminal else max(now, starts[-1])
    ends = starts[1:] + [end]
    states = [e.to_state.value for e in changes if e.to_state]  # all of them (changes have a to_state)
    outcomes = [e.payload_as(StateChange).outcome for e in changes]
    return [StateInterval(state, s, t, outcomes[i], outcomes[i + 1] if i + 1 < len(changes) else None)
            for i, (state, s, t) in enumerate(zip(states, starts, ends, strict=True))]


_Claim = Callable[[int, str, Any], None]  # (interval index, category, seconds): measured work put in an interval


def claims(intervals: list[StateInterval], events: list[Event],
            steps: list[StepMetric]) -> tuple[dict[int, list], list[StepMetric]]:
    """Measured work as {interval index: [(category, seconds), ...]}, and the step rows kept as productive."""
    claimed: dict[int, list] = {}

    def claim(i: int, category: str, seconds: Any) -> None:
        if seconds:
            claimed.setdefault(i, []).append((category, float(seconds)))

    starts = [iv.start for iv in intervals]
    _claim_waiting(intervals, events, claim)
    compiles_in_first_step = _claim_events(intervals, starts, events, claim)
    stale = _stale_ranges(events)
    kept = [s for s in steps if not any(s.step in steps_range and s.at < at for at, steps_range in stale)]
    _claim_steps(intervals, starts, kept, compiles_in_first_step, claim)
    return claimed, kept


def _claim_waiting(intervals: list[StateInterval], events: list[Event], claim: _Claim) -> None:
    """A slice queued without capacity while the job was provisioning: that part of it was waiting."""
    for i, iv in enumerate(intervals):
        if iv.base_category == "provisioning":
            for w0, w1 in _waiting_windows(events, iv.end):
                claim(i, "waiting_for_capacity", max(0.0, min(w1, iv.end) - max(w0, iv.start)))


def _claim_events(intervals: list[StateInterval], starts: list[float], events: list[Event],
                  claim: _Claim) -> set[int]:
    """Restores, compiles, checkpoint saves and lost work as their events measured them; returns the intervals
    whose launch compiled its program in the first step (a restore that measured no compile)."""
    compiles_in_first_step = set()
    for e in events:
        if e.kind is EventKind.RESTORE:
            restored = e.payload_as(Restored)
            claim(_work_interval(intervals, starts, e.at), "restore", restored.restore_s)
            claim(_work_interval(intervals, starts, e.at), "compile", restored.compile_s)
            if not restored.compile_s:
                compiles_in_first_step.add(_work_interval(intervals, starts, e.at))
        elif e.kind is EventKind.CHECKPOINT:
            claim(_work_interval(intervals, starts, e.at), "checkpoint_save", e.payload_as(CheckpointSaved).blocking_s)
        elif e.kind is EventKind.LOST_WORK:
            claim(_previous_run(intervals, starts, e.at), "lost_work", e.payload_as(LostWork).seconds)
    return compiles_in_first_step


def _claim_steps(intervals: list[StateInterval], starts: list[float], kept: list[StepMetric],
                 compiles_in_first_step: set[int], claim: _Claim) -> None:
    """Each step's time as productive, less a launch's first step's time above the median (its warm-up: the
    compile where the launch compiled then, else the runtime's start)."""
    times = sorted(s.step_time_s for s in kept if s.step_time_s)
    median = times[len(times) // 2] if times else 0.0
    first_step: dict[int, int] = {}  # rows are one per step; a launch's first step is its generation's lowest
    for s in kept:
        first_step[s.generation] = min(first_step.get(s.generation, s.step), s.step)
    for s in kept:
        i, dt = _work_interval(intervals, starts, s.at), s.step_time_s or 0.0
        warm_up = max(0.0, dt - median) if first_step[s.generation] == s.step else 0.0
        claim(i, "compile" if i in compiles_in_first_step else "runtime_init", warm_up)
        claim(i, "productive", dt - warm_up)


def _work_interval(intervals: list[StateInterval], starts: list[float], t: float) -> int:
    """The latest RUNNING interval begun by `t`; else the interval holding `t`."""
    holding = max(0, bisect.bisect_right(starts, t) - 1)
    for i in range(holding, -1, -1):
        if intervals[i].state in _WORK_STATES:
            return i
    return holding


def _previous_run(intervals: list[StateInterval], starts: list[float], t: float) -> int:
    """The latest RUNNING interval that had ended by `t` (lost work is reported after the restore)."""
    for i in range(len(intervals) - 1, -1, -1):
        if intervals[i].state in _WORK_STATES and intervals[i].end <= t and intervals[i].end > intervals[i].start:
            return i
    return _work_interval(intervals, starts, t)


def _stale_ranges(events: list[Event]) -> list[tuple[float, range]]:
    """(reported at, step indices) of lost_work events: rows of those steps written before will be recomputed.

    `from_step` and `to_step` bound the lost steps in either order (the controller
    writes from the disrupted step back to the restored one); without `to_step`, the
    `steps` steps from `from_step` on.
    """
    out = []
    for e in events:
        if e.kind is not EventKind.LOST_WORK:
            continue
        lost = e.payload_as(LostWork)
        if lost.from_step is None:
            continue
        a = int(lost.from_step)
        b = int(lost.to_step) if lost.to_step is not None else a + int(lost.steps or 0)
        out.append((e.at, range(min(a, b), max(a, b))))
    return out


def _waiting_windows(events: list[Event], end: float) -> list[tuple[float, float]]:
    """[from, to) windows in which one of the job's slices was WAITING."""
    windows: list[tuple[float, float]] = []
    waiting_since: dict[str | None, float] = {}
    for e in events:
        if e.kind is not EventKind.SLICE:
            continue
        changed = e.payload_as(SliceChanged)
        name, state = changed.name, changed.state
        if name in waiting_since:
            windows.append((waiting_since.pop(name), e.at))
        if state == "WAITING":
            waiting_since[name] = e.at
    return windows + [(t, end) for t in waiting_since.values()]

