"""Goodput: where a job's wall time and money went, computed from its store rows alone.

Wall time runs from the job's creation to its terminal state event (or `now` while it
is active). The state events cut it into intervals that tile it exactly. Each interval
is first given whole to one category by its state; then the measured pieces of work
reported during it (waiting slices, restores, compiles, checkpoint saves, steps, lost
work) are carved out of it, in that order, each clamped to what is left. So the
categories are disjoint by construction and add up to wall time; a measurement larger
than the time left is cut short (it overlapped another one), never allowed to go
negative or to make time that did not exist.

Categories, in seconds:

- productive: `step_time_s` of every kept step row (a recomputed step keeps only its
  newest row; a row that a later lost_work event says will be recomputed is not kept),
  except the warm-up of each launch's first step (below).
- waiting_for_capacity: time in PENDING and QUEUED; time in PROVISIONING while the job's slice was
  WAITING (queued, no capacity); whole PROVISIONING attempts that ended in
  `provision_failed`; and the RECOVERING back-off that follows a `provision_failed`.
- provisioning: the rest of PROVISIONING (from asking for a slice until it is ready).
- runtime_init: time in STARTING (placing the workers, starting the distributed runtime),
  and the warm-up of each launch's first step: what it took beyond the job's median
  step time (the runtime's connections and first execution; 1-2 s on a 2-host slice).
- restore: `restore_s` of restore events (reading a checkpoint, or initialising the
  parameters on a fresh start).
- compile: `compile_s` of restore events. A launch whose restore event has no compile
  time (a user's program: `jax.jit` compiles in its first step) counts that first
  step's warm-up as compile instead of runtime_init.
- checkpoint_save: `blocking_s` of checkpoint events (the part of a save training waits for).
- lost_work: `seconds` of lost_work events: steps thrown away by a disruption and
  computed again, carved out of the run that first computed them.
- idle: the remainder: gaps between steps (input, reporting), noticing a disruption and
  releasing the slice, RECOVERING after a disruption, RESIZING.

Work reported at time t is carved out of the most recent RUNNING interval that
began by t: the workers of the latest launch did it.

Money: each slice is billed its `usd_per_hour` (as recorded in its slice events, else
the catalog's list price) from its REQUESTED event to its GONE or RELEASED event, or
to the end of wall time if neither was recorded. A slice that waited in the provider's
queue for capacity (WAITING) is billed from the first event after that wait, and not at
all if it never got past it: nothing is allocated to a queued request while it waits
(Cloud TPU's queued-resources documentation).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields

from rich.table import Table

# billed_slices: kept importable from here for control/limits.py, tests/unit/test_driver.py and
# benchmarks/autoscale_replay.py
from orchestrator.observe.billing import billed_slices
from orchestrator.observe.goodput_intervals import claims, state_intervals
from orchestrator.state.events import Disrupted, EventKind, LostWork, StateChange
from orchestrator.state.states import JobState
from orchestrator.state.store import Event, JobRecord, StepMetric, Store
from policies.decisions.recovery import RULES, Budget

CATEGORIES = ("productive", "waiting_for_capacity", "provisioning", "runtime_init", "compile", "restore",
              "checkpoint_save", "lost_work", "idle")

# The order in which measured work is carved out of an interval; the first ones are
# measured most directly, so when measurements overlap the later ones are cut short.
_CARVE_ORDER = ("waiting_for_capacity", "restore", "compile", "checkpoint_save", "runtime_init", "productive",
                "lost_work")

# What the controller counts against max_preemptions, and against max_failures (`policies.decisions.recovery.RULES`).
_PREEMPTION_OUTCOMES = tuple(k.value for k, r in RULES.items() if r.spends is Budget.PREEMPTIONS)
_FAILURE_OUTCOMES = tuple(k.value for k, r in RULES.items() if r.spends is Budget.FAILURES)


@dataclass(frozen=True)
class Goodput:
    """One job's wall time split into disjoint categories (seconds; see the module doc), and its cost."""

    job_id: str
    start: float  # the job's creation
    end: float  # its terminal event, or `now`
    finished: bool
    productive_s: float
    waiting_for_capacity_s: float
    provisioning_s: float
    runtime_init_s: float
    compile_s: float
    restore_s: float
    checkpoint_save_s: float
    lost_work_s: float
    idle_s: float
    usd_total: float
    usd_by: dict[tuple[str, str], float]  # (accelerator, tier) -> dollars
    preemptions: int  # disruptions by the provider (preempted or host lost), as the controller counts them
    failures: int  # attempts that failed on our side (the job's code, or no slice could be had)
    restarts: int  # launches of the workers after the first
    lost_steps: int  # steps computed again after a restore
    productive_steps: int  # the steps whose time counts as productive: each step once, however often it ran

    @property
    def wall_s(self) -> float:
        return self.end - self.start

    @property
    def goodput_fraction(self) -> float:
        return self.productive_s / self.wall_s if self.wall_s > 0 else 0.0

    def seconds(self) -> dict[str, float]:
        """Category -> seconds, in `CATEGORIES` order."""
        return {c: getattr(self, f"{c}_s") for c in CATEGORIES}

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "usd_by"}
        out["usd_by"] = [{"accelerator": a, "tier": t, "usd": usd} for (a, t), usd in sorted(self.usd_by.items())]
        return out | {"wall_s": self.wall_s, "goodput_fraction": self.goodput_fraction}


def goodput(store: Store, job_id: str, *, now: float | None = None) -> Goodput:
    """The goodput of job `job_id` up to its end (or `now`, default the current time, if it is active)."""
    job = store.job(job_id)
    return compute_goodput(job, store.events(job_id), store.steps(job_id), now=time.time() if now is None else now)


def compute_goodput(job: JobRecord, events: list[Event], steps: list[StepMetric], *, now: float) -> Goodput:
    """`goodput` over rows already read (a pure function: the same rows give the same answer)."""
    intervals = state_intervals(job, events, now=now)
    start, end = intervals[0].start, intervals[-1].end
    claimed, kept = claims(intervals, events, steps)
    spent = dict.fromkeys(CATEGORIES, 0.0)
    # Lost work that does not fit in the run it was lost in (that run's steps, timed by the hosts, filled
    # the time the controller saw it run) is taken from what the intervals after it leave unclaimed: the
    # work was lost all the same, and the categories still add up to the wall time.
    unplaced_lost = 0.0
    for i, iv in enumerate(intervals):
        left = iv.end - iv.start
        for category, seconds in sorted(claimed.get(i, []), key=lambda c: _CARVE_ORDER.index(c[0])):
            take = min(max(seconds, 0.0), left)
            spent[category] += take
            left -= take
            if category == "lost_work":
                unplaced_lost += max(seconds, 0.0) - take
        take = min(unplaced_lost, left)
        spent["lost_work"] += take
        unplaced_lost -= take
        spent[iv.base_category] += left - take

    usd_by: dict[tuple[str, str], float] = {}
    for s in billed_slices(events, end=end):
        usd_by[(s.accelerator, s.tier)] = usd_by.get((s.accelerator, s.tier), 0.0) + s.usd
    kinds = [kind for _, kind in disruptions(events)]
    launches = sum(1 for e in events if e.kind is EventKind.STATE and e.to_state is JobState.STARTING)
    return Goodput(
        job_id=job.id, start=start, end=end, finished=job.state.terminal,
        **{f"{c}_s": spent[c] for c in CATEGORIES},
        usd_total=sum(usd_by.values()), usd_by=usd_by,
        preemptions=sum(k in _PREEMPTION_OUTCOMES for k in kinds),
        failures=sum(k in _FAILURE_OUTCOMES for k in kinds),
        restarts=max(0, launches - 1),
        lost_steps=sum(int(e.payload_as(LostWork).steps or 0) for e in events if e.kind is EventKind.LOST_WORK),
        productive_steps=len({s.step for s in kept}),
    )


def disruptions(events: list[Event]) -> list[tuple[float, str]]:
    """(at, outcome kind) of each attempt that ended without finishing the job, oldest first.

    Kinds are those of `OutcomeKind`: preempted, infra_lost, worker_aborted, hung, app_failed, ...
    Disruption events are the record when the controller writes them (they are written
    even when the job then fails for lack of retries); older stores only have the
    `outcome` of ->RECOVERING transitions. Failed provisioning never has a disruption
    event, so it always comes from the transitions.
    """
    recovering = [(e.at, outcome) for e in events if e.kind is EventKind.STATE and e.to_state is JobState.RECOVERING
                  and (outcome := e.payload_as(StateChange).outcome)]
    recorded = [(e.at, kind) for e in events if e.kind is EventKind.DISRUPTION
                and (kind := e.payload_as(Disrupted).kind)]
    if not recorded:
        return recovering
    return sorted(recorded + [(at, k) for at, k in recovering if k == "provision_failed"])


def render_goodput(g: Goodput) -> Table:
    """A rich table of the breakdown (category, time, share of wall time), with cost and counts below it."""
    table = Table("category", "time", "share", title=f"goodput of {g.job_id}", title_justify="left",
                  caption=summary_line(g), caption_justify="left")
    table.columns[1].justify = table.columns[2].justify = "right"
    for category, seconds in g.seconds().items():
        share = seconds / g.wall_s if g.wall_s > 0 else 0.0
        table.add_row(category.replace("_", " "), format_duration(seconds), f"{share:.1%}",
                      style="bold green" if category == "productive" else None)
    table.add_section()
    table.add_row("wall time" if g.finished else "wall time so far", format_duration(g.wall_s), "100.0%")
    return table


def summary_line(g: Goodput) -> str:
    """Goodput, cost by (accelerator, tier) and disruption counts in one line."""
    by = ", ".join(f"{a} {t} ${usd:,.2f}" for (a, t), usd in sorted(g.usd_by.items()))
    return (f"goodput {g.goodput_fraction:.1%}; cost ${g.usd_total:,.2f}" + (f" ({by})" if by else "")
            + f"; {g.preemptions} preemptions, {g.failures} failures, {g.restarts} restarts, "
            f"{g.productive_steps} steps kept, {g.lost_steps} recomputed")


def format_duration(seconds: float) -> str:
    """`1h 02m 03s`, `4m 05s` or `6.7s`."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    m, s = divmod(round(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h {m:02d}m {s:02d}s" if h else f"{m}m {s:02d}s"
