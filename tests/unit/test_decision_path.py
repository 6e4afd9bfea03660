"""One decision path: the simulator and the autoscaler build the policy's snapshot with the
same function from the same kind of slice records, and so decide the same; the records'
rules (refusals, reclaims, host losses) and make-before-break moves, table by table."""

from __future__ import annotations

import dataclasses
import math

import pytest

from orchestrator.control import autoscaler
from orchestrator.domain.options import job_options
from orchestrator.domain.spec import JobSpec
from orchestrator.state.store import Store
from policies.cost.moves import MoveKind, next_move
from policies.cost.policy import CostPolicy
from policies.cost.slice_history import SliceRecord, read_history
from policies.cost.slice_options import ON_DEMAND, SPOT
from policies.evaluation.simulator import SimJob, simulate
from policies.evaluation.traces import SpotTrace

T0 = 1_000_000.0  # the store's clock at the job's creation (whole seconds: times compare exactly)
SPEC = {
    "name": "replayed", "accelerator": "v4-16", "tier": "spot",
    "workload": {"type": "lm", "global_batch_size": 512, "seq_len": 1024,
                 "model": {"d_model": 64, "n_layers": 2, "n_heads": 4, "d_ff": 128, "vocab_size": 256}},
    "autoscaling": {"accelerators": ["v4-16", "v4-32"], "tiers": ["spot", "on-demand"]},
    "deadline": "PT6H",
}
ACCELERATOR = {8: "v4-16", 16: "v4-32"}


def rec(at, name, state, tier=SPOT, chips=16):
    return SliceRecord(at, name, state, tier, chips, chips // 4)


@pytest.mark.parametrize("records, now, refusals, ups, preemptions", [
    # a spot slice reclaimed without a notice: a refusal and a preemption, never "spot is up"
    ([rec(0, "a", "REQUESTED"), rec(0, "a", "READY"), rec(100, "a", "GONE")], 200, [100], [], 1),
    # with a notice first: the same
    ([rec(0, "a", "READY"), rec(90, "a", "PREEMPTING"), rec(100, "a", "GONE")], 200, [100], [90], 1),
    # a notice still running: refused now
    ([rec(0, "a", "READY"), rec(90, "a", "PREEMPTING")], 95, [95], [90], 0),
    # released by us: up until then, nothing lost
    ([rec(0, "a", "READY"), rec(100, "a", "RELEASED")], 200, [], [100], 0),
    # a request let go unfilled: a refusal when let go; still waiting: missing now
    ([rec(0, "a", "REQUESTED"), rec(0, "a", "WAITING"), rec(300, "a", "RELEASED")], 400, [300], [], 0),
    ([rec(0, "a", "REQUESTED"), rec(0, "a", "WAITING")], 400, [400], [], 0),
    # filled, then the capacity went before READY: a refusal, no preemption
    ([rec(0, "a", "WAITING"), rec(50, "a", "PROVISIONING"), rec(80, "a", "GONE")], 100, [80], [], 0),
    # filled and let go while provisioning: capacity was there, no refusal
    ([rec(0, "a", "PROVISIONING"), rec(80, "a", "RELEASED")], 100, [], [], 0),
    # an on-demand host lost: says nothing about spot
    ([rec(0, "d", "READY", ON_DEMAND), rec(100, "d", "GONE", ON_DEMAND)], 200, [], [], 0),
])
def test_what_slice_records_say(records, now, refusals, ups, preemptions):
    h = read_history(records, now)
    assert [at for at, _, _, up in h.seen if not up] == refusals
    assert [at for at, _, _, up in h.seen if up] == ups
    assert sum(h.preemptions.values()) == preemptions
    assert all(tier == SPOT for tier, _ in h.host_hours)


def test_moves_are_make_before_break():
    small, _, spot, od = _options()  # v4-16 spot, v4-16 on-demand, v4-32 spot, v4-32 on-demand
    assert str(next_move(spot, held=None)) == "request v4-32 spot"
    beside = next_move(spot, held=od)
    assert beside.kind is MoveKind.REQUEST_BESIDE and beside.request == spot and not beside.release_waiting
    # the plan waits for spot the zone cannot give now: it stays requested beside the running slice
    assert next_move(od, held=od, wait_for=spot).request == spot
    assert next_move(od, held=od, waiting=spot, wait_for=spot).kind is MoveKind.KEEP
    assert next_move(None, held=None, waiting=spot, wait_for=spot).kind is MoveKind.KEEP  # waiting for spot
    # READY and chosen: switch; READY and not chosen, or no longer waited for: released
    assert next_move(spot, held=od, waiting=spot, waiting_ready=True).kind is MoveKind.SWITCH
    assert next_move(od, held=od, waiting=spot, waiting_ready=True).release_waiting
    dropped = next_move(od, held=od, waiting=spot)
    assert dropped.kind is MoveKind.KEEP and dropped.release_waiting and dropped.request is None
    other = next_move(small, held=od, waiting=spot)
    assert other.kind is MoveKind.REQUEST_BESIDE and other.request == small and other.release_waiting
    # the policy would rather hold nothing: release the running slice, keep waiting for spot
    release = next_move(None, held=od, waiting=spot, wait_for=spot)
    assert release.kind is MoveKind.RELEASE and release.release_held and not release.release_waiting


def _spec() -> JobSpec:
    return JobSpec.from_dict(SPEC)


def _options():
    spec = _spec()
    flops = spec.workload.model.shape().flops_per_token(spec.workload.seq_len)
    return job_options(["v4-16", "v4-32"], ["spot", "on-demand"], flops_per_token=flops)


@dataclasses.dataclass
class Recording:
    """The cost policy, keeping every snapshot it was shown and what it answered."""

    name: str = "policy"
    seen: list = dataclasses.field(default_factory=list)

    def decide(self, snap):
        decision = CostPolicy().decide(snap)
        self.seen.append((snap, decision))
        return decision


def test_one_recorded_history_gives_the_same_decisions_through_both_paths(tmp_path):
    """The simulator replays a trace with two spot outages (own knowledge, make-before-break);
    its slice records go into a real store as slice events, and at every moment the policy was
    asked the autoscaler builds its snapshot from the store: the same snapshot (but the
    progress, which a running job measures), so the same decision and the same move."""
    options = _options()
    tokens_per_step = 512 * 1024
    hours = 3.0
    steps = math.ceil(options[1].tokens_per_s * 3600 * hours / tokens_per_step)
    deadline_s = 1.3 * 3600 * hours
    job = SimJob(float(steps * tokens_per_step), deadline_s, options)
    # spot up 40 min, out 2 h, up 1 h 40, out 2 h, then up
    trace = SpotTrace("two outages", 300.0, (1,) * 8 + (0,) * 24 + (1,) * 20 + (0,) * 24 + (1,) * 200, 1)
    policy = Recording()
    run = simulate(policy, job, trace, knowledge="own")
    # (refusals: the requests let go unfilled; a waiting request is kept rather than traded for
    # one the zone could fill no sooner, or for another spot size while the plan still wants it,
    # so there are fewer than when every look re-asked)
    assert run.deadline_met and run.preemptions == 1 and run.refusals >= 1
    # the history holds a reclaim, refusals, a move to on-demand with spot requested beside it,
    # and the switch back to spot once a request is READY
    kinds = [d.move.split(";")[0] for d in run.decisions]
    assert "switch v4-16 on-demand" in kinds and any(k.startswith("request beside") for k in kinds)
    assert kinds[-1].startswith("switch") and "spot" in kinds[-1]
    od = next(r for r in run.records if r.tier == ON_DEMAND and r.state == "READY")
    assert any(r.state == "WAITING" and r.tier == SPOT and r.at_s > od.at_s for r in run.records)

    store = Store(tmp_path / "db.sqlite")
    spec = dict(SPEC, workload=dict(SPEC["workload"], steps=steps), deadline=f"PT{int(deadline_s)}S")
    store.create_job("j", "replayed", JobSpec.from_dict(spec).model_dump(mode="json"), at=T0)
    written = 0
    compared = 0
    for (now, seen), (snap, decision) in zip(run.asked, policy.seen, strict=True):
        for r in run.records[written:seen]:
            store.import_event("j", "slice", f"slice {r.name} {r.state}", {
                "name": r.name, "accelerator": ACCELERATOR[r.chips], "chips": r.chips, "tier": r.tier,
                "state": r.state}, at=T0 + r.at_s)
        written = seen
        if snap.current_ready_in_s > 0:  # the controller asks only once the workers run
            continue
        current = (snap.current.name, snap.current.tier) if snap.current else None
        waiting, ready = _waiting(run.records[:seen], snap.current)
        beside = (waiting.name, waiting.tier) if waiting is not None else None
        auto = autoscaler.snapshot(store, "j", now=T0 + now, current=current, ready=beside if ready else None,
                                   waiting=None if ready else beside)
        progress = {"tokens_done": snap.tokens_done, "tokens_committed": snap.tokens_committed,
                    "spent_usd": snap.spent_usd}
        assert dataclasses.replace(auto, **progress) == snap, f"at {now} s"
        assert CostPolicy().decide(dataclasses.replace(auto, **progress)) == decision
        compared += 1
    assert compared >= 20
    # What the simulator did with each decision is the move the autoscaler hands the driver.
    moves = {d.at_s: d.move for d in run.decisions}
    for (now, seen), (snap, decision) in zip(run.asked, policy.seen, strict=True):
        if now in moves and snap.current_ready_in_s == 0:
            waiting, ready = _waiting(run.records[:seen], snap.current)
            move = next_move(decision.option, held=snap.current, waiting=waiting, waiting_ready=ready,
                             wait_for=decision.wait_for)
            assert str(move) == moves[now]


def _waiting(records, current):
    """The request beside the running slice (and whether it is READY), read from the records,
    as the driver knows it: the live slice that is not the one the job trains on."""
    last, trained_on = {}, set()
    for r in records:
        last[r.name] = r
    options = {(o.chips, o.tier): o for o in _options()}
    live = [r for r in last.values() if r.state not in ("GONE", "RELEASED")]
    running = [r for r in live if r.state == "READY" and options[(r.chips, r.tier)] == current]
    trained_on = {r.name for r in running[:1]}
    rest = [r for r in live if r.name not in trained_on]
    if not rest:
        return None, False
    return options[(rest[-1].chips, rest[-1].tier)], rest[-1].state == "READY"
