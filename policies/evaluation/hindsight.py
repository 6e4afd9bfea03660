"""The hindsight optimum: the least any policy could pay to finish a job on a trace
window, knowing the whole trace.

`hindsight_optimum` is a lower bound by construction: a dynamic programme over the same
steps as `policies.evaluation.simulator.simulate` that solves a relaxation of what the
simulator allows. Every rule the simulator enforces, the programme enforces no more
strictly:

- provisioning takes no time in the programme (the simulator provisions a slice while the
  one before it trains, make-before-break, and before the first one nothing trains: both
  are allowed at least as much here), and startup is the simulator's own (rounded to whole
  steps), billed the same;
- a spot slice trains only while the zone has its chips, as in the simulator, but it is given
  up for free just before capacity drops (the clairvoyant job loses no work), and saves cost
  nothing;
- between options of several slices of one type, a resize (a grow the job chooses, a shrink
  the zone forces) enters the new count with `RestartCost.reshape_s` of overhead left, billed
  at the new count's price, from any state of the old count (the simulator relaunches the
  whole group for at least that long, billed, no progress, and provisions the added slices
  while the group trains: `sim_slices.switch`, `sim_slices.shrink`); where the relaunch is no
  shorter than a startup, a resize is priced as a stop and a start (the programme's own
  move, provisioning 0);
- a run that ends mid-step pays the whole step here; the bound takes one step of the
  dearest option off for it.

So no run of the simulator that meets the deadline costs less (tests/unit/
test_optimum_bounds.py checks it over the bundled traces and random small ones). The
schedule reported beside it is one a policy could follow: the cheapest of a few clairvoyant
schedules, each followed by `SchedulePolicy` in `simulate` and priced by it, so the true
optimum of the simulator lies between the bound and the schedule.
`single_slice_optimum` is the same over the job's one-slice options only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from policies.cost.restart_cost import RestartCost
from policies.cost.slice_options import Option
from policies.cost.snapshot import Decision, Snapshot
from policies.evaluation.simulator import SimJob, quantized_restart, simulate, step_seconds
from policies.evaluation.traces import SpotTrace

SCHEDULES_SIMULATED = 4  # clairvoyant schedules priced by the simulator for each optimum
# How much earlier than the deadline each try of the clairvoyant schedules aims.
SCHEDULE_MARGINS_S = (0.0, 1800.0, 3600.0, 7200.0)


@dataclass(frozen=True)
class Optimum:
    """The cheapest any policy could do on this trace window, knowing the future."""

    lower_bound_usd: float  # no simulated run meeting the deadline costs less (Lagrangian dual of the DP)
    schedule_cost_usd: float  # the cheapest clairvoyant schedule simulated that met the deadline (nan: none did)
    schedule_finish_s: float
    feasible: bool


def hindsight_optimum(job: SimJob, trace: SpotTrace, *, start_s: float = 0.0,
                      restart: RestartCost = RestartCost(), schedules: int = SCHEDULES_SIMULATED) -> Optimum:
    """Lower bound on the cost of finishing `job` by its deadline on this trace window, and the
    cheapest followable schedule found on the way.

    The exact problem (state: step, slice, progress) is too large for a progress grid
    fine enough to be exact, so we relax the token target with a price `mu` per token:
    g(mu) = min over schedules of [cost - mu * tokens] + mu * total_tokens. Every
    schedule that finishes costs at least g(mu), so max over mu of g is a lower bound
    (weak duality); g is concave in mu, and we find its maximum by zooming a grid. For
    each mu the inner minimum is an exact DP over (step, idle | slice x overhead left),
    with provisioning 0 (the relaxation above).

    The schedules come from the same DP with the simulator's provisioning (a schedule that
    waits for each slice it asks for): the DP's schedule just above the maximising price,
    its schedule just below with idle stretches filled with on-demand, and the two spliced
    at the step where the target is just reached. Each is run in the simulator by
    `SchedulePolicy`; the cheapest that meets the deadline is reported (`schedules` of them are
    simulated a try; 0: none, the bound alone). The tries aim the schedules at the deadline and at
    `SCHEDULE_MARGINS_S` before it, since the simulator's saves and whole-step provisioning make a
    schedule timed to the last step finish late.
    """
    dt = step_seconds(trace)
    quantized = quantized_restart(restart, dt)
    prov, startup = round(quantized.provisioning_s / dt), round(quantized.startup_s / dt)
    steps = math.ceil(job.deadline_s / dt - 1e-9)
    capacity = trace.capacity_chips(start_s, dt, steps)
    reshape = round(quantized.reshape_s / dt)
    relaxed = _DualProgramme(job.options, capacity, dt, 0, startup, reshape)
    total = job.total_tokens
    grid, g, feasible = _maximise_dual(relaxed, job, total)
    if not feasible:
        return Optimum(math.inf, math.inf, math.inf, False)  # not even the clairvoyant finishes
    k = int(np.argmax(g))
    # A run that finishes mid-step pays only part of that step; the DP pays whole steps.
    bound = max(float(g[k]) - dt * max(o.usd_per_hour for o in job.options) / 3600, 0.0)
    if schedules <= 0:
        return Optimum(bound, math.nan, math.nan, True)
    reach = tuple(int(c) for c in trace.capacity_chips(start_s, dt, steps + 1))
    runs: list[tuple[float, float]] = []
    # A schedule the programme times to the last step finishes a little late in the simulator (its
    # saves, whole-step provisioning), and one aimed earlier can cost less in the simulator than
    # one in time: each try aims earlier, and the cheapest run in time of all the tries is kept.
    for margin_s in SCHEDULE_MARGINS_S:
        short = steps - round(margin_s / dt)
        if short <= prov + startup:
            break
        if margin_s:
            relaxed = _DualProgramme(job.options, capacity[:short], dt, 0, startup, reshape)
            grid, g, _ = _maximise_dual(relaxed, job, total)  # (an aim too early to finish: its runs miss)
            k = int(np.argmax(g))
        dp = _DualProgramme(job.options, capacity[:short], dt, prov, startup)
        for held, levels, lead in _candidates(dp, relaxed, grid, k, job, total, prov)[:schedules]:
            policy = SchedulePolicy(job.options, held, dt, levels, reach, lead)
            run = simulate(policy, job, trace, start_s=start_s, restart=restart, knowledge="own",
                           decision_interval_s=dt)
            if run.deadline_met:
                runs.append((run.cost_usd, run.finish_s or 0.0))
    if not runs:
        return Optimum(bound, math.nan, math.nan, True)
    cost, finish = min(runs)
    return Optimum(bound, float(cost), float(finish), True)


def _maximise_dual(relaxed: _DualProgramme, job: SimJob, total: float) -> tuple[np.ndarray, np.ndarray, bool]:
    """The price grid, zoomed three times around the maximum of g, g on it, and whether the target can be
    reached at all (if not, the grid is left unzoomed)."""
    per_token = np.array([o.usd_per_token for o in job.options])
    grid = np.geomspace(0.5 * per_token.min(), 200 * per_token.max(), 24)
    g = relaxed.dual(grid, total)
    if g[-1] > g[-2] and relaxed.evaluate(relaxed.path(grid[-1]), total)[0] < total:
        return grid, g, False
    for _ in range(3):
        k = int(np.argmax(g))
        grid = np.linspace(grid[max(k - 1, 0)], grid[min(k + 1, len(grid) - 1)], 16)
        g = relaxed.dual(grid, total)
    return grid, g, True


def _candidates(dp: _DualProgramme, relaxed: _DualProgramme, grid: np.ndarray, k: int, job: SimJob, total: float,
                prov: int) -> list[tuple[tuple[int, ...], int, int]]:
    """Schedules to try in the simulator, cheapest first in the programme's own arithmetic (those
    short of the target last): (states held, overhead levels, provisioning lead)."""
    above, below = dp.path(grid[min(k + 1, len(grid) - 1)]), dp.path(grid[max(k - 1, 0)])
    paths = [above, dp.splice_to_target(above, below, total), dp.splice_to_target(below, above, total)]
    paths += [dp.fill(below, d, total) for d in range(len(job.options)) if not job.options[d].preemptible]
    # The same from the relaxed programme, each slice asked for `prov` steps before it starts.
    r_above, r_below = relaxed.path(grid[min(k + 1, len(grid) - 1)]), relaxed.path(grid[max(k - 1, 0)])
    relaxed_schedules = [r_above, relaxed.splice_to_target(r_above, r_below, total),
                         relaxed.splice_to_target(r_below, r_above, total)]
    candidates = {(tuple(int(x) for x in h), dp.k, 0): dp.evaluate(h, total) for h in paths}
    candidates |= {(tuple(int(x) for x in h), relaxed.k, prov): relaxed.evaluate(h, total) for h in relaxed_schedules}
    return sorted(candidates, key=lambda c: (candidates[c][0] < total, candidates[c][1]))


def single_slice_optimum(job: SimJob, trace: SpotTrace, *, start_s: float = 0.0,
                         restart: RestartCost = RestartCost(), schedules: int = SCHEDULES_SIMULATED) -> Optimum:
    """`hindsight_optimum` over the job's one-slice options (what the optimum was before
    multi-slice options)."""
    return hindsight_optimum(replace(job, options=tuple(o for o in job.options if o.count == 1)), trace,
                             start_s=start_s, restart=restart, schedules=schedules)


@dataclass
class SchedulePolicy:
    """Follows a DP schedule in the simulator (asked every step: `decision_interval_s` = the step).

    `held[t]`: the DP state during step t (IDLE, or option c with j overhead steps left, flat
    as c * (k + 1) + j). The next slice of the schedule within `lead` steps (the provisioning
    a schedule without it needs) is requested now, beside the running one (make-before-break),
    and switched onto when READY; the running slice is kept until the schedule leaves it, or
    stopped a step early, at a committed step, where the zone takes it back at the next step
    (`capacity`, chips by step), so that the reclaim loses no work. Past the schedule's last
    slice (a job the saves and the stops left short of its target), its last slice if on-demand,
    else the fastest on-demand option."""

    options: tuple[Option, ...]
    held: tuple[int, ...]
    dt: float
    k: int
    capacity: tuple[int, ...]
    lead: int = 0
    name: str = "schedule"

    def __post_init__(self) -> None:
        self._last = max((u for u, state in enumerate(self.held) if state != IDLE), default=-1)

    def _option(self, t: int) -> Option | None:
        if t > self._last:
            last = self.options[self.held[self._last] // (self.k + 1)] if self._last >= 0 else None
            if last is not None and not last.preemptible:
                return last
            return max((o for o in self.options if not o.preemptible), key=lambda o: o.tokens_per_s, default=None)
        state = self.held[t]
        return None if state == IDLE else self.options[state // (self.k + 1)]

    def decide(self, snap: Snapshot) -> Decision:
        t, c = int(round(snap.now_s / self.dt)), snap.current
        coming = [self._option(u) for u in range(t, t + self.lead + 1)]
        upcoming = next((o for o in coming if o is not None and o != c), None)
        if c is not None and c.preemptible and t + 1 < len(self.capacity) and self.capacity[t + 1] < c.chips:
            return Decision(None, "the clairvoyant schedule: stop before a reclaim", math.nan, math.nan,
                            wait_for=upcoming)
        target: Option | None
        if c is not None and (coming[0] == c or (coming[0] is None and upcoming is not None)):
            target = upcoming or c  # keep training while the next slice provisions
        else:
            target = coming[0] if coming[0] is not None else upcoming
        return Decision(target, "the clairvoyant schedule", math.nan, math.nan)


IDLE = -1


class _DualProgramme:
    """The inner DP of `hindsight_optimum`.

    State at a step boundary: idle, or (slice c, j overhead steps left; j = 0 trains),
    flattened as c * (k + 1) + j. At each boundary a slice may be given up for free (the
    clairvoyant job checkpoints just before each preemption) and a new one requested,
    entering at j = k = prov + startup. Overhead steps j <= startup are billed; training
    steps are billed and add tokens.
    """

    def __init__(self, options, capacity, dt, prov, startup, reshape=None):
        self.dt, self.k, self.startup = dt, prov + startup, startup
        self.price = np.array([o.usd_per_hour / 3600 * dt for o in options])  # $ per step
        self.tokens = np.array([o.tokens_per_s * dt for o in options])  # tokens per training step
        chips = np.array([o.chips for o in options])
        spot = np.array([o.preemptible for o in options])
        self.usable = ~spot[None, :] | (chips[None, :] <= np.asarray(capacity)[:, None])  # [step, option]
        self.blocked = np.where(self.usable, 0.0, np.inf)[:, None, :, None]  # [step, 1, option, 1]
        j = np.arange(self.k + 1)
        self.step_cost = self.price[:, None] * ((j >= 1) & (j <= startup))[None, :]  # [option, j]
        # Between options of one type, tier and zone (counts of slices), at any step: the new count
        # entered with the relaunch's overhead left (`reshape` steps, billed at its price). Only
        # the bound (`dual`) uses them, and only where a relaunch is shorter than a stop and a
        # start (a release is free and a start enters at k): (from, to) pairs.
        self.reshape = self.k if reshape is None else min(int(reshape), self.k)
        self.resizes = [(a, b) for a, oa in enumerate(options) for b, ob in enumerate(options)
                        if a != b and (oa.name, oa.tier, oa.zone) == (ob.name, ob.tier, ob.zone)
                        ] if self.reshape < self.k else []

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
            # A resize from any state held through the last step (not one entered now: the
            # simulator switches onto the added slices at a later decision): the simulator
            # relaunches a resized group.
            held = value.min(axis=2)  # [mu, option]
            value[:, :, k] = np.minimum(value[:, :, k], idle[:, None])
            for a, b in self.resizes:
                value[:, b, self.reshape] = np.minimum(value[:, b, self.reshape], held[:, a])
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
