"""Replay a spot capacity trace against any policy; baselines; the hindsight optimum.

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

`hindsight_optimum` is the lower bound: a dynamic programme over the same steps that
knows the whole trace, and so also knows when each preemption comes and loses no work
to it. Everything else (overheads, billing, capacity) is the same as in `simulate`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from policies.cost import SAFETY_MARGIN_S
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
    own = knowledge == "own"
    dt = step_seconds(trace)
    restart = quantized_restart(restart, dt)
    prov_steps = round(restart.provisioning_s / dt)
    startup_steps = round(restart.startup_s / dt)
    max_steps = math.ceil(MAX_DEADLINES_SIMULATED * job.deadline_s / dt)
    capacity = trace.capacity_chips(start_s, dt, max_steps)
    spot_sizes = sorted({o.chips for o in job.options if o.tier == SPOT})

    held: Option | None = None
    overhead_steps = 0  # steps left before the held slice trains
    done = committed = trained = lost = cost = 0.0
    since_checkpoint_s = saving_s = 0.0  # training since the last save; save time still to pay
    interval_s = restart.checkpoint_interval_s
    preemptions = slices_started = 0
    billed: dict[str, float] = {}
    decisions: list[DecisionRecord] = []
    finish_s: float | None = None
    next_decision_s = 0.0
    unobserved_s = 0.0  # time at the previous capacity not yet fed to the availability estimate
    exposure: dict[tuple[str, str], float] = {}  # spot host-hours not yet fed to the hazard estimate
    queued: Option | None = None  # knowledge "own": a spot request waiting in the zone's queue
    queued_at = queued_interval_s = 0.0
    refusals: list[tuple[float, int]] = []  # (when, chips): spot the zone refused the job
    shown: tuple[tuple[int, ...], int] | None = None  # what the job's own slices show: (sizes, capacity)
    shown_s = 0.0  # for how long, not yet fed to the availability estimate

    def own_view() -> tuple[tuple[int, ...], int] | None:
        if held is not None and held.preemptible:
            return tuple(c for c in spot_sizes if c <= held.chips), held.chips
        if queued is not None:
            return tuple(c for c in spot_sizes if c >= queued.chips), 0
        return None

    for i in range(max_steps):
        now, cap = i * dt, int(capacity[i])
        if own and i > 0:  # the state of the step before lasted through it
            view = own_view()
            if view != shown:
                if shown is not None and shown[0]:
                    availability = availability.observe(zone, shown[0], shown[1], shown_s)
                shown, shown_s = view, 0.0
            shown_s += dt
        changed = i > 0 and cap != capacity[i - 1] and not own  # a capacity feed shows every change
        preempted = held is not None and held.preemptible and cap < held.chips
        expired = False
        if queued is not None:
            if cap >= queued.chips:  # capacity came: the slice provisions
                if held is not None:  # queued beside a running slice: a planned stop checkpoints first
                    committed, since_checkpoint_s, saving_s = done, 0.0, 0.0
                    decisions.append(DecisionRecord(now, queued.label, "queued spot request filled"))
                held, queued = queued, None
                slices_started += 1
                overhead_steps = prov_steps + startup_steps
                interval_s = queued_interval_s
            elif now - queued_at >= queue_timeout_s:
                refusals.append((now, queued.chips))
                queued, expired = None, True
        if preempted:
            if own:
                refusals.append((now, held.chips))
            if overhead_steps <= startup_steps:  # billed, so the slice existed: a preemption
                preemptions += 1
                hazard = hazard.observe(held.tier, held.zone, host_hours=0.0, preemptions=1)
                if restart.saves_on_notice:
                    committed = done
                lost += done - committed
                done = committed
            held, since_checkpoint_s, saving_s = None, 0.0, 0.0
        if queued is not None or (i > 0 and not (changed or preempted or expired or now >= next_decision_s - 1e-9)):
            unobserved_s += dt
        else:  # a decision point: learn from what happened since the last one, then ask
            if own:
                if shown is not None and shown[0] and shown_s > 0:
                    availability = availability.observe(zone, shown[0], shown[1], shown_s)
                shown_s = 0.0
            elif i > 0:  # capacity was constant since the last decision point (a change is one)
                availability = availability.observe(zone, spot_sizes, int(capacity[i - 1]), unobserved_s + dt)
            for (tier, spot_zone), host_hours in exposure.items():
                hazard = hazard.observe(tier, spot_zone, host_hours=host_hours)
            unobserved_s, exposure = 0.0, {}
            ready_in = overhead_steps * dt if held is not None else 0.0
            seen_cap = cap
            if own:  # as `orchestrator.control.autoscaler.spot_chips_now` sees it from the job's slice events
                seen = [(at, chips, False) for at, chips in refusals]
                if held is not None and held.preemptible:
                    seen.append((now, held.chips, True))
                seen_cap = spot_chips_known(spot_sizes, largest=max(spot_sizes, default=0), seen=seen, now=now)
            snap = Snapshot(now, job.deadline_s, job.total_tokens, done, committed, job.options, seen_cap, held,
                            ready_in, hazard, availability, restart, cost, job.budget_usd, decision_interval_s)
            decision = policy.decide(snap)
            next_decision_s = now + decision_interval_s
            target = decision.option
            queue = own and target is not None and target.preemptible and target.chips > cap
            if target is not None and target.preemptible and target.chips > cap and not own:
                target = None  # asked for spot that cannot be had: nothing starts
            every_s = decision.checkpoint_interval_s or restart.checkpoint_interval_s  # for the target
            if queue and held is not None and not release_first:  # keep running until the queue fills
                queued, queued_at, queued_interval_s = target, now, every_s
            elif target != held:
                decisions.append(DecisionRecord(now, target.label if target else "wait", decision.reason))
                committed = done  # a planned stop checkpoints first
                since_checkpoint_s = saving_s = 0.0
                held = target
                if queue:  # the request waits in the zone's queue; the old slice is gone already
                    held, queued, queued_at, queued_interval_s = None, target, now, every_s
                elif held is not None:
                    slices_started += 1
                    overhead_steps = prov_steps + startup_steps
                    interval_s = every_s
            elif target is not None:  # the same slice, perhaps saving at another interval
                interval_s = every_s
        if held is None:
            continue
        usd_per_s = held.usd_per_hour / 3600
        if overhead_steps > 0:
            if overhead_steps <= startup_steps:
                cost += usd_per_s * dt
                billed[held.label] = billed.get(held.label, 0.0) + dt
                if held.preemptible:
                    key = (held.tier, held.zone)
                    exposure[key] = exposure.get(key, 0.0) + held.hosts * dt / 3600
            overhead_steps -= 1
            continue
        pause_s = min(saving_s, dt)  # a save under way: billed, no progress
        saving_s -= pause_s
        train_s = min(dt - pause_s, (job.total_tokens - done) / held.tokens_per_s)
        run_s = pause_s + train_s
        cost += usd_per_s * run_s
        billed[held.label] = billed.get(held.label, 0.0) + run_s
        if held.preemptible:
            key = (held.tier, held.zone)
            exposure[key] = exposure.get(key, 0.0) + held.hosts * run_s / 3600
        done += held.tokens_per_s * train_s
        trained += held.tokens_per_s * train_s
        if run_s < dt or done >= job.total_tokens:
            done = committed = job.total_tokens  # the final checkpoint
            finish_s = now + run_s
            break
        since_checkpoint_s += train_s
        if since_checkpoint_s >= interval_s:  # a save at the interval's end (at most one a step)
            since_checkpoint_s %= interval_s
            committed = done - held.tokens_per_s * since_checkpoint_s
            saving_s += restart.save_s

    return Run(policy.name, trace.name, start_s, job.total_tokens, job.deadline_s, cost, finish_s,
               trained, lost, preemptions, slices_started, billed, tuple(decisions))


# --- Baselines ------------------------------------------------------------------------


@dataclass(frozen=True)
class FixedPolicy:
    """Always the same option; for spot, wait whenever it cannot be had and restart after."""

    option: Option
    name: str = "fixed"

    def decide(self, snap: Snapshot) -> Decision:
        if self.option.preemptible and self.option.chips > snap.spot_chips_available:
            return Decision(None, f"wait for spot {self.option.name}", math.nan, math.nan)
        return Decision(self.option, f"always {self.option.label}", math.nan, math.nan)


@dataclass(frozen=True)
class GreedyPolicy:
    """Can't Be Late's greedy rule: spot whenever it can be had, else wait; once the slack
    to finish on on-demand falls under the margin, on-demand until the end."""

    spot: Option
    on_demand: Option
    safety_margin_s: float = SAFETY_MARGIN_S
    name: str = "greedy"

    def decide(self, snap: Snapshot) -> Decision:
        left = snap.total_tokens - snap.tokens_committed
        fallback_s = (snap.decision_interval_s + snap.restart.overhead_s
                      + snap.restart.train_s(left, self.on_demand.tokens_per_s))
        if snap.current == self.on_demand or snap.deadline_s - snap.now_s - fallback_s < self.safety_margin_s:
            return Decision(self.on_demand, "slack exhausted: on-demand to the end", math.nan, math.nan)
        if self.spot.chips <= snap.spot_chips_available:
            return Decision(self.spot, "spot available", math.nan, math.nan)
        return Decision(None, "wait for spot", math.nan, math.nan)


# --- Hindsight optimum ----------------------------------------------------------------


@dataclass(frozen=True)
class Optimum:
    """The cheapest any policy could do on this trace window, knowing the future."""

    lower_bound_usd: float  # no run meeting the deadline costs less (Lagrangian dual of the DP)
    schedule_cost_usd: float  # an actual clairvoyant schedule; the optimum lies in between
    schedule_finish_s: float
    feasible: bool


def hindsight_optimum(job: SimJob, trace: SpotTrace, *, start_s: float = 0.0, restart: RestartCost = RestartCost()) -> Optimum:
    """Lower bound on the cost of finishing `job` by its deadline on this trace window.

    The exact problem (state: step, slice, progress) is too large for a progress grid
    fine enough to be exact, so we relax the token target with a price `mu` per token:
    g(mu) = min over schedules of [cost - mu * tokens] + mu * total_tokens. Every
    schedule that finishes costs at least g(mu), so max over mu of g is a lower bound
    (weak duality); g is concave in mu, and we find its maximum by zooming a grid. For
    each mu the inner minimum is an exact DP over (step, idle | slice x overhead left).

    The schedule reported beside the bound is a real clairvoyant schedule, so the true
    optimum lies between the two. It is the cheapest of: the DP's schedule just above
    the maximising price (it reaches the target, often with time to spare), its
    schedule just below (short of the target) with idle stretches filled with
    on-demand, and the two spliced at the step where the target is just reached.
    """
    dt = step_seconds(trace)
    restart = quantized_restart(restart, dt)
    prov, startup = round(restart.provisioning_s / dt), round(restart.startup_s / dt)
    steps = math.ceil(job.deadline_s / dt - 1e-9)
    dp = _DualProgramme(job.options, trace.capacity_chips(start_s, dt, steps), dt, prov, startup)
    total = job.total_tokens
    per_token = np.array([o.usd_per_token for o in job.options])
    grid = np.geomspace(0.5 * per_token.min(), 200 * per_token.max(), 24)
    g = dp.dual(grid, total)
    if g[-1] > g[-2] and dp.evaluate(dp.path(grid[-1]), total)[0] < total:
        return Optimum(math.inf, math.inf, math.inf, False)  # not even the clairvoyant finishes
    for _ in range(3):
        k = int(np.argmax(g))
        grid = np.linspace(grid[max(k - 1, 0)], grid[min(k + 1, len(grid) - 1)], 16)
        g = dp.dual(grid, total)
    k = int(np.argmax(g))
    # A run that finishes mid-step pays only part of that step; the DP pays whole steps.
    bound = max(float(g[k]) - dt * max(o.usd_per_hour for o in job.options) / 3600, 0.0)
    above, below = dp.path(grid[min(k + 1, len(grid) - 1)]), dp.path(grid[max(k - 1, 0)])
    schedules = [above, dp.splice_to_target(above, below, total), dp.splice_to_target(below, above, total)]
    schedules += [dp.fill(below, d, total) for d in range(len(job.options)) if not job.options[d].preemptible]
    outcomes = [dp.evaluate(path, total) for path in schedules]
    done = [(cost, finish) for tokens, cost, finish in outcomes if tokens >= total]
    if not done:
        return Optimum(bound, math.nan, math.nan, True)
    cost, finish = min(done)
    return Optimum(min(bound, float(cost)), float(cost), float(finish), True)


IDLE = -1


class _DualProgramme:
    """The inner DP of `hindsight_optimum`.

    State at a step boundary: idle, or (slice c, j overhead steps left; j = 0 trains),
    flattened as c * (k + 1) + j. At each boundary a slice may be given up for free (the
    clairvoyant job checkpoints just before each preemption) and a new one requested,
    entering at j = k = prov + startup. Overhead steps j <= startup are billed; training
    steps are billed and add tokens.
    """

    def __init__(self, options, capacity, dt, prov, startup):
        self.dt, self.k, self.startup = dt, prov + startup, startup
        self.price = np.array([o.usd_per_hour / 3600 * dt for o in options])  # $ per step
        self.tokens = np.array([o.tokens_per_s * dt for o in options])  # tokens per training step
        chips = np.array([o.chips for o in options])
        spot = np.array([o.preemptible for o in options])
        self.usable = ~spot[None, :] | (chips[None, :] <= np.asarray(capacity)[:, None])  # [step, option]
        self.blocked = np.where(self.usable, 0.0, np.inf)[:, None, :, None]  # [step, 1, option, 1]
        j = np.arange(self.k + 1)
        self.step_cost = self.price[:, None] * ((j >= 1) & (j <= startup))[None, :]  # [option, j]

    def _step_value(self, mu: np.ndarray) -> np.ndarray:
        value = np.broadcast_to(self.step_cost, (len(mu), *self.step_cost.shape)).copy()
        value[:, :, 0] = self.price[None, :] - mu[:, None] * self.tokens[None, :]
        return value  # [mu, option, j]: cost minus mu x tokens of spending one step in the state

    def dual(self, mu: np.ndarray, total_tokens: float) -> np.ndarray:
        """g(mu) for each price in `mu`."""
        k, step_value = self.k, self._step_value(mu)
        value = np.full(step_value.shape, np.inf)
        idle = np.zeros(len(mu))
        for blocked in self.blocked:
            idle = np.minimum(idle, value.reshape(len(mu), -1).min(axis=1))
            value[:, :, k] = np.minimum(value[:, :, k], idle[:, None])
            value += blocked
            new = np.full_like(value, np.inf)  # nobody is at j = k until a slice is requested
            new[:, :, :k] = value[:, :, 1:] + step_value[:, :, 1:]
            new[:, :, 0] = np.minimum(new[:, :, 0], value[:, :, 0] + step_value[:, :, 0])
            value = new
        return np.minimum(idle, value.reshape(len(mu), -1).min(axis=1)) + mu * total_tokens

    def path(self, mu: float) -> np.ndarray:
        """The minimising schedule at one price: the state held during each step (IDLE or flat)."""
        k, step_value = self.k, self._step_value(np.array([mu]))[0]
        n_steps, n_opt = len(self.blocked), len(self.price)
        released = np.full(n_steps, IDLE)  # state given up at the start of step t, if any
        entered = np.zeros((n_steps, n_opt), bool)  # (c, k) requested from idle at step t
        trained = np.zeros((n_steps, n_opt), bool)  # (c, 0) after step t came from training
        value, idle = np.full(step_value.shape, np.inf), 0.0
        for t, blocked in enumerate(self.blocked[:, 0]):
            best = int(np.argmin(value))
            if value.flat[best] < idle:
                idle, released[t] = float(value.flat[best]), best
            entered[t] = idle < value[:, k]
            value[:, k] = np.where(entered[t], idle, value[:, k])
            value = value + blocked
            new = np.full_like(value, np.inf)
            new[:, :k] = value[:, 1:] + step_value[:, 1:]
            train = value[:, 0] + step_value[:, 0]
            trained[t] = train <= new[:, 0]
            new[:, 0] = np.where(trained[t], train, new[:, 0])
            value = new
        held = np.full(n_steps, IDLE)
        state = int(np.argmin(value)) if value.min() < idle else IDLE
        for t in range(n_steps - 1, -1, -1):  # walk back: the state held during step t
            if state != IDLE:
                c, j = divmod(state, k + 1)
                state = state if j == 0 and trained[t, c] else c * (k + 1) + j + 1
            held[t] = state
            if state != IDLE and state % (k + 1) == k and entered[t, state // (k + 1)]:
                state = IDLE  # requested from idle at this step
            if state == IDLE and released[t] != IDLE:
                state = int(released[t])
        return held

    def evaluate(self, held: np.ndarray, total_tokens: float) -> tuple[float, float, float]:
        """Tokens, cost up to the target and time the target is reached (inf if never) of a schedule."""
        k, tokens, cost = self.k, 0.0, 0.0
        for t, state in enumerate(held):
            if state == IDLE:
                continue
            c, j = divmod(int(state), k + 1)
            if j == 0:
                part = min(1.0, (total_tokens - tokens) / self.tokens[c])
                tokens, cost = tokens + part * self.tokens[c], cost + part * self.price[c]
                if tokens >= total_tokens - 1e-6:
                    return total_tokens, cost, (t + part) * self.dt
            elif j <= self.startup:
                cost += self.price[c]
        return tokens, cost, math.inf

    def splice(self, first: np.ndarray, second: np.ndarray, at: int) -> np.ndarray:
        """`first` before step `at`, `second` from it; a slice of `second` already under way
        at `at` is started afresh there (its overhead again, then training)."""
        k, held = self.k, np.concatenate([first[:at], second[at:]])
        if at >= len(held) or held[at] == IDLE:
            return held
        c = held[at] // (k + 1)
        continues = at > 0 and first[at - 1] != IDLE and first[at - 1] // (k + 1) == c and (
            first[at - 1] % (k + 1) in (0, held[at] % (k + 1) + 1))
        if continues:
            return held
        run = at
        while run < len(held) and held[run] != IDLE and held[run] // (k + 1) == c:
            run += 1
        length = run - at
        fresh = np.maximum(np.arange(k, k - length, -1), 0)  # overhead counting down, then training
        held[at:run] = c * (k + 1) + fresh if length > k else IDLE  # too short to train: skip it
        return held

    def splice_to_target(self, first: np.ndarray, second: np.ndarray, total_tokens: float) -> np.ndarray:
        """The splice of `first` then `second` at the step where the target is just reached
        (bisection; progress grows with the share of the faster schedule)."""
        reaches = [self.evaluate(self.splice(first, second, at), total_tokens)[0] >= total_tokens
                   for at in (0, len(first))]
        if reaches[0] == reaches[1]:
            return second if reaches[0] else first
        lo, hi = 0, len(first)  # reaches at lo differs from reaches at hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if (self.evaluate(self.splice(first, second, mid), total_tokens)[0] >= total_tokens) == reaches[0]:
                lo = mid
            else:
                hi = mid
        return self.splice(first, second, lo if reaches[0] else hi)

    def fill(self, held: np.ndarray, option: int, total_tokens: float) -> np.ndarray:
        """`held` with on-demand `option` added in its idle stretches, longest first, until the
        schedule reaches the target (or no stretch is long enough to train in)."""
        k, filled = self.k, held.copy()
        need = total_tokens - self.evaluate(held, total_tokens)[0]
        idle = np.flatnonzero(held == IDLE)
        stretches = np.split(idle, np.flatnonzero(np.diff(idle) != 1) + 1) if len(idle) else []
        for stretch in sorted(stretches, key=len, reverse=True):
            if need <= 0 or len(stretch) <= k:
                break
            train = min(len(stretch) - k, math.ceil(need / self.tokens[option]))
            filled[stretch[: k + train]] = option * (k + 1) + np.r_[np.arange(k, 0, -1), np.zeros(train, int)]
            need -= train * self.tokens[option]
        return filled
