"""The simulator's slices: a request moving through the store's slice lifecycle, the switch
onto it when READY (make-before-break), preemption, training, saves and billing.

A job may hold several slices of one type at once (`Option.count`); they move together as
one group, one name in the records. The loss of some but not all of them is a `shrink`:
the group's record ends GONE and the survivors go on under a new name, relaunched as the
controller relaunches them (`RestartCost.reshape_s` billed without progress, restored from
their memory: nothing lost). A request for the same type with more slices, READY beside the
group, is a grow when the job switches onto it: like any move, the group stops at a
committed step and the whole larger group relaunches (`RestartCost.reshape_s`, billed, no
progress); only the added slices' provisioning overlaps the training.

`policies.evaluation.simulator` owns the loop; this module holds what changes as it steps (`SimState`)
and one function per thing that can happen to the job's slices. Every change of a slice
is also written as a `SliceRecord`, the same kind the store's slice events are read as,
so the policy learns from a replay exactly as it learns from a running job.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from policies.cost.moves import grows, takes_part
from policies.cost.slice_history import SliceRecord
from policies.cost.slice_options import Option
from policies.cost.spot_estimates import SpotAvailability


@dataclass(frozen=True)
class DecisionRecord:
    at_s: float
    option: str  # label, or "wait"
    reason: str
    move: str = ""  # what was done about it (`policies.cost.moves.Move`), or "switch" when a request became READY


@dataclass
class Request:
    """A slice asked for and not yet trained on: WAITING for capacity, PROVISIONING, then READY
    until the policy switches onto it (or lets it go)."""

    option: Option
    name: str
    state: str = "WAITING"
    ready_s: float = 0.0  # PROVISIONING: when it is READY
    expires_s: float | None = None  # WAITING: released unfilled then (None: while the policy wants it)
    queued: bool = False  # a WAITING record was written


@dataclass
class SimState:
    """What changes as the simulator steps: the job's slices, progress, bill and records."""

    availability: SpotAvailability  # knowledge "trace": learned from the capacity feed
    interval_s: float  # how often the held slice checkpoints
    held: Option | None = None  # the slice the job trains on
    held_name: str = ""
    startup_steps: int = 0  # steps left before the held slice trains
    request: Request | None = None
    done: float = 0.0  # tokens trained, including those since the last checkpoint
    committed: float = 0.0  # tokens in the last checkpoint
    trained: float = 0.0  # every token computed, those lost to preemptions included
    lost: float = 0.0
    since_checkpoint_s: float = 0.0
    saving_s: float = 0.0  # save time still to pay
    cost: float = 0.0
    billed: dict[str, float] = field(default_factory=dict)  # seconds by option label
    preemptions: int = 0  # full losses: every slice the job held
    shrinks: int = 0  # losses of some of the job's slices, the others training on
    refusals: int = 0  # requests let go unfilled, or lost before READY
    slices_started: int = 0
    decisions: list[DecisionRecord] = field(default_factory=list)
    records: list[SliceRecord] = field(default_factory=list)
    asked: list[tuple[float, int]] = field(default_factory=list)  # (when, records written by then) of each look
    finish_s: float | None = None
    next_decision_s: float = 0.0
    unobserved_s: float = 0.0  # knowledge "trace": time at the previous capacity


def record(s: SimState, at_s: float, name: str, option: Option, state: str) -> None:
    s.records.append(SliceRecord(at_s, name, state, option.tier, option.chips, option.hosts, option.zone))


def ask(s: SimState, option: Option, now: float, wait_limit_s: float | None) -> None:
    """A new request; it waits for capacity (`advance` fills it)."""
    name = f"s{sum(1 for r in s.records if r.state == 'REQUESTED') + 1}"
    s.request = Request(option, name, expires_s=None if wait_limit_s is None else now + wait_limit_s)
    record(s, now, name, option, "REQUESTED")


def advance(s: SimState, now: float, cap: int, prov_s: float, options: Sequence[Option] = ()) -> str | None:
    """The request at `now` with `cap` spot chips in the zone: fills, provisions, turns READY,
    vanishes or expires. Returns "ready" when it turned READY (the policy is asked whether to
    switch), "refused" when it was let go unfilled, else None. A waiting request for several
    slices that takes part of them (`policies.cost.moves.takes_part`) is filled with the
    slices that fit, if one does (`options`: those it may become)."""
    r = s.request
    if r is None or r.state == "READY":
        return None
    fits = not r.option.preemptible or cap >= r.option.chips
    if r.state == "WAITING" and not fits and takes_part(r.option, held=s.held):
        part = r.option.with_count(min(cap // r.option.slice_chips, r.option.count), options)
        floor = s.held.count if s.held is not None and grows(r.option, held=s.held) else 0
        if part is not None and part.count > floor:
            # The slices that did not fit are let go unfilled: a refusal of one slice more than fit.
            missing = r.option.with_count(part.count + 1, options) or r.option
            rest = f"{r.name}-rest"
            record(s, now, rest, missing, "WAITING")
            record(s, now, rest, missing, "RELEASED")
            s.refusals += 1
            r.option, fits = part, True
    if r.state == "WAITING":
        if fits:
            r.state, r.ready_s = "PROVISIONING", now + prov_s
            record(s, now, r.name, r.option, "PROVISIONING")
        elif r.expires_s is not None and now >= r.expires_s - 1e-9:
            release_request(s, now)
            return "refused"
        else:
            if not r.queued:  # no capacity for it: it waits in the zone's queue, unbilled
                record(s, now, r.name, r.option, "WAITING")
                r.queued = True
            return None
    if not fits:  # the capacity that filled it went before it was READY
        record(s, now, r.name, r.option, "GONE")
        s.request, s.refusals = None, s.refusals + 1
        return "refused"
    if now >= r.ready_s - 1e-9:
        r.state = "READY"
        record(s, now, r.name, r.option, "READY")
        return "ready"
    return None


def release_request(s: SimState, now: float) -> None:
    """Let the request go (in the simulator a request is billed only once the job trains on it)."""
    r = s.request
    assert r is not None, "the caller lets go of the request there is"
    record(s, now, r.name, r.option, "RELEASED")
    s.request = None
    if r.state == "WAITING":  # let go unfilled: a refusal
        s.refusals += 1


def switch(s: SimState, now: float, startup_steps: int, interval_s: float, *, reshape_steps: int | None = None) -> None:
    """Onto the READY request: stop the held slice at a checkpoint, release it, start up on the new
    one (`startup_steps`). A request for more slices of the held type is a grow: the same stop,
    and the whole group relaunches for `reshape_steps` (default: `startup_steps`)."""
    r = s.request
    assert r is not None, "a switch is onto the READY request"
    held = s.held
    grow = held is not None and r.option.count > held.count and \
        (r.option.name, r.option.tier, r.option.zone) == (held.name, held.tier, held.zone)
    if held is not None:
        stop(s, now)
    s.held, s.held_name, s.request = r.option, r.name, None
    s.interval_s = interval_s
    if grow and held is not None:
        s.startup_steps = startup_steps if reshape_steps is None else reshape_steps
        s.slices_started += r.option.count - held.count
    else:
        s.startup_steps = startup_steps
        s.slices_started += 1


def stop(s: SimState, now: float) -> None:
    """A planned stop: the held slice checkpoints first (nothing is lost) and is released."""
    assert s.held is not None, "only a held slice is stopped"
    record(s, now, s.held_name, s.held, "RELEASED")
    s.committed, s.since_checkpoint_s, s.saving_s = s.done, 0.0, 0.0
    s.held = None


def preempt(s: SimState, now: float, saves_on_notice: bool) -> None:
    """The zone takes the held spot slice back, without notice: the work since its last
    checkpoint is lost, unless the notice is assumed to leave time to save."""
    held = s.held
    assert held is not None, "only a held slice is preempted"
    record(s, now, s.held_name, held, "GONE")
    if held.count > 1:  # every slice lost: as each slice's own record would say, not even one could be kept
        one = replace(held, chips=held.slice_chips, hosts=held.slice_hosts, count=1)
        record(s, now, f"{s.held_name}-one", one, "WAITING")
        record(s, now, f"{s.held_name}-one", one, "RELEASED")
    s.preemptions += 1
    if saves_on_notice:
        s.committed = s.done
    s.lost += s.done - s.committed
    s.done = s.committed
    s.held, s.since_checkpoint_s, s.saving_s = None, 0.0, 0.0


def shrink(s: SimState, now: float, survivors: Option, reshape_steps: int) -> None:
    """The zone takes back some of the held slices: the others are relaunched and go on from their
    hosts' memory, nothing lost (the group's record ends GONE; the survivors are a new one), after
    `reshape_steps` steps billed without progress."""
    assert s.held is not None and survivors.count < s.held.count, "a shrink leaves fewer of the held slices"
    record(s, now, s.held_name, s.held, "GONE")
    s.shrinks += 1
    s.held, s.held_name = survivors, f"{s.held_name}-{survivors.count}"
    record(s, now, s.held_name, survivors, "READY")
    s.startup_steps = max(s.startup_steps, reshape_steps)
    s.saving_s = 0.0


def train(s: SimState, now: float, dt: float, total_tokens: float, save_s: float) -> bool:
    """One step on the held slice: startup (billed, no progress), or training (a save under way
    pauses it). True once the last token is trained."""
    held = s.held
    assert held is not None, "training is on the held slice"
    if s.startup_steps > 0:
        bill(s, dt)
        s.startup_steps -= 1
        return False
    pause_s = min(s.saving_s, dt)
    s.saving_s -= pause_s
    train_s = min(dt - pause_s, (total_tokens - s.done) / held.tokens_per_s)
    run_s = pause_s + train_s
    bill(s, run_s)
    s.done += held.tokens_per_s * train_s
    s.trained += held.tokens_per_s * train_s
    if run_s < dt or s.done >= total_tokens:
        s.done = s.committed = total_tokens  # the final checkpoint
        s.finish_s = now + run_s
        record(s, s.finish_s, s.held_name, held, "RELEASED")
        return True
    s.since_checkpoint_s += train_s
    if s.since_checkpoint_s >= s.interval_s:  # a save at the interval's end (at most one a step)
        s.since_checkpoint_s %= s.interval_s
        s.committed = s.done - held.tokens_per_s * s.since_checkpoint_s
        s.saving_s += save_s
    return False


def bill(s: SimState, seconds: float) -> None:
    held = s.held
    assert held is not None, "only the held slice is billed"
    s.cost += held.usd_per_hour / 3600 * seconds
    s.billed[held.label] = s.billed.get(held.label, 0.0) + seconds
