"""The running job's side of the cost policy: facts from the store in, a decision out.

`decide_for(store, job_id, now=...)` builds a `policies.cost.Snapshot` from what the job
has shown so far: its measured tokens/s on each slice type it ran on (the scaling model
for the others), the preemptions it suffered (updating the policy's hazard prior), what
its spot slices showed of the zone's capacity (time waiting for it, time up; a refusal in
the last `REFUSAL_HOLDS_S` counts as no capacity of that size now), the restart
costs it measured (provisioning, init, restore, compile, the time a save blocks), the
money spent, and the tokens in its last committed checkpoint. The controller asks before each
provisioning and every `DECISION_INTERVAL_S` while the job runs, and acts on the answer
(records it as an `autoscale` event with the policy's reason, then provisions or
resizes). Only jobs with an `autoscaling` section are autoscaled.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace

from orchestrator import catalog
from orchestrator.observe.goodput import billed_slices, goodput
from orchestrator.user.planning import DEFAULT_FLOPS_PER_TOKEN, job_options
from orchestrator.user.spec import JobSpec, LmWorkload
from orchestrator.state.events import EventKind
from orchestrator.state.store import Event, StepMetric, Store
from policies.cost import (
    REFUSAL_HOLDS_S,
    CostPolicy,
    Decision,
    Option,
    RestartCost,
    Snapshot,
    SpotAvailability,
    SpotHazard,
    spot_chips_known,
)

DECISION_INTERVAL_S = 60.0
NO_DEADLINE_S = 30 * 24 * 3600.0  # a job without a deadline still gets a horizon


@dataclass(frozen=True)
class Choice:
    accelerator: str
    tier: str
    decision: Decision
    checkpoint_interval_steps: int | None = None  # how often the workers should save; None: the spec's


def _flops_per_token(spec: JobSpec) -> float:
    w = spec.workload
    if not isinstance(w, LmWorkload):
        return DEFAULT_FLOPS_PER_TOKEN
    return w.model.shape().flops_per_token(w.seq_len)


def snapshot(store: Store, job_id: str, *, now: float, current: tuple[str, str] | None,
             spot_chips_available: int) -> Snapshot:
    return _snapshot(store, job_id, now=now, current=current, spot_chips_available=spot_chips_available)[0]


def _snapshot(store: Store, job_id: str, *, now: float, current: tuple[str, str] | None,
              spot_chips_available: int) -> tuple[Snapshot, JobSpec, float | None]:
    """The snapshot, with the job's spec and its median step time (None before a few steps)."""
    job = store.job(job_id)
    spec = JobSpec.model_validate({k: v for k, v in job.spec.items() if not k.startswith("_")})
    auto = spec.autoscaling
    w = spec.workload
    tokens_per_step = w.global_batch_size * w.seq_len if isinstance(w, LmWorkload) else 1
    total = (w.steps or 1) * tokens_per_step
    events = store.events(job_id)
    steps = store.steps(job_id)

    # Measured speed per slice type: the step times of the generations that ran on it.
    type_of_generation = {}
    slices = [e.payload for e in events if e.kind is EventKind.SLICE]
    for e in events:
        if e.kind is EventKind.LAUNCHED:
            launched = e.payload
            type_of_generation[launched.generation] = next(
                (s.accelerator for s in slices if s.name == launched.slice), None)
    measured: dict[str, float] = {}
    for name in {v for v in type_of_generation.values() if v}:
        times = [m.step_time_s for m in steps if m.step_time_s and type_of_generation.get(m.generation) == name]
        if len(times) >= 3:
            measured[name] = tokens_per_step / statistics.median(times)
    options = job_options(auto.accelerators, [t.value for t in auto.tiers], flops_per_token=_flops_per_token(spec),
                          measured_tokens_per_s=measured)

    # Restart cost as measured (provisioning, init, restore, compile), the policy's defaults before that;
    # the checkpoint interval of the spec (the longest) and the time a save blocks, once measured.
    changes = [e for e in events if e.kind is EventKind.STATE]
    prov = [e.payload.provision_s for e in changes if e.to_state == "STARTING" and e.payload.provision_s is not None]
    init = [e.payload.init_s for e in changes if e.to_state == "RUNNING" and e.payload.init_s is not None]
    rest = [r.restore_s + r.compile_s for r in (e.payload for e in events if e.kind is EventKind.RESTORE)]
    saved = [e.payload for e in events if e.kind is EventKind.CHECKPOINT]
    saves = [c.blocking_s for c in saved if c.blocking_s is not None]
    restart = RestartCost()
    if prov and rest:
        restart = replace(restart, provisioning_s=statistics.median(prov),
                          startup_s=statistics.median(rest) + (statistics.median(init) if init else 0.0))
    step_s = step_seconds(steps)
    if step_s:
        restart = replace(restart, checkpoint_interval_s=spec.checkpoint.interval_steps * step_s)
    if saves:
        restart = replace(restart, save_s=statistics.median(saves))

    # The hazard prior, updated by what this job saw on spot: host-hours held and preemptions.
    g = goodput(store, job_id, now=now)
    spot_host_hours = sum((b.end - b.start) / 3600 * catalog.lookup(b.accelerator).hosts
                          for b in billed_slices(events, end=now) if b.tier == "spot")
    hazard = SpotHazard().observe("spot", "default", host_hours=spot_host_hours, preemptions=g.preemptions)

    spot = [o for o in options if o.preemptible]
    spot_sizes = sorted({o.chips for o in spot})
    availability = spot_availability(events, now=now, sizes=spot_sizes, zone=spot[0].zone if spot else "default")
    spot_chips_available = spot_chips_now(events, now=now, largest=spot_chips_available, sizes=spot_sizes)

    done_steps = (steps[-1].step + 1) if steps else 0
    committed = max([c.step for c in saved] + [0])
    deadline = job.created_at + (spec.deadline.total_seconds() if spec.deadline else NO_DEADLINE_S)
    holding = None
    if current:
        holding = next((o for o in options if o.name == current[0] and o.tier == current[1]), None)
    snap = Snapshot(now_s=now, deadline_s=deadline, total_tokens=float(total),
                    tokens_done=float(done_steps * tokens_per_step),
                    tokens_committed=float(min(committed, done_steps) * tokens_per_step), options=options,
                    spot_chips_available=spot_chips_available, current=holding, hazard=hazard,
                    availability=availability, restart=restart,
                    spent_usd=g.usd_total, budget_usd=spec.budget_usd, decision_interval_s=DECISION_INTERVAL_S)
    return snap, spec, step_s


def spot_availability(events: list[Event], *, now: float, sizes: list[int],
                      zone: str = "default") -> SpotAvailability:
    """What the job's own spot slices showed of the zone's capacity, on top of the policy's prior.

    A spot slice waiting for capacity (or under a preemption notice) says that its size,
    and every larger one, could not be had then; a spot slice that is up says that its
    size, and every smaller one, could. Nothing is known of the time between slices.
    """
    availability = SpotAvailability()
    for start, end, chips, up in _spot_observations(events, now):
        which = [c for c in sizes if (c <= chips if up else c >= chips)]
        availability = availability.observe(zone, which, chips if up else 0, end - start)
    return availability


def spot_chips_now(events: list[Event], *, now: float, largest: int, sizes: list[int],
                   recent_s: float = REFUSAL_HOLDS_S) -> int:
    """The largest spot slice worth asking for now: `largest` (what the provider allows), less
    what the zone refused the job in the last `recent_s`.

    A spot slice of the job that waited for capacity, or was reclaimed, that recently says
    its size (and every larger one) cannot be had now; a spot slice up since then says its
    size can. Without this, every decision would assume all of spot is there again, and a
    job would queue for the same missing slice until its start timeout, decision after
    decision. Returns 0 when no allowed size is left.
    """
    seen = [(end, chips, up) for _, end, chips, up in _spot_observations(events, now)]
    return spot_chips_known(sizes, largest=largest, seen=seen, now=now, hold_s=recent_s)


def _spot_observations(events: list[Event], now: float) -> list[tuple[float, float, int, bool]]:
    """(start, end, chips, could be had) of each stretch a spot slice of the job spent waiting
    for capacity or under a preemption notice (False), or up (True), oldest first."""
    by_name: dict[str, list[Event]] = {}
    for e in events:
        if e.kind is EventKind.SLICE and e.payload.tier == "spot" and e.payload.chips and e.at <= now:
            by_name.setdefault(e.payload.name, []).append(e)
    seen = []
    for evs in by_name.values():
        for e, after in zip(evs, [*evs[1:], None]):
            state, end = e.payload.state, (min(after.at, now) if after is not None else now)
            if state in ("WAITING", "PREEMPTING", "READY") and end > e.at:
                seen.append((e.at, end, int(e.payload.chips), state == "READY"))
    return sorted(seen)


def with_checkpoint_interval(spec: JobSpec, choice: Choice) -> JobSpec:
    """The spec a launch uses: the policy's checkpoint interval, if it chose one (the stored
    spec keeps the user's, which stays the longest)."""
    every = choice.checkpoint_interval_steps
    if not every or every == spec.checkpoint.interval_steps:
        return spec
    return spec.model_copy(update={"checkpoint": spec.checkpoint.model_copy(update={"interval_steps": every})})


def step_seconds(steps: list[StepMetric]) -> float | None:
    """The median step time over the job's last steps, once it has run a few."""
    times = [m.step_time_s for m in steps[-50:] if m.step_time_s]
    return statistics.median(times) if len(times) >= 3 else None


def decide_for(store: Store, job_id: str, *, now: float, current: tuple[str, str] | None = None,
               spot_chips_available: int) -> Choice | None:
    """The policy's choice for the job now; None when it says to hold no slice (wait for spot).

    The policy's checkpoint interval comes back in steps (at the job's measured step
    time), never longer than the spec's: the spec sets the longest interval, and spot
    slices that are preempted often save more often.
    """
    snap, spec, step_s = _snapshot(store, job_id, now=now, current=current, spot_chips_available=spot_chips_available)
    decision = CostPolicy().decide(snap)
    o: Option | None = decision.option
    if o is None:
        return None
    steps = None
    if step_s and decision.checkpoint_interval_s:
        steps = max(1, min(spec.checkpoint.interval_steps, round(decision.checkpoint_interval_s / step_s)))
    return Choice(o.name, o.tier, decision, steps)
