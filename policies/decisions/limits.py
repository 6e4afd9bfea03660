"""The two limits a job file sets for every job, autoscaled or not: `budget_usd` and `deadline`.

Pure: the driver gathers what the job has spent and how fast it goes, and asks.

The budget is a cap. A job stops at a committed step while what it has spent, plus what
stopping may still cost (the slice held until its hosts agree on a step and save it, then
released), stays within the cap; it does not start a slice it could not stop in time. The
deadline, without autoscaling (where the cost policy plans for it), is a forecast: at the
speed the job keeps, saves included, when does its last step end, and how far past the
deadline is that.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_RUN_S = 30.0  # a slice is started only if the budget pays for this much training too


def stop_cost_usd(usd_per_hour: float, stop_s: float) -> float:
    """What the held slice costs while the job stops: `stop_s` seconds at its price."""
    return usd_per_hour * stop_s / 3600.0


def budget_stop(*, spent_usd: float, usd_per_hour: float, cap_usd: float, stop_s: float) -> str | None:
    """Why the job must stop now to stay within `cap_usd`, or None while it may train on.

    `stop_s`: the longest a stop takes, from asking the hosts to the slice given back.
    """
    more = stop_cost_usd(usd_per_hour, stop_s)
    if spent_usd + more < cap_usd:
        return None
    return (f"budget_usd is ${cap_usd:,.2f}: ${spent_usd:,.2f} spent, and stopping may cost "
            f"${more:,.2f} more")


def budget_refuses_start(*, spent_usd: float, usd_per_hour: float, cap_usd: float, stop_s: float) -> str | None:
    """Why no slice at `usd_per_hour` may start: the budget left would not pay for `MIN_RUN_S` of
    training and a stop. None when it would."""
    more = stop_cost_usd(usd_per_hour, stop_s + MIN_RUN_S)
    if spent_usd + more < cap_usd:
        return None
    return (f"budget_usd is ${cap_usd:,.2f}: ${spent_usd:,.2f} spent, and ${cap_usd - spent_usd:,.2f} left does not "
            f"pay for {MIN_RUN_S:.0f} s of a slice at ${usd_per_hour:,.2f}/h and its stop")


@dataclass(frozen=True)
class Forecast:
    end_s: float  # when the last step ends, in seconds from submission
    deadline_s: float
    steps_left: int
    step_s: float

    @property
    def late_by_s(self) -> float:
        return self.end_s - self.deadline_s

    @property
    def late(self) -> bool:
        return self.late_by_s > 0


def forecast(*, elapsed_s: float, deadline_s: float, steps_left: int, step_s: float) -> Forecast:
    """The job's end at `step_s` seconds a step, `elapsed_s` after its submission."""
    return Forecast(elapsed_s + max(steps_left, 0) * step_s, deadline_s, max(steps_left, 0), step_s)


def step_seconds(marks: list[tuple[float, int]]) -> float | None:
    """Wall seconds a step over (time, step) marks of one run, oldest first: the span over the steps
    it covers, so saves and reports count. None with fewer than two marks or no steps between them."""
    if len(marks) < 2 or marks[-1][1] <= marks[0][1]:
        return None
    return (marks[-1][0] - marks[0][0]) / (marks[-1][1] - marks[0][1])
