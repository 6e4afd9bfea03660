"""Replay a spot capacity trace against any policy.

The simulated world (one job, one zone):

- Time advances in steps of at most `MAX_STEP_S` (the trace's tick split evenly). The
  policy is asked for a decision, seeing only the past and the present, at the start of
  the job, when the job's slice is preempted, a request turns READY or is lost, and
  otherwise every `policies.cost.clock.DECISION_INTERVAL_S`, as the controller asks it.
- Spot capacity comes from the trace (see `policies.evaluation.traces`); on-demand is always there.
- The job's slices move through the store's slice lifecycle and each change is a
  `SliceRecord` (`Run.records`): a request is REQUESTED, WAITING while the zone has no
  capacity for it (not billed), PROVISIONING for `provisioning_s` (not billed), then
  READY; the job then starts up on it for `startup_s` (billed, no progress; both rounded
  up to whole steps) and trains at its `tokens_per_s`.
- Moves are make-before-break (`policies.cost.moves`): a move requests the new slice beside
  the running one, which trains on while the request waits, and a spot size the policy's
  plan waits for stays requested; when a request is READY the policy is asked, and if it
  chooses it the running slice stops at a checkpoint (nothing lost) and is released. A
  request the policy no longer wants is released. A request let go unfilled is a
  refusal: a capacity fact the policy learns from, never a failure. `release_first=True`
  replays the older way (release the running slice, then request; a request waits at
  most `queue_timeout_s`), for comparison.
- A slice checkpoints after every interval of training: the interval the policy chose
  for it when the job switched onto it (`Decision.checkpoint_interval_s`), or
  `RestartCost.checkpoint_interval_s` for a policy that does not choose; it is kept
  while the slice runs, as the controller launches workers with it. Each save costs
  `RestartCost.save_s` of billed time without progress.
- A spot slice whose size exceeds the capacity at a step is reclaimed there, without
  notice: the work since its last checkpoint is lost, unless `RestartCost.saves_on_notice`
  says a notice leaves time for a save (off by default). Several slices of one type
  (`Option.count`): the capacity, in chips (the trace's hosts x 4 on v4), says how many of
  them fit; those that do not are reclaimed, and while one is left the job trains on the
  survivors (`sim_slices.shrink`: a relaunch, `RestartCost.reshape_s` billed without progress,
  nothing lost); the policy may add slices back make-before-break (`sim_slices.switch`, a grow:
  the added slices provision while the group trains, then the group stops at a committed step
  and relaunches for `reshape_s`, as the controller does). Only losing the last is a full restart.
- Billing stops the moment the last token is trained.

The policy's snapshot is built by `policies.cost.knowledge.build_snapshot`, the function the
product's autoscaler uses, from the run's slice records. What it knows of spot capacity
(`knowledge`): "own" (the product's view) only what the job's own slices show; "pooled"
also what earlier jobs in the zone showed: `earlier_jobs` jobs replayed back to back
on the same trace just before this one, each pooling the ones before it (or the
`memory` records given); "trace" shows it the zone's capacity at every step and asks it
again whenever that changes, as a scheduler with a capacity feed would (an upper bound).

Baselines to compare with are in `policies.evaluation.baselines`; the least any policy could pay,
knowing the future, in `policies.evaluation.hindsight`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np

from policies.cost.clock import DECISION_INTERVAL_S
from policies.cost.knowledge import CapacityFeed, Progress, build_snapshot
from policies.cost.moves import QUEUE_TIMEOUT_S, MoveKind, next_move
from policies.cost.restart_cost import RestartCost
from policies.cost.slice_history import SliceRecord
from policies.cost.slice_options import SPOT, Option
from policies.cost.snapshot import Decision, Snapshot
from policies.cost.spot_estimates import SpotAvailability, SpotHazard
from policies.evaluation import sim_slices as sl
from policies.evaluation.sim_slices import DecisionRecord, SimState
from policies.evaluation.traces import SpotTrace

__all__ = ["DECISION_INTERVAL_S", "QUEUE_TIMEOUT_S", "DecisionRecord", "Policy", "Run", "SimJob", "quantized_restart",
           "simulate", "step_seconds"]

MAX_STEP_S = 60.0
MAX_DEADLINES_SIMULATED = 20  # a run still unfinished after 20 deadlines is reported unfinished
KNOWLEDGE = ("trace", "own", "pooled")


@dataclass(frozen=True)
class SimJob:
    total_tokens: float
    deadline_s: float  # from the job's start
    options: tuple[Option, ...]
    budget_usd: float | None = None


class Policy(Protocol):
    name: str

    def decide(self, snap: Snapshot) -> Decision: ...


@dataclass(frozen=True)
class Run:
    """The outcome of one job under one policy on one trace window."""

    policy: str
    trace: str
    start_s: float  # offset into the trace
    total_tokens: float
    deadline_s: float
    cost_usd: float
    finish_s: float | None  # from the job's start; None if unfinished
    tokens_trained: float  # every token computed, including those lost to preemptions
    tokens_lost: float
    preemptions: int  # full losses (every slice the job held)
    slices_started: int  # slices the job trained on
    billed_s: dict[str, float] = field(default_factory=dict)  # by option label
    decisions: tuple[DecisionRecord, ...] = ()
    refusals: int = 0  # requests let go unfilled (timed out, no longer wanted, lost before READY, or at the end)
    records: tuple[SliceRecord, ...] = ()  # every change of every slice, as the store would hold them
    asked: tuple[tuple[float, int], ...] = ()  # each time the policy was asked, with how many records it had seen
    shrinks: int = 0  # losses of some of several slices, the job training on

    @property
    def deadline_met(self) -> bool:
        return self.finish_s is not None and self.finish_s <= self.deadline_s

    @property
    def hours(self) -> float | None:
        return None if self.finish_s is None else self.finish_s / 3600

    @property
    def usd_per_btok(self) -> float:
        return self.cost_usd / self.total_tokens * 1e9


def step_seconds(trace: SpotTrace) -> float:
    """The simulation step: the trace tick, split evenly into pieces of at most MAX_STEP_S."""
    return trace.gap_s / math.ceil(trace.gap_s / MAX_STEP_S)


def quantized_restart(restart: RestartCost, step_s: float) -> RestartCost:
    """The restart the simulator really charges: overheads rounded up to whole steps."""
    def up(seconds: float) -> float:
        return math.ceil(seconds / step_s - 1e-9) * step_s

    return replace(restart, provisioning_s=up(restart.provisioning_s), startup_s=up(restart.startup_s),
                   reshape_s=up(restart.reshape_s))


def simulate(
    policy: Policy,
    job: SimJob,
    trace: SpotTrace,
    *,
    start_s: float = 0.0,
    restart: RestartCost = RestartCost(),
    hazard: SpotHazard = SpotHazard(),
    availability: SpotAvailability = SpotAvailability(),
    zone: str = "default",
    decision_interval_s: float = DECISION_INTERVAL_S,
    knowledge: str = "trace",
    queue_timeout_s: float = QUEUE_TIMEOUT_S,
    release_first: bool = False,
    memory: Sequence[SliceRecord] = (),
    earlier_jobs: int = 1,
) -> Run:
    """Run `job` under `policy` from `start_s` into `trace`; see the module docstring for the rules.

    `memory`: slice records of earlier jobs in the zone (times relative to this job's start), pooled.
    """
    if knowledge not in KNOWLEDGE:
        raise ValueError(f"knowledge must be one of {', '.join(KNOWLEDGE)}, not {knowledge!r}")
    if knowledge == "pooled":
        memory = (*memory, *_earlier_records(policy, job, trace, start_s, earlier_jobs, restart=restart,
                                             hazard=hazard, availability=availability, zone=zone,
                                             decision_interval_s=decision_interval_s,
                                             queue_timeout_s=queue_timeout_s, release_first=release_first))
    dt = step_seconds(trace)
    restart = quantized_restart(restart, dt)
    max_steps = math.ceil(MAX_DEADLINES_SIMULATED * job.deadline_s / dt)
    w = _World(policy, job, restart, dt, round(restart.startup_s / dt), trace.capacity_chips(start_s, dt, max_steps),
               tuple(sorted({o.chips for o in job.options if o.tier == SPOT})), zone, decision_interval_s,
               knowledge == "trace", queue_timeout_s, release_first, tuple(memory), hazard)
    s = SimState(availability, restart.checkpoint_interval_s)
    for i in range(max_steps):
        if _step(w, s, i):
            break
    return Run(policy.name, trace.name, start_s, job.total_tokens, job.deadline_s, s.cost, s.finish_s, s.trained,
               s.lost, s.preemptions, s.slices_started, s.billed, tuple(s.decisions), s.refusals, tuple(s.records),
               tuple(s.asked), s.shrinks)


def _earlier_records(policy, job, trace, start_s, jobs, **kw) -> list[SliceRecord]:
    """Slice records of `jobs` jobs run back to back on the trace just before `start_s`, each
    pooling those before it; times relative to `start_s`."""
    pooled: list[SliceRecord] = []
    for k in range(jobs, 0, -1):
        offset = -k * job.deadline_s
        run = simulate(policy, job, trace, start_s=start_s + offset, knowledge="own",
                       memory=[replace(r, at_s=r.at_s - offset) for r in pooled], **kw)
        pooled += [replace(r, at_s=r.at_s + offset, name=f"earlier{k}-{r.name}") for r in run.records]
    return pooled


@dataclass(frozen=True)
class _World:
    """What is fixed for one run of `simulate`."""

    policy: Policy
    job: SimJob
    restart: RestartCost  # overheads rounded up to whole steps
    dt: float  # seconds a step
    startup_steps: int
    capacity: np.ndarray  # spot chips the zone can give, at each step
    spot_sizes: tuple[int, ...]  # chips of the job's spot options, ascending
    zone: str
    decision_interval_s: float
    feed: bool  # knowledge "trace": the policy sees the zone's capacity
    queue_timeout_s: float
    release_first: bool
    memory: tuple[SliceRecord, ...]  # earlier jobs' records, pooled
    hazard: SpotHazard  # the prior


def _step(w: _World, s: SimState, i: int) -> bool:
    """Step `i`: what befell the job's slice and request, a decision if one is due, then the
    held slice starts up or trains through the step. True once the last token is trained."""
    now, cap = i * w.dt, int(w.capacity[i])
    changed = w.feed and i > 0 and cap != w.capacity[i - 1]  # a capacity feed shows every change
    preempted = s.held is not None and s.held.preemptible and cap < s.held.chips
    if preempted:
        assert s.held is not None
        left = min(cap // s.held.slice_chips, s.held.count - 1)
        survivors = s.held.with_count(left, w.job.options) if left else None
        if survivors is not None:
            sl.shrink(s, now, survivors, round(w.restart.reshape_s / w.dt))
        else:
            sl.preempt(s, now, w.restart.saves_on_notice)
    event = sl.advance(s, now, cap, w.restart.provisioning_s, w.job.options)
    if w.feed and i > 0:
        s.unobserved_s += w.dt
    if i == 0 or changed or preempted or event is not None or now >= s.next_decision_s - 1e-9:
        if w.feed and i > 0:  # capacity was constant since the last decision point (a change is one)
            s.availability = s.availability.observe(w.zone, w.spot_sizes, int(w.capacity[i - 1]), s.unobserved_s)
            s.unobserved_s = 0.0
        _decide(w, s, now, cap)
    if s.held is None or not sl.train(s, now, w.dt, w.job.total_tokens, w.restart.save_s):
        return False
    if s.request is not None:  # done: a request still waiting is let go (unfilled: a refusal like any other)
        assert s.finish_s is not None, "set by the step that trained the last token"
        sl.release_request(s, s.finish_s)
    return True


def _snapshot(w: _World, s: SimState, now: float, cap: int) -> Snapshot:
    """What the policy knows now, built as the autoscaler builds it."""
    r = s.request
    current, ready_in = s.held, s.startup_steps * w.dt
    if current is None and r is not None and r.state != "WAITING":  # the slice the job will train on
        current, ready_in = r.option, max(r.ready_s - now, 0.0) + w.restart.startup_s
    progress = Progress(w.job.deadline_s, w.job.total_tokens, s.done, s.committed, s.cost, w.job.budget_usd)
    return build_snapshot(now_s=now, progress=progress, options=w.job.options, restart=w.restart,
                          records=s.records, pooled_records=w.memory, current=current, current_ready_in_s=ready_in,
                          ready=r.option if r is not None and r.state == "READY" else None,
                          waiting=r.option if r is not None and r.state != "READY" else None,
                          feed=CapacityFeed(cap, s.availability) if w.feed else None, hazard=w.hazard,
                          availability=s.availability, decision_interval_s=w.decision_interval_s,
                          max_slices=max(o.count for o in w.job.options))


def _decide(w: _World, s: SimState, now: float, cap: int) -> None:
    """Ask the policy, and act on its answer (`policies.cost.moves.next_move`)."""
    s.asked.append((now, len(s.records)))
    decision = w.policy.decide(_snapshot(w, s, now, cap))
    s.next_decision_s = now + w.decision_interval_s
    r = s.request
    move = next_move(decision.option, held=s.held, waiting=r.option if r is not None else None,
                     waiting_ready=r is not None and r.state == "READY",
                     wait_for=None if w.release_first else decision.wait_for)
    if move.kind is not MoveKind.KEEP or move.release_waiting:
        label = move.target.label if move.target is not None else "wait"
        s.decisions.append(DecisionRecord(now, label, decision.reason, str(move)))
    every_s = decision.checkpoint_interval_s or w.restart.checkpoint_interval_s  # for the target, at its launch
    if move.switch:
        sl.switch(s, now, w.startup_steps, every_s, reshape_steps=round(w.restart.reshape_s / w.dt))
        return
    if move.release_waiting:
        sl.release_request(s, now)
    if move.release_held or (move.request is not None and move.beside and w.release_first):
        sl.stop(s, now)
    if move.request is not None:
        sl.ask(s, move.request, now, w.queue_timeout_s if w.release_first else None)
        sl.advance(s, now, cap, w.restart.provisioning_s, w.job.options)
