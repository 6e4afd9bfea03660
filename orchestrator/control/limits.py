"""A job's budget cap and deadline forecast, checked while it runs (`policies.decisions.limits` decides).

The driver holds one `Limits` per job. Once a poll (at most every `CHECK_S`) it asks
whether the job may train on within `budget_usd`; when not, the hosts stop after an agreed
step with its checkpoint committed, as for a notice, and the job ends FAILED_BUDGET.
Before a slice is started, it asks whether the budget left pays for a start. A job with a
`deadline` and no autoscaling gets a DEADLINE event when, at its measured speed, it turns
late (and again when it is back in time); `status` shows the last one while it is late.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable

from orchestrator import catalog
from orchestrator.control.attempt import Attempt
from orchestrator.domain.spec import JobSpec
from orchestrator.observe.goodput import billed_slices, format_duration
from orchestrator.state.events import DeadlineForecast
from orchestrator.state.protocol import JobStore
from policies.decisions.limits import budget_refuses_start, budget_stop, forecast, step_seconds
from policies.decisions.recovery import Outcome, OutcomeKind

log = logging.getLogger(__name__)

CHECK_S = 1.0
RELEASE_S = 10.0  # from the hosts' stop to the slice given back, at most (counted as spent)
MARKS = 50  # (time, step) marks the speed is measured over


class Limits:
    def __init__(self, store: JobStore, job_id: str):
        self.store, self.job_id = store, job_id
        self.budget_stop: str | None = None  # why the running attempt was asked to stop for the budget
        self._next_check = 0.0
        self._marks: collections.deque[tuple[float, int]] = collections.deque(maxlen=MARKS)
        self._late: bool | None = None  # what the last forecast said; None before the first

    # -- fed by the driver ------------------------------------------------------------------

    def new_attempt(self) -> None:
        self.budget_stop = None
        self._marks.clear()  # another slice, another speed

    def stepped(self, step: int) -> None:
        self._marks.append((time.time(), step))

    # -- asked by the driver ----------------------------------------------------------------

    def before_start(self, spec: JobSpec) -> Outcome | None:
        """BUDGET_SPENT when the budget left does not pay for a start on `spec`'s slice, else None."""
        if spec.budget_usd is None:
            return None
        why = budget_refuses_start(spent_usd=self._spent(), usd_per_hour=_usd_per_hour(spec, spec.slices),
                                   cap_usd=spec.budget_usd, stop_s=_stop_s(spec))
        return None if why is None else Outcome(OutcomeKind.BUDGET_SPENT, f"{why}; no slice started")

    def check(self, att: Attempt, spec_of: Callable[[], JobSpec]) -> None:
        """Once a poll: stop the attempt for the budget if it must, and forecast the deadline."""
        now = time.monotonic()
        if now < self._next_check or not att.started:
            return
        self._next_check = now + CHECK_S
        spec = spec_of()
        if spec.budget_usd is not None and self.budget_stop is None and att.notice is None:
            why = budget_stop(spent_usd=self._spent(), usd_per_hour=_usd_per_hour(spec, max(1, len(att.slices))),
                              cap_usd=spec.budget_usd, stop_s=_stop_s(spec))
            if why is not None:
                log.info("job %s: stopping for the budget: %s", self.job_id, why)
                self.budget_stop = why
                att.stop_requested(f"the budget: {why}")
        if spec.deadline is not None and spec.autoscaling is None:
            self._forecast(spec, att)

    def outcome(self, outcome: Outcome) -> Outcome:
        """The attempt's outcome as the budget makes it: a stop asked for the budget ends the job."""
        if self.budget_stop is None or outcome.kind is not OutcomeKind.PREEMPTED:
            return outcome
        how = outcome.reason.rsplit("; ", 1)[-1]  # "stopped after step N with its checkpoint committed"
        return Outcome(OutcomeKind.BUDGET_SPENT, f"{self.budget_stop}; {how}", at=outcome.at)

    # -- inside -----------------------------------------------------------------------------

    def _spent(self) -> float:
        """What `status` counts as cost (goodput's usd_total), from the slice events alone: asked once a second,
        it reads no step rows."""
        return sum(s.usd for s in billed_slices(self.store.events(self.job_id), end=time.time()))

    def _forecast(self, spec: JobSpec, att: Attempt) -> None:
        step_s = step_seconds(list(self._marks))
        if step_s is None or len(self._marks) < 5 or spec.workload.steps is None:
            return
        assert spec.deadline is not None, "forecast only for a job with a deadline (the caller checks)"
        job = self.store.job(self.job_id)
        f = forecast(elapsed_s=time.time() - job.created_at, deadline_s=spec.deadline.total_seconds(),
                     steps_left=spec.workload.steps - (att.last_step + 1), step_s=step_s)
        if f.late == self._late or (self._late is None and not f.late):  # news only: late, or in time again
            self._late = f.late
            return
        self._late = f.late
        if f.late:
            what = (f"at {step_s:.3g} s a step, the {f.steps_left} steps left end {format_duration(f.late_by_s)} "
                    f"after the deadline ({format_duration(f.deadline_s)} from submission)")
        else:
            what = f"at {step_s:.3g} s a step, the {f.steps_left} steps left end before the deadline again"
        self.store.add_event(self.job_id, DeadlineForecast(round(f.late_by_s, 1), round(f.end_s, 1), f.deadline_s,
                                                           f.steps_left, round(step_s, 4)), what)


def _usd_per_hour(spec: JobSpec, slices: int) -> float:
    """What `slices` slices of the spec's type and tier cost together."""
    return slices * catalog.lookup(spec.accelerator).usd_per_hour(spec.tier)


def _stop_s(spec: JobSpec) -> float:
    return spec.recovery.grace_period_s + RELEASE_S
