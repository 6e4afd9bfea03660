"""The running job's side of the cost policy: facts from the store in, a decision out.

`decide(store, job_id, now=..., current=..., waiting=...)` is what the job's driver
calls: before provisioning, every `Clock.decision_interval_wall_s` while the job runs,
and at once when its slice is lost or a request is let go. It builds the policy's
`Snapshot` with `policies.cost.knowledge.build_snapshot`, the function the trace simulator
uses, from the same kind of records: the job's slice events read as
`policies.cost.slice_history.SliceRecord`s, with the slice events of earlier jobs in the
same zone first (pooled capacity memory: slice events outlive their job, so the next
job starts from what the last one learned). Besides those it hands in what only a
running job measures: its tokens/s on each slice type it ran on (the scaling model for
the others), the restart costs (provisioning, init, restore, compile, the time a save
blocks), the money spent and the tokens in its last committed checkpoint.

Its options are (slice count, type, tier): `autoscaling.max_slices` above 1 adds, for each
allowed type, up to that many slices of it at once (32 chips in all at most, a global batch
that splits evenly over them and a mesh that fits each slice's share), priced with the DCN
cost of reducing gradients across slices (`policies.cost.slice_options.multi_slice_options`).
The running slices and a waiting request are named by (type, tier, count).

The answer is a `Choice`: the slice type, tier and count the policy wants (None: hold no slice,
wait for spot), and the `policies.cost.moves.Move` that gets the job there make-before-break:
what to request (beside the running slice, if any: a move, or the spot size the
policy's plan waits for), whether to switch onto a READY request, to release the waiting
request, or to release the running slice. A refused request is a capacity fact in the
records, never a failure.

Times: the store's are wall-clock; the policy's are seconds from the job's creation on
the job's `Clock` (`clock_of`: a spot trace replayed at `time_scale` trace seconds a wall
second runs the policy on trace time, so its decisions match the simulator's on that
trace). Only jobs with an `autoscaling` section are autoscaled.
"""

from __future__ import annotations

import bisect
import functools
import operator
import statistics
import threading
import weakref
from dataclasses import dataclass, replace

from orchestrator import catalog
from orchestrator.control.priors import with_priors
from orchestrator.domain.options import DEFAULT_FLOPS_PER_TOKEN, DEFAULT_PARAMS, job_options
from orchestrator.domain.spec import JobSpec, LmWorkload
from orchestrator.errors import UnknownAcceleratorError
from orchestrator.observe.goodput import goodput
from orchestrator.state.events import CheckpointSaved, EventKind, Launched, Restored, SliceChanged, StateChange
from orchestrator.state.states import JobState
from orchestrator.state.store import Event, StepMetric, Store
from policies.cost.capacity_memory import POOL_HORIZON_S, chips_known, estimates, pooled
from policies.cost.clock import DECISION_INTERVAL_S, Clock
from policies.cost.knowledge import Progress, build_snapshot
from policies.cost.moves import Move, next_move
from policies.cost.policy import CostPolicy
from policies.cost.restart_cost import RestartCost
from policies.cost.slice_history import SliceRecord, read_history
from policies.cost.slice_options import MultiSlice, Option, multi_slice_options
from policies.cost.snapshot import Decision, Snapshot
from policies.cost.spot_estimates import REFUSAL_HOLDS_S, SpotAvailability
from policies.model.sharding import MeshError

__all__ = ["DECISION_INTERVAL_S", "NO_DEADLINE_S", "Choice", "clock_of", "decide", "decide_for", "slice_records",
           "snapshot", "spot_availability", "spot_chips_now", "step_seconds", "with_checkpoint_interval"]

NO_DEADLINE_S = 30 * 24 * 3600.0  # a job without a deadline still gets a horizon

# (accelerator, tier, slices) of the running slices or a request; (accelerator, tier): one slice.
Key = tuple[str, str, int] | tuple[str, str]


@dataclass(frozen=True)
class Choice:
    accelerator: str | None  # None: hold no slice, wait for spot
    tier: str | None
    decision: Decision
    checkpoint_interval_steps: int | None = None  # how often the workers should save; None: the spec's
    move: Move | None = None  # what to do with the job's slices to get there
    count: int = 1  # slices of `accelerator` at once


def clock_of(spec: JobSpec) -> Clock:
    """The job's policy clock: trace time for a replayed capacity trace, else wall time."""
    return Clock(spec.capacity_trace.time_scale) if spec.capacity_trace is not None else Clock()


def zone_of(spec: JobSpec) -> str:
    if spec.zone:
        return spec.zone
    return spec.gcp.zones[0] if spec.gcp is not None else "default"


@functools.cache  # a catalog lookup for each slice record of each decision
def _hosts(accelerator: str | None, chips: int) -> int:
    try:
        return catalog.lookup(accelerator).hosts if accelerator else max(chips // 4, 1)
    except UnknownAcceleratorError:
        return max(chips // 4, 1)


def slice_records(events: list[Event], *, origin: float = 0.0, clock: Clock = Clock(),
                  zone: str | None = None) -> list[SliceRecord]:
    """The slice events among `events` as the policy's records: times in policy seconds from
    `origin` on `clock`; `zone` (if given) for every record, else the event's own."""
    return [_record(at, p, origin=origin, clock=clock, zone=zone) for at, _, p in _slice_changes(events)]


def _slice_changes(events: list[Event]) -> list[tuple[float, str, SliceChanged]]:
    """(when, whose job, what) of the slice events among `events` that the policy can use."""
    out = []
    for e in events:
        p = e.payload_as(SliceChanged) if e.kind is EventKind.SLICE else None
        if p is not None and p.name and p.state and p.chips:
            out.append((e.at, e.job_id, p))
    return out


def _record(at: float, p: SliceChanged, *, origin: float, clock: Clock, zone: str | None) -> SliceRecord:
    where = zone or _zone(p)
    return SliceRecord(clock.policy_s(at - origin), str(p.name), str(p.state), str(p.tier or "?"),
                       int(p.chips or 0), _hosts(p.accelerator, int(p.chips or 0)), where)


class _PooledSlices:
    """Every job's slice events, read from the store once each (by seq) and kept parsed, by zone and in time
    order: each autoscaled job's decision pools the others' in its zone since the pool's horizon. Reading and
    parsing them all again for each decision made the policy's cost grow with the square of the jobs (the
    fleet benchmark at N=300: a fifth of the controller's time); sorting and filtering every zone's kept
    changes for each decision was still 16% of it at N=1,000."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seq = 0
        self._by_zone: dict[str, list[tuple[float, int, str, SliceChanged]]] = {}  # zone -> (at, seq, job, what)

    def others(self, store: Store, *, zone: str, since: float,
               exclude_job: str) -> list[tuple[float, str, SliceChanged]]:
        """The slice changes in `zone` (an event without one is "default"'s) of every job but `exclude_job` at
        or after `since`, oldest first (as `Store.slice_events` orders them)."""
        with self._lock:
            for e in store.slice_events(since=float("-inf"), after_seq=self._seq):
                self._seq = max(self._seq, e.seq)
                for at, job, p in _slice_changes([e]):
                    bisect.insort(self._by_zone.setdefault(_zone(p), []), (at, e.seq, job, p), key=_at_seq)
            changes = self._by_zone.get(zone, [])
            first = bisect.bisect_left(changes, since, key=_at)
            kept = changes[first:]
        return [(at, job, p) for at, _, job, p in kept if job != exclude_job]


def _zone(p: SliceChanged) -> str:
    return getattr(p, "zone", None) or "default"


_at, _at_seq = operator.itemgetter(0), operator.itemgetter(0, 1)  # of a kept (at, seq, job, what)


_POOLED: weakref.WeakKeyDictionary[Store, _PooledSlices] = weakref.WeakKeyDictionary()
_POOLED_LOCK = threading.Lock()


def _pooled(store: Store) -> _PooledSlices:
    with _POOLED_LOCK:
        pooled = _POOLED.get(store)
        if pooled is None:
            pooled = _POOLED[store] = _PooledSlices()
        return pooled


def _flops_per_token(spec: JobSpec) -> float:
    w = spec.workload
    if not isinstance(w, LmWorkload):
        return DEFAULT_FLOPS_PER_TOKEN
    return w.model.shape().flops_per_token(w.seq_len)


def _option(options: tuple[Option, ...], which: Key | None) -> Option | None:
    if which is None:
        return None
    name, tier, *count = which
    return next((o for o in options if (o.name, o.tier, o.count) == (name, tier, count[0] if count else 1)), None)


def _params(spec: JobSpec) -> float:
    w = spec.workload
    return float(w.model.shape().num_params()) if isinstance(w, LmWorkload) else DEFAULT_PARAMS


def _fits(spec: JobSpec, o: Option) -> bool:
    """Whether the job can train on `o`'s slices: its batch splits evenly over them and each
    slice's share has a mesh on the slice."""
    from orchestrator.control.launch import training_settings

    if o.count == 1:
        return True
    try:
        training_settings(spec.moved(o.name, o.tier), o.slice_chips, o.slice_hosts, slices=o.count)
    except MeshError:
        return False
    return True


def counted_options(spec: JobSpec, singles: tuple[Option, ...], tokens_per_step: float, *,
                    params: float | None = None) -> tuple[Option, ...]:
    """`singles` and, up to `autoscaling.max_slices`, several slices of each type the job fits on.
    `params`: the parameters the slices all-reduce each step, where the spec's model does not say (a
    program of the user's own); default: the built-in model's, else `DEFAULT_PARAMS`."""
    auto = spec.autoscaling
    count = auto.max_slices if auto is not None else 1
    if count <= 1:
        return singles
    multi = MultiSlice(params or _params(spec), float(tokens_per_step), max_count=count)
    return tuple(o for o in multi_slice_options(singles, multi, count) if _fits(spec, o))


def _restart(events: list[Event], spec: JobSpec, step_s: float | None, clock: Clock) -> RestartCost:
    """Restart cost as measured (provisioning, init, restore, compile), the policy's defaults before
    that; the checkpoint interval of the spec (the longest) and the time a save blocks, once measured."""
    changes = [e for e in events if e.kind is EventKind.STATE]
    prov = [s for e in changes
            if e.to_state is JobState.STARTING and (s := e.payload_as(StateChange).provision_s) is not None]
    init = [s for e in changes
            if e.to_state is JobState.RUNNING and (s := e.payload_as(StateChange).init_s) is not None]
    # A row without its times (read back as None) is no measurement.
    rest = [r.restore_s + r.compile_s for r in (e.payload_as(Restored) for e in events if e.kind is EventKind.RESTORE)
            if r.restore_s is not None and r.compile_s is not None]
    saves = [s for e in events if e.kind is EventKind.CHECKPOINT
             and (s := e.payload_as(CheckpointSaved).blocking_s) is not None]
    restart = RestartCost()
    if prov and rest:
        startup = statistics.median(rest) + (statistics.median(init) if init else 0.0)
        restart = replace(restart, provisioning_s=clock.policy_s(statistics.median(prov)),
                          startup_s=clock.policy_s(startup))
    if step_s:
        restart = replace(restart, checkpoint_interval_s=clock.policy_s(spec.checkpoint.interval_steps * step_s))
    if saves:
        restart = replace(restart, save_s=clock.policy_s(statistics.median(saves)))
    return restart


def _snapshot(store: Store, job_id: str, *, now: float, current: Key | None,
              spot_chips_available: int | None = None, ready: Key | None = None,
              waiting: Key | None = None) -> tuple[Snapshot, JobSpec, float | None, Clock]:
    """The snapshot, with the job's spec, its median step time (None before a few steps) and its clock."""
    job = store.job(job_id)
    spec = job.spec
    clock, zone, w = clock_of(spec), zone_of(spec), spec.workload
    tokens_per_step = w.global_batch_size * w.seq_len if isinstance(w, LmWorkload) else 1
    total = (w.steps or 1) * tokens_per_step
    events = store.events(job_id)
    steps = store.steps(job_id)

    # Measured speed per slice type and count: the step times of the generations that ran on it (tokens per
    # policy second). A count the job ran on is priced at its measured speed; the others by the compiler's
    # kept report (`orchestrator.control.priors`), else by the scaling model from one slice's (measured on
    # one slice, else a measured count's per slice).
    ran_on: dict[int | None, tuple[str | None, int]] = {}
    slices = [e.payload_as(SliceChanged) for e in events if e.kind is EventKind.SLICE]
    for e in events:
        if e.kind is EventKind.LAUNCHED:
            launched = e.payload_as(Launched)
            ran_on[launched.generation] = (next((s.accelerator for s in slices if s.name == launched.slice), None),
                                           launched.slices or 1)
    by_count: dict[tuple[str, int], float] = {}
    for name, count in {v for v in ran_on.values() if v[0]}:
        assert name is not None
        times = [m.step_time_s for m in steps if m.step_time_s and ran_on.get(m.generation) == (name, count)]
        if len(times) >= 3:
            by_count[(name, count)] = tokens_per_step / clock.policy_s(statistics.median(times))
    measured = {name: by_count.get((name, 1)) or min(v / n for (t, n), v in by_count.items() if t == name)
                for name, _ in by_count}
    auto = spec.autoscaling
    assert auto is not None, "the policy is asked only about jobs that autoscale (the driver checks)"
    singles = job_options(auto.accelerators, [t.value for t in auto.tiers],
                          flops_per_token=_flops_per_token(spec), measured_tokens_per_s=measured, zone=zone)
    # Priced: measured where the job ran, else the compiler's kept report where one is, else the scaling model.
    measured_on = {name if n == 1 else f"{n}x{name}": v for (name, n), v in by_count.items()}
    options = with_priors(spec, counted_options(spec, singles, tokens_per_step), measured_on).options
    step_s = step_seconds(steps)

    now_s = clock.policy_s(now - job.created_at)
    own = slice_records(events, origin=job.created_at, clock=clock, zone=zone)
    since = job.created_at - clock.wall_s(POOL_HORIZON_S)
    others = [_record(at, p, origin=job.created_at, clock=clock, zone=None)
              for at, _, p in _pooled(store).others(store, zone=zone, since=since, exclude_job=job_id)]
    done_steps = (steps[-1].step + 1) if steps else 0
    committed = max([e.payload_as(CheckpointSaved).step or 0 for e in events if e.kind is EventKind.CHECKPOINT] + [0])
    deadline_s = spec.deadline.total_seconds() if spec.deadline else NO_DEADLINE_S
    progress = Progress(deadline_s, float(total), float(done_steps * tokens_per_step),
                        float(min(committed, done_steps) * tokens_per_step),
                        clock.policy_s(goodput(store, job_id, now=now).usd_total), spec.budget_usd)
    snap = build_snapshot(now_s=now_s, progress=progress, options=options,
                          restart=_restart(events, spec, step_s, clock),
                          records=own, pooled_records=pooled(others, zone=zone, now_s=now_s),
                          current=_option(options, current), ready=_option(options, ready),
                          waiting=_option(options, waiting),
                          largest_spot_chips=spot_chips_available, max_slices=auto.max_slices)
    return snap, spec, step_s, clock


def snapshot(store: Store, job_id: str, *, now: float, current: Key | None,
             spot_chips_available: int | None = None, ready: Key | None = None,
             waiting: Key | None = None) -> Snapshot:
    """The policy's snapshot of the job now (times in policy seconds from the job's creation);
    `ready`: a request READY beside the running slice; `waiting`: one not READY yet."""
    return _snapshot(store, job_id, now=now, current=current, spot_chips_available=spot_chips_available,
                     ready=ready, waiting=waiting)[0]


def decide(store: Store, job_id: str, *, now: float, current: Key | None = None,
           waiting: Key | None = None, waiting_ready: bool = False,
           spot_chips_available: int | None = None) -> Choice:
    """The policy's choice for the job now, and the move that gets there.

    `current`: (accelerator, tier, count) of the slices the workers run on, if any; `waiting`: of
    the request beside them, if any (`waiting_ready`: it is READY; ask again when it turns READY).
    `spot_chips_available`: the largest spot slice the provider allows (the records take off
    what was refused).
    The checkpoint interval comes back in steps (at the job's measured step time), never
    longer than the spec's: the spec sets the longest interval, and spot slices that are
    preempted often save more often. It applies to a slice being launched.
    """
    snap, spec, step_s, clock = _snapshot(store, job_id, now=now, current=current,
                                          spot_chips_available=spot_chips_available,
                                          ready=waiting if waiting_ready else None,
                                          waiting=None if waiting_ready else waiting)
    decision = CostPolicy().decide(snap)
    o: Option | None = decision.option
    move = next_move(o, held=snap.current, waiting=_option(snap.options, waiting), waiting_ready=waiting_ready,
                     wait_for=decision.wait_for)
    steps = None
    if o is not None and step_s and decision.checkpoint_interval_s:
        every = round(decision.checkpoint_interval_s / clock.policy_s(step_s))
        steps = max(1, min(spec.checkpoint.interval_steps, every))
    return Choice(o.name if o else None, o.tier if o else None, decision, steps, move, o.count if o else 1)


def decide_for(store: Store, job_id: str, *, now: float, current: Key | None = None,
               spot_chips_available: int | None = None) -> Choice | None:
    """`decide` without a waiting request; None when the policy says to hold no slice (wait for spot)."""
    choice = decide(store, job_id, now=now, current=current, spot_chips_available=spot_chips_available)
    return None if choice.accelerator is None else choice


def spot_availability(events: list[Event], *, now: float, sizes: list[int],
                      zone: str = "default") -> SpotAvailability:
    """What the job's own spot slices showed of the zone's capacity, on top of the policy's prior
    (`events` and `now` on the store's clock)."""
    history = read_history(slice_records(events, zone=zone), now)
    return estimates(history, sizes=sizes)[0]


def spot_chips_now(events: list[Event], *, now: float, largest: int, sizes: list[int],
                   recent_s: float = REFUSAL_HOLDS_S) -> int:
    """The largest spot slice worth asking for now: `largest` (what the provider allows), less
    what the zone refused or took back from the job in the last `recent_s`, more any size up
    since. Returns 0 when no allowed size is left."""
    history = read_history(slice_records(events, zone="default"), now)
    return chips_known(history, zone="default", sizes=sizes, largest=largest, now_s=now, hold_s=recent_s)


def with_checkpoint_interval(spec: JobSpec, choice: Choice) -> JobSpec:
    """The spec a launch uses: the policy's checkpoint interval, if it chose one (the stored
    spec keeps the user's, which stays the longest)."""
    every = choice.checkpoint_interval_steps
    if not every or every == spec.checkpoint.interval_steps:
        return spec
    return spec.model_copy(update={"checkpoint": spec.checkpoint.model_copy(update={"interval_steps": every})})


def step_seconds(steps: list[StepMetric]) -> float | None:
    """The median step time over the job's last steps (wall seconds), once it has run a few."""
    times = [m.step_time_s for m in steps[-50:] if m.step_time_s]
    return statistics.median(times) if len(times) >= 3 else None
