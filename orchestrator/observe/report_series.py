"""What a job's report shows, as plain numbers: its steps, states, slices, cost and markers over time."""

from __future__ import annotations

import time
from dataclasses import dataclass

from orchestrator.errors import RequestError
from orchestrator.observe.billing import BilledSlice, billed_slices
from orchestrator.observe.goodput import Goodput, compute_goodput
from orchestrator.observe.goodput_intervals import StateInterval, state_intervals
from orchestrator.observe.timeline import Marker
from orchestrator.observe.timeline import markers as timeline_markers
from orchestrator.state.events import EventKind, Profiled
from orchestrator.state.store import Event, StepMetric, Store


class NoStepsError(RequestError, ValueError):
    """A report was asked for a job that has not reported a single training step."""

    def __init__(self, job_id: str):
        self.job_id = job_id
        super().__init__(f"job {job_id!r} has no recorded steps yet; there is nothing to plot")


@dataclass(frozen=True)
class ReportSeries:
    """Everything the picture shows, as plain numbers (times are Unix seconds)."""

    job_id: str
    name: str
    state: str
    start: float  # the job's submission
    end: float  # its end (or now), or the last slice release if later
    states: tuple[StateInterval, ...]
    step_at: tuple[float, ...]  # when each kept step was reported
    step: tuple[int, ...]
    generation: tuple[int, ...]
    loss: tuple[float, ...]
    tokens_per_s: tuple[float | None, ...]
    metrics: tuple[dict, ...]  # each step's other figures (MFU, HBM, the program's own)
    slices: tuple[BilledSlice, ...]
    chips_at: tuple[float, ...]  # a step function: `chips[i]` chips held from `chips_at[i]` on
    chips: tuple[int, ...]
    cost_at: tuple[float, ...]  # cumulative dollars, linear between these points
    cost_usd: tuple[float, ...]
    markers: tuple[Marker, ...]
    goodput: Goodput


def report_series(store: Store, job_id: str, *, now: float | None = None) -> ReportSeries:
    """The series of job `job_id`'s report; raises `NoStepsError` if it has no steps."""
    job, events, steps = store.job(job_id), store.events(job_id), store.steps(job_id)
    if not steps:
        raise NoStepsError(job_id)
    now = time.time() if now is None else now
    g = compute_goodput(job, events, steps, now=now)
    slices = tuple(billed_slices(events, end=g.end))
    end = max([g.end] + [s.end for s in slices])
    changes = sorted({g.start, end} | {t for s in slices for t in (s.start, s.end) if g.start <= t <= end})
    return ReportSeries(
        job_id=job.id, name=job.name, state=job.state.value, start=g.start, end=end,
        states=tuple(iv for iv in state_intervals(job, events, now=now) if iv.end > iv.start),
        step_at=tuple(s.at for s in steps), step=tuple(s.step for s in steps),
        generation=tuple(s.generation for s in steps), loss=tuple(s.loss for s in steps),
        tokens_per_s=tuple(s.tokens_per_s for s in steps), metrics=tuple(s.metrics for s in steps), slices=slices,
        chips_at=tuple(changes), chips=tuple(sum(s.chips for s in slices if s.start <= t < s.end) for t in changes),
        cost_at=tuple(changes), cost_usd=tuple(sum(s.usd_until(t) for s in slices) for t in changes),
        markers=tuple(_markers(events, steps)), goodput=g)


def _markers(events: list[Event], steps: list[StepMetric]) -> list[Marker]:
    out = timeline_markers(events, steps)
    for e in events:
        if e.kind is not EventKind.PROFILE:
            continue
        p = e.payload_as(Profiled)
        if p.path and p.steps and p.first_step is not None:  # a capture that traced names its first step
            out.append(Marker(e.at, p.first_step, "profile",
                              f"profile steps {p.first_step}-{p.first_step + p.steps - 1}", e.reason))
    return sorted(out, key=lambda m: m.at)
