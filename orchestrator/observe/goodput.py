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

import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from rich.table import Table

from orchestrator.catalog import lookup
from orchestrator.errors import UnknownAcceleratorError
from orchestrator.state.events import (
    CheckpointSaved,
    Disrupted,
    EventKind,
    LostWork,
    Restored,
    SliceChanged,
    StateChange,
)
from orchestrator.state.states import JobState
from orchestrator.state.store import Event, JobRecord, StepMetric, Store
from policies.decisions.recovery import RULES, Budget

log = logging.getLogger(__name__)

CATEGORIES = ("productive", "waiting_for_capacity", "provisioning", "runtime_init", "compile", "restore",
              "checkpoint_save", "lost_work", "idle")

# The order in which measured work is carved out of an interval; the first ones are
# measured most directly, so when measurements overlap the later ones are cut short.
_CARVE_ORDER = ("waiting_for_capacity", "restore", "compile", "checkpoint_save", "runtime_init", "productive",
                "lost_work")

# The only state in which the job's workers are up: the controller enters RESIZING and
# RECOVERING after it has stopped them, so work reported then is late news of the run before.
_WORK_STATES = ("RUNNING",)
_BASE_CATEGORY = {"PENDING": "waiting_for_capacity", "QUEUED": "waiting_for_capacity", "PROVISIONING": "provisioning",
                  "STARTING": "runtime_init"}
# What the controller counts against max_preemptions, and against max_failures (`policies.decisions.recovery.RULES`).
_PREEMPTION_OUTCOMES = tuple(k.value for k, r in RULES.items() if r.spends is Budget.PREEMPTIONS)
_FAILURE_OUTCOMES = tuple(k.value for k, r in RULES.items() if r.spends is Budget.FAILURES)
_BILLING_ENDS = ("GONE", "RELEASED")


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


@dataclass(frozen=True)
class BilledSlice:
    """One slice's billing window: it costs `usd_per_hour` from `start` to `end`."""

    name: str
    accelerator: str
    tier: str
    chips: int
    usd_per_hour: float
    start: float
    end: float

    @property
    def usd(self) -> float:
        return self.usd_until(self.end)

    def usd_until(self, t: float) -> float:
        """Dollars billed for this slice up to time `t`."""
        return self.usd_per_hour * max(0.0, min(t, self.end) - self.start) / 3600.0


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


def goodput(store: Store, job_id: str, *, now: float | None = None) -> Goodput:
    """The goodput of job `job_id` up to its end (or `now`, default the current time, if it is active)."""
    job = store.job(job_id)
    return compute_goodput(job, store.events(job_id), store.steps(job_id), now=time.time() if now is None else now)


def compute_goodput(job: JobRecord, events: list[Event], steps: list[StepMetric], *, now: float) -> Goodput:
    """`goodput` over rows already read (a pure function: the same rows give the same answer)."""
    intervals = state_intervals(job, events, now=now)
    start, end = intervals[0].start, intervals[-1].end
    claims, kept = _claims(intervals, events, steps)
    spent = dict.fromkeys(CATEGORIES, 0.0)
    for i, iv in enumerate(intervals):
        left = iv.end - iv.start
        for category, seconds in sorted(claims.get(i, []), key=lambda c: _CARVE_ORDER.index(c[0])):
            take = min(max(seconds, 0.0), left)
            spent[category] += take
            left -= take
        spent[iv.base_category] += left

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


def billed_slices(events: list[Event], *, end: float) -> list[BilledSlice]:
    """Each slice of the job's slice events with its billing window (open windows close at `end`)."""
    by_name: dict[str, list[tuple[float, SliceChanged]]] = {}
    for e in events:
        if e.kind is EventKind.SLICE and (changed := e.payload_as(SliceChanged)).name:
            by_name.setdefault(changed.name, []).append((e.at, changed))
    out = []
    for name, evs in by_name.items():
        first = next((x for x in evs if x[1].state == "REQUESTED"), evs[0])
        waited = [i for i, (_, s) in enumerate(evs) if s.state == "WAITING"]
        if waited:  # billed from when capacity came (after the last wait: a zone fall-through waits again)
            allocated = next((x for x in evs[waited[-1]:] if x[1].state not in ("WAITING", *_BILLING_ENDS)), None)
            if allocated is None:  # let go while still queued: never allocated, never billed
                continue
            first = allocated
        last = next((x for x in evs if x[1].state in _BILLING_ENDS and x[0] >= first[0]), None)
        accelerator, tier = str(first[1].accelerator or "?"), str(first[1].tier or "?")
        price = next((s.usd_per_hour for _, s in evs if s.usd_per_hour is not None), None)
        chips = next((s.chips for _, s in evs if s.chips is not None), None)
        if price is None or chips is None:
            price, chips = _catalog_facts(accelerator, tier, price, chips)
        stop = last[0] if last is not None else max(end, first[0])
        out.append(BilledSlice(name, accelerator, tier, int(chips), float(price), first[0], stop))
    return sorted(out, key=lambda s: s.start)


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


# -- building blocks ------------------------------------------------------------------


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


def _claims(intervals: list[StateInterval], events: list[Event],
            steps: list[StepMetric]) -> tuple[dict[int, list], list[StepMetric]]:
    """Measured work as {interval index: [(category, seconds), ...]}, and the step rows kept as productive."""
    claims: dict[int, list] = {}

    def claim(i: int, category: str, seconds: Any) -> None:
        if seconds:
            claims.setdefault(i, []).append((category, float(seconds)))

    starts = [iv.start for iv in intervals]
    _claim_waiting(intervals, events, claim)
    compiles_in_first_step = _claim_events(intervals, starts, events, claim)
    stale = _stale_ranges(events)
    kept = [s for s in steps if not any(s.step in steps_range and s.at < at for at, steps_range in stale)]
    _claim_steps(intervals, starts, kept, compiles_in_first_step, claim)
    return claims, kept


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


def _catalog_facts(accelerator: str, tier: str, price, chips) -> tuple[float, int]:
    """The catalog's price and chips for what a slice event left out (0 for a type the catalog lacks)."""
    try:
        t = lookup(accelerator)
    except UnknownAcceleratorError:
        log.warning("slice of unknown accelerator %r: billed at $0", accelerator)
        return price or 0.0, chips or 0
    try:
        list_price = t.usd_per_hour(tier)
    except ValueError:  # an unknown tier: plan with the on-demand price, the higher one
        list_price = t.usd_per_hour("on-demand")
    return (list_price if price is None else price), (t.chips if chips is None else chips)
