"""Replay a spot capacity trace against any policy.

The simulated world (one job, one zone):

- Time advances in steps of at most `MAX_STEP_S` (the trace's tick split evenly). The
  policy is asked for a decision, seeing only the past and the present capacity, at
  the start of the job, whenever the capacity changes or the job's slice is
  preempted, and otherwise every `decision_interval_s` (as a controller would).
- Spot capacity comes from the trace (see `policies.traces`); on-demand is always there.
- A new slice spends `provisioning_s` (not billed), then `startup_s` (billed, no
  progress), both rounded up to whole steps, then trains at its `tokens_per_s`.
- A slice checkpoints after every interval of training: the decision's
  `checkpoint_interval_s` (the policy's choice for that slice), or
  `RestartCost.checkpoint_interval_s` for a policy that does not choose. Each save
  costs `RestartCost.save_s` of billed time without progress.
- A spot slice whose size exceeds the capacity at a step is preempted there: the
  work since its last checkpoint is lost, unless `RestartCost.saves_on_notice` says
  the preemption notice leaves time for a save (off by default).
- A slice the policy gives up voluntarily is checkpointed first, so nothing is lost.
- Billing stops the moment the last token is trained.
- What the policy knows of spot capacity (`knowledge`): "trace" (the default, the
  benchmark's headline) shows it the zone's capacity at every step and asks it again
  whenever that changes, as a scheduler with a capacity feed would. "own" shows it only
  what the job's own spot slices show, as the product's autoscaler sees it: a spot slice
  up says its size can be had, a request left queued for `queue_timeout_s` or a
  preemption says it cannot (for `REFUSAL_HOLDS_S`), and otherwise every allowed size
  is assumed to be there. A spot request the zone cannot fill waits in the queue (not
  billed, no decisions meanwhile, as the controller waits on the provider) until
  capacity comes or the timeout refuses it. With `release_first` (what the
  controller's resize does today) the slice it replaces was released first; without,
  that slice trains on while the request waits and is left when the request is filled
  (make-before-break, which queued resources allow: a waiting request costs nothing).

Baselines to compare with are in `policies.baselines`; the least any policy could pay,
knowing the future, in `policies.hindsight`. In the code, `_World` holds what is fixed
for a run, `_State` what changes, and `_step` calls one function per part of a step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from policies.restart_cost import RestartCost
from policies.slice_options import SPOT, Option
from policies.snapshot import Decision, Snapshot
from policies.spot_estimates import SpotAvailability, SpotHazard, spot_chips_known
from policies.traces import SpotTrace

MAX_STEP_S = 60.0
DECISION_INTERVAL_S = 300.0  # how often the policy is asked when nothing happens
QUEUE_TIMEOUT_S = 300.0  # knowledge "own": how long a spot request waits in the queue (the spec's start timeout)
MAX_DEADLINES_SIMULATED = 20  # a run still unfinished after 20 deadlines is reported unfinished


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
class DecisionRecord:
    at_s: float
    option: str  # label, or "wait"
    reason: str


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
    preemptions: int
    slices_started: int  # the first slice and every restart
    billed_s: dict[str, float] = field(default_factory=dict)  # by option label
    decisions: tuple[DecisionRecord, ...] = ()

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
    return RestartCost(
        math.ceil(restart.provisioning_s / step_s - 1e-9) * step_s,
        math.ceil(restart.startup_s / step_s - 1e-9) * step_s,
        restart.checkpoint_interval_s,
        restart.save_s,
        restart.saves_on_notice,
    )


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
    release_first: bool = True,
) -> Run:
    """Run `job` under `policy` from `start_s` into `trace`; see the module docstring for the rules."""
    if knowledge not in ("trace", "own"):
        raise ValueError(f"knowledge must be 'trace' or 'own', not {knowledge!r}")
    dt = step_seconds(trace)
    restart = quantized_restart(restart, dt)
    max_steps = math.ceil(MAX_DEADLINES_SIMULATED * job.deadline_s / dt)
    world = _World(
        policy, job, restart, dt, round(restart.provisioning_s / dt), round(restart.startup_s / dt),
        trace.capacity_chips(start_s, dt, max_steps), tuple(sorted({o.chips for o in job.options if o.tier == SPOT})),
        zone, decision_interval_s, knowledge == "own", queue_timeout_s, release_first)
    s = _State(hazard, availability, interval_s=restart.checkpoint_interval_s)
    for i in range(max_steps):
        if _step(world, s, i):
            break
    return Run(policy.name, trace.name, start_s, job.total_tokens, job.deadline_s, s.cost, s.finish_s,
               s.trained, s.lost, s.preemptions, s.slices_started, s.billed, tuple(s.decisions))


@dataclass(frozen=True)
class _World:
    """What is fixed for one run of `simulate`."""

    policy: Policy
    job: SimJob
    restart: RestartCost  # overheads rounded up to whole steps
    dt: float  # seconds a step
    prov_steps: int
    startup_steps: int
    capacity: np.ndarray  # spot chips the zone can give, at each step
    spot_sizes: tuple[int, ...]  # chips of the job's spot options, ascending
    zone: str
    decision_interval_s: float
    own: bool  # knowledge "own": the policy sees only what the job's own slices show
    queue_timeout_s: float
    release_first: bool


@dataclass(frozen=True)
class _Request:
    """Knowledge "own": a spot request waiting in the zone's queue."""

    option: Option
    at_s: float  # when it was made
    interval_s: float  # the checkpoint interval the policy chose for the slice


@dataclass
class _State:
    """What changes as `simulate` steps: the job's slice, its progress and bill, and what
    its policy has learned."""

    hazard: SpotHazard
    availability: SpotAvailability
    interval_s: float  # how often the held slice checkpoints
    # The slice.
    held: Option | None = None
    overhead_steps: int = 0  # steps left before the held slice trains
    queued: _Request | None = None
    # Progress and what it cost.
    done: float = 0.0  # tokens trained, including those since the last checkpoint
    committed: float = 0.0  # tokens in the last checkpoint
    trained: float = 0.0  # every token computed, those lost to preemptions included
    lost: float = 0.0
    since_checkpoint_s: float = 0.0  # training since the last save
    saving_s: float = 0.0  # save time still to pay
    cost: float = 0.0
    billed: dict[str, float] = field(default_factory=dict)  # seconds by option label
    preemptions: int = 0
    slices_started: int = 0
    decisions: list[DecisionRecord] = field(default_factory=list)
    finish_s: float | None = None
    next_decision_s: float = 0.0
    # Observations not yet fed to the estimates.
    unobserved_s: float = 0.0  # time at the previous capacity, for the availability estimate
    exposure: dict[tuple[str, str], float] = field(default_factory=dict)  # spot host-hours, for the hazard estimate
    refusals: list[tuple[float, int]] = field(default_factory=list)  # (when, chips): spot the zone refused the job
    shown: tuple[tuple[int, ...], int] | None = None  # what the job's own slices show: (sizes, capacity)
    shown_s: float = 0.0  # for how long


def _step(w: _World, s: _State, i: int) -> bool:
    """Step `i`: what befell the job's request and slice, a decision if one is due, then the
    held slice starts up or trains through the step. True once the last token is trained."""
    now, cap = i * w.dt, int(w.capacity[i])
    if w.own and i > 0:  # the state of the step before lasted through it
        _watch_own_slices(w, s)
    changed = i > 0 and cap != w.capacity[i - 1] and not w.own  # a capacity feed shows every change
    preempted = s.held is not None and s.held.preemptible and cap < s.held.chips
    expired = s.queued is not None and _advance_queue(w, s, now, cap)
    if preempted:
        _preempt(w, s, now)
    due = i == 0 or changed or preempted or expired or now >= s.next_decision_s - 1e-9
    if s.queued is not None or not due:
        s.unobserved_s += w.dt
    else:
        _learn(w, s, i)
        _decide(w, s, now, cap)
    if s.held is None:
        return False
    if s.overhead_steps > 0:
        _start_up(w, s)
        return False
    return _train(w, s, now)


def _own_view(w: _World, s: _State) -> tuple[tuple[int, ...], int] | None:
    """What the job's own spot slice or request shows of the zone: (sizes, chips it can give)."""
    if s.held is not None and s.held.preemptible:
        return tuple(c for c in w.spot_sizes if c <= s.held.chips), s.held.chips
    if s.queued is not None:
        return tuple(c for c in w.spot_sizes if c >= s.queued.option.chips), 0
    return None


def _watch_own_slices(w: _World, s: _State) -> None:
    """Knowledge "own": what the job's slices showed lasted another step; when that
    changes, the availability estimate learns how long the previous view lasted."""
    view = _own_view(w, s)
    if view != s.shown:
        if s.shown is not None and s.shown[0]:
            s.availability = s.availability.observe(w.zone, s.shown[0], s.shown[1], s.shown_s)
        s.shown, s.shown_s = view, 0.0
    s.shown_s += w.dt


def _advance_queue(w: _World, s: _State, now: float, cap: int) -> bool:
    """The queued spot request is filled if capacity came, or refused at its timeout. True if refused."""
    request = s.queued
    if cap >= request.option.chips:  # capacity came: the slice provisions
        if s.held is not None:  # queued beside a running slice: a planned stop checkpoints first
            _stop(s)
            s.decisions.append(DecisionRecord(now, request.option.label, "queued spot request filled"))
        s.queued = None
        _start(w, s, request.option, request.interval_s)
        return False
    if now - request.at_s >= w.queue_timeout_s:
        s.refusals.append((now, request.option.chips))
        s.queued = None
        return True
    return False


def _preempt(w: _World, s: _State, now: float) -> None:
    """The zone takes the held spot slice back: the work since its last checkpoint is lost,
    unless the preemption notice leaves time to save."""
    if w.own:
        s.refusals.append((now, s.held.chips))
    if s.overhead_steps <= w.startup_steps:  # billed, so the slice existed: a preemption
        s.preemptions += 1
        s.hazard = s.hazard.observe(s.held.tier, s.held.zone, host_hours=0.0, preemptions=1)
        if w.restart.saves_on_notice:
            s.committed = s.done
        s.lost += s.done - s.committed
        s.done = s.committed
    s.held, s.since_checkpoint_s, s.saving_s = None, 0.0, 0.0


def _learn(w: _World, s: _State, i: int) -> None:
    """At a decision point: the estimates learn what happened since the last one."""
    if w.own:
        if s.shown is not None and s.shown[0] and s.shown_s > 0:
            s.availability = s.availability.observe(w.zone, s.shown[0], s.shown[1], s.shown_s)
        s.shown_s = 0.0
    elif i > 0:  # capacity was constant since the last decision point (a change is one)
        s.availability = s.availability.observe(w.zone, w.spot_sizes, int(w.capacity[i - 1]), s.unobserved_s + w.dt)
    for (tier, spot_zone), host_hours in s.exposure.items():
        s.hazard = s.hazard.observe(tier, spot_zone, host_hours=host_hours)
    s.unobserved_s, s.exposure = 0.0, {}


def _snapshot(w: _World, s: _State, now: float, cap: int) -> Snapshot:
    """What the policy knows now."""
    ready_in = s.overhead_steps * w.dt if s.held is not None else 0.0
    seen_cap = cap
    if w.own:  # as `orchestrator.control.autoscaler.spot_chips_now` sees it from the job's slice events
        seen = [(at, chips, False) for at, chips in s.refusals]
        if s.held is not None and s.held.preemptible:
            seen.append((now, s.held.chips, True))
        seen_cap = spot_chips_known(w.spot_sizes, largest=max(w.spot_sizes, default=0), seen=seen, now=now)
    return Snapshot(now, w.job.deadline_s, w.job.total_tokens, s.done, s.committed, w.job.options, seen_cap, s.held,
                    ready_in, s.hazard, s.availability, w.restart, s.cost, w.job.budget_usd, w.decision_interval_s)


def _decide(w: _World, s: _State, now: float, cap: int) -> None:
    """Ask the policy, and act on its answer: keep the slice, stop, move, or queue a spot request."""
    decision = w.policy.decide(_snapshot(w, s, now, cap))
    s.next_decision_s = now + w.decision_interval_s
    target = decision.option
    queue = w.own and target is not None and target.preemptible and target.chips > cap
    if target is not None and target.preemptible and target.chips > cap and not w.own:
        target = None  # asked for spot that cannot be had: nothing starts
    every_s = decision.checkpoint_interval_s or w.restart.checkpoint_interval_s  # for the target
    if queue and s.held is not None and not w.release_first:  # keep running until the queue fills
        s.queued = _Request(target, now, every_s)
    elif target != s.held:
        s.decisions.append(DecisionRecord(now, target.label if target else "wait", decision.reason))
        _stop(s)
        if queue:  # the request waits in the zone's queue; the old slice is gone already
            s.queued = _Request(target, now, every_s)
        elif target is not None:
            _start(w, s, target, every_s)
    elif target is not None:  # the same slice, perhaps saving at another interval
        s.interval_s = every_s


def _stop(s: _State) -> None:
    """A planned stop: the slice checkpoints first, so nothing is lost."""
    s.committed, s.since_checkpoint_s, s.saving_s = s.done, 0.0, 0.0
    s.held = None


def _start(w: _World, s: _State, option: Option, interval_s: float) -> None:
    """A new slice: provisioning and startup before it trains."""
    s.held = option
    s.slices_started += 1
    s.overhead_steps = w.prov_steps + w.startup_steps
    s.interval_s = interval_s


def _start_up(w: _World, s: _State) -> None:
    """One step of the held slice's provisioning (not billed) or startup (billed, no progress)."""
    if s.overhead_steps <= w.startup_steps:
        _bill(s, w.dt)
    s.overhead_steps -= 1


def _train(w: _World, s: _State, now: float) -> bool:
    """One step of training on the held slice (a save under way pauses it). True once the last token is trained."""
    held = s.held
    pause_s = min(s.saving_s, w.dt)  # a save under way: billed, no progress
    s.saving_s -= pause_s
    train_s = min(w.dt - pause_s, (w.job.total_tokens - s.done) / held.tokens_per_s)
    run_s = pause_s + train_s
    _bill(s, run_s)
    s.done += held.tokens_per_s * train_s
    s.trained += held.tokens_per_s * train_s
    if run_s < w.dt or s.done >= w.job.total_tokens:
        s.done = s.committed = w.job.total_tokens  # the final checkpoint
        s.finish_s = now + run_s
        return True
    s.since_checkpoint_s += train_s
    if s.since_checkpoint_s >= s.interval_s:  # a save at the interval's end (at most one a step)
        s.since_checkpoint_s %= s.interval_s
        s.committed = s.done - held.tokens_per_s * s.since_checkpoint_s
        s.saving_s += w.restart.save_s
    return False


def _bill(s: _State, seconds: float) -> None:
    """The held slice was up for `seconds`: its price, and on spot its hosts' exposure to preemption."""
    held = s.held
    s.cost += held.usd_per_hour / 3600 * seconds
    s.billed[held.label] = s.billed.get(held.label, 0.0) + seconds
    if held.preemptible:
        key = (held.tier, held.zone)
        s.exposure[key] = s.exposure.get(key, 0.0) + held.hosts * seconds / 3600
