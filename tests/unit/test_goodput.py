"""Goodput over synthetic timelines written through the real store, with exact timestamps.

`preempted_job` and `clean_job` are also the fixtures of the metrics and report tests.
"""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from orchestrator.catalog import lookup
from orchestrator.observe.goodput import CATEGORIES, goodput, render_goodput
from orchestrator.state.events import StateChange
from orchestrator.state.states import JobState
from orchestrator.state.store import Store

T0 = 1_700_000_000.0
STEP_S = 1.5  # every synthetic step takes this long
J = JobState


def _slice(store, job_id, at, name, state, accelerator="v4-8", tier="spot", *, price=True):
    data = {"name": name, "accelerator": accelerator, "chips": lookup(accelerator).chips, "tier": tier,
            "state": state}
    if price:
        data["usd_per_hour"] = lookup(accelerator).usd_per_hour(tier)
    store.import_event(job_id, "slice", f"slice {name} {state}", data, at=at)


def _steps(store, job_id, generation, first, last, first_at, every=2.0):
    for k in range(first, last + 1):
        store.record_steps(job_id, generation, [(k, 5.0 / (k + 1), 1000.0 + k, STEP_S)],
                           at=first_at + (k - first) * every)


def preempted_job(store: Store, job_id: str = "job-p", *, compile_s: tuple[float, float] = (3.0, 2.0)) -> str:
    """110 s: queue 5 s, wait 10 s for capacity, run steps 0-9, preempted at step 10 with the last
    checkpoint at 8, relaunched on an on-demand slice, steps 8-19 (8 and 9 computed again), succeeded.

    Expected seconds: productive 30 (20 kept steps), waiting 15, provisioning 20, runtime_init 16,
    compile 5, restore 3, checkpoint_save 1, lost_work 3, idle 17 (7.5 + 8.5 in the runs, 1 recovering).
    """
    t = T0
    store.create_job(job_id, "lm", {"accelerator": "v4-8", "tier": "spot"}, at=t)
    store.transition(job_id, J.PROVISIONING, "requesting v4-8 (spot)", at=t + 5)
    _slice(store, job_id, t + 5, "s1", "REQUESTED")
    _slice(store, job_id, t + 6, "s1", "WAITING")
    _slice(store, job_id, t + 16, "s1", "PROVISIONING")
    _slice(store, job_id, t + 25, "s1", "READY")
    store.transition(job_id, J.STARTING, "slice s1 ready", data=StateChange(provision_s=20.0, slice="s1"), at=t + 25)
    store.import_event(job_id, "launched", "1 worker", {"slice": "s1", "nodes": ["n1"], "generation": 1}, at=t + 30)
    store.transition(job_id, J.RUNNING, "all hosts joined", data=StateChange(init_s=9.0, generation=1), at=t + 35)
    store.import_event(job_id, "restore", "started from scratch",
                    {"restore_s": 2.0, "compile_s": compile_s[0], "restored_step": None}, at=t + 40)
    _steps(store, job_id, 1, 0, 9, t + 42)  # steps 0-9 reported at t+42 ... t+60
    store.import_event(job_id, "checkpoint", "saved step 8", {"step": 8, "blocking_s": 0.5}, at=t + 56.5)
    _slice(store, job_id, t + 62, "s1", "PREEMPTING")
    _slice(store, job_id, t + 63, "s1", "GONE")
    store.import_event(job_id, "disruption", "preempted: reclaimed (after step 10)",
                    {"kind": "preempted", "step": 9, "reason": "reclaimed", "generation": 1}, at=t + 63)
    store.transition(job_id, J.RECOVERING, "reclaimed (preemption 1 of at most 3)",
                     data=StateChange(outcome="preempted"), at=t + 63, preemptions=1)
    store.transition(job_id, J.PROVISIONING, "requesting v4-8 (on-demand)", at=t + 64)
    _slice(store, job_id, t + 64, "s2", "REQUESTED", tier="on-demand")
    _slice(store, job_id, t + 64, "s2", "PROVISIONING", tier="on-demand")
    _slice(store, job_id, t + 74, "s2", "READY", tier="on-demand")
    store.transition(job_id, J.STARTING, "slice s2 ready", data=StateChange(provision_s=10.0, slice="s2"), at=t + 74)
    store.transition(job_id, J.RUNNING, "all hosts joined", data=StateChange(init_s=5.0, generation=2), at=t + 80)
    store.import_event(job_id, "restore", "restored step 8",
                    {"restore_s": 1.0, "compile_s": compile_s[1], "restored_step": 8}, at=t + 85)
    store.import_event(job_id, "lost_work", "lost 2 steps (from step 10 back to 8)",  # as the controller writes it
                    {"steps": 2, "seconds": 3.0, "from_step": 10, "to_step": 8}, at=t + 85)
    _steps(store, job_id, 2, 8, 19, t + 87)  # steps 8-19 reported at t+87 ... t+109
    store.import_event(job_id, "checkpoint", "saved step 16", {"step": 16, "blocking_s": 0.5}, at=t + 103.5)
    _slice(store, job_id, t + 110, "s2", "RELEASED", tier="on-demand")
    store.transition(job_id, J.SUCCEEDED, "training finished", at=t + 110)
    return job_id


def clean_job(store: Store, job_id: str = "job-c", *, accelerator="v5p-8", tier="spot", hours=2.0,
              price_in_events=True) -> str:
    """One slice held for exactly `hours` from request to release; 1 s to provision, 1 s to start."""
    t, end = T0, T0 + hours * 3600
    store.create_job(job_id, "clean", {"accelerator": accelerator, "tier": tier}, at=t)
    store.transition(job_id, J.PROVISIONING, "requesting", at=t)
    _slice(store, job_id, t, "c1", "REQUESTED", accelerator, tier, price=price_in_events)
    _slice(store, job_id, t + 1, "c1", "READY", accelerator, tier, price=price_in_events)
    store.transition(job_id, J.STARTING, "ready", at=t + 1)
    store.transition(job_id, J.RUNNING, "joined", data=StateChange(init_s=1.0, generation=1), at=t + 2)
    n = int((end - t - 3) // 2)
    _steps(store, job_id, 1, 0, n - 1, t + 3)
    _slice(store, job_id, end, "c1", "RELEASED", accelerator, tier, price=price_in_events)
    store.transition(job_id, J.SUCCEEDED, "training finished", at=end)
    return job_id


@pytest.fixture
def store(tmp_path):
    return Store(tmp_path / "state.db")


def _assert_adds_up(g):
    total = sum(g.seconds().values())
    assert total == pytest.approx(g.wall_s, rel=0.01)
    assert all(v >= 0 for v in g.seconds().values()), g.seconds()


def test_preempted_job_splits_into_the_expected_categories(store):
    g = goodput(store, preempted_job(store))
    _assert_adds_up(g)
    assert g.wall_s == pytest.approx(110.0)
    assert g.seconds() == pytest.approx({
        "productive": 30.0, "waiting_for_capacity": 15.0, "provisioning": 20.0, "runtime_init": 16.0,
        "compile": 5.0, "restore": 3.0, "checkpoint_save": 1.0, "lost_work": 3.0, "idle": 17.0})
    assert g.goodput_fraction == pytest.approx(30.0 / 110.0)
    assert (g.preemptions, g.failures, g.restarts, g.lost_steps, g.productive_steps) == (1, 0, 1, 2, 20)
    assert g.finished


def test_preempted_job_pays_each_slice_at_its_own_price(store):
    g = goodput(store, preempted_job(store))
    spot, on_demand = lookup("v4-8").usd_per_hour("spot"), lookup("v4-8").usd_per_hour("on-demand")
    # The spot slice waited 10 s in the queue (not billed) and was up 47 s; the on-demand one never waited.
    assert g.usd_by == pytest.approx({("v4-8", "spot"): spot * 47 / 3600, ("v4-8", "on-demand"): on_demand * 46 / 3600})
    assert g.usd_total == pytest.approx(sum(g.usd_by.values()))


def test_clean_run_adds_up_and_is_mostly_productive(store):
    g = goodput(store, clean_job(store))
    _assert_adds_up(g)
    assert g.provisioning_s == pytest.approx(1.0) and g.runtime_init_s == pytest.approx(1.0)
    assert g.productive_s == pytest.approx(len(store.steps("job-c")) * STEP_S)
    assert g.goodput_fraction > 0.74  # 1.5 s of work in every 2 s
    assert (g.preemptions, g.restarts, g.lost_steps, g.lost_work_s) == (0, 0, 0, 0.0)


@pytest.mark.parametrize("price_in_events", [True, False])
def test_cost_is_hours_times_price(store, price_in_events):
    g = goodput(store, clean_job(store, accelerator="v5p-8", tier="spot", hours=2.0, price_in_events=price_in_events))
    price = lookup("v5p-8").usd_per_hour("spot")  # 4 chips at the high end of the spot range
    assert g.usd_total == pytest.approx(2.0 * price, rel=1e-12)
    assert g.usd_by == {("v5p-8", "spot"): pytest.approx(2.0 * price, rel=1e-12)}


def test_an_active_job_runs_to_now_and_bills_its_open_slice_until_then(store):
    job = "job-a"
    store.create_job(job, "a", {}, at=T0)
    store.transition(job, J.PROVISIONING, "requesting", at=T0 + 10)
    _slice(store, job, T0 + 10, "a1", "REQUESTED", "v6e-4", "on-demand")
    g = goodput(store, job, now=T0 + 3610)
    _assert_adds_up(g)
    assert not g.finished and g.wall_s == pytest.approx(3610)
    assert (g.waiting_for_capacity_s, g.provisioning_s) == pytest.approx((10.0, 3600.0))
    assert g.usd_total == pytest.approx(lookup("v6e-4").usd_per_hour("on-demand"))


def test_failed_provisioning_and_its_backoff_count_as_waiting_for_capacity(store):
    job = "job-w"
    store.create_job(job, "w", {}, at=T0)
    store.transition(job, J.PROVISIONING, "requesting", at=T0)
    store.transition(job, J.RECOVERING, "no capacity", data=StateChange(outcome="provision_failed"), at=T0 + 30)
    store.transition(job, J.PROVISIONING, "requesting", at=T0 + 60)
    store.transition(job, J.CANCELLED, "cancelled by the user", at=T0 + 70)
    g = goodput(store, job)
    _assert_adds_up(g)
    assert (g.waiting_for_capacity_s, g.provisioning_s, g.failures) == pytest.approx((60.0, 10.0, 1))


def test_disruptions_count_from_their_events_even_when_the_job_then_fails(store):
    job = preempted_job(store, "job-p")
    g = goodput(store, job)
    assert (g.preemptions, g.failures) == (1, 0)
    job = "job-f"  # the second host loss is one more than max_preemptions: FAILED, with no RECOVERING
    store.create_job(job, "f", {}, at=T0)
    for i, kind in enumerate(["infra_lost", "app_failed", "infra_lost"]):
        store.import_event(job, "disruption", kind, {"kind": kind, "step": i, "reason": "x"}, at=T0 + i)
    store.transition(job, J.FAILED, "2 preemptions or host losses, more than max_preemptions=1", at=T0 + 5)
    assert (goodput(store, job).preemptions, goodput(store, job).failures) == (2, 1)


def test_without_disruption_events_the_recovering_outcomes_count(store):
    job = "job-old"  # a store written before the controller recorded disruption events
    store.create_job(job, "old", {}, at=T0)
    store.transition(job, J.PROVISIONING, "requesting", at=T0)
    for i, outcome in enumerate(["preempted", "app_failed", "infra_lost", "provision_failed"]):
        store.transition(job, J.RECOVERING, outcome, data=StateChange(outcome=outcome), at=T0 + 2 * i + 1)
        store.transition(job, J.PROVISIONING, "requesting", at=T0 + 2 * i + 2)
    g = goodput(store, job, now=T0 + 10)
    assert (g.preemptions, g.failures) == (2, 2)


def test_a_resize_bills_both_slices_and_late_reports_belong_to_the_run_before(store):
    job = "job-r"
    store.create_job(job, "r", {"accelerator": "v4-16", "tier": "spot"}, at=T0)
    store.transition(job, J.PROVISIONING, "requesting", at=T0)
    _slice(store, job, T0, "r1", "REQUESTED", "v4-8")
    store.transition(job, J.STARTING, "ready", at=T0 + 10)
    store.transition(job, J.RUNNING, "joined", at=T0 + 20)
    _steps(store, job, 1, 0, 9, T0 + 22)  # reported at T0+22 ... T0+40
    store.import_event(job, "resize", "resizing v4-8 -> v4-16", {"from": "v4-8", "to": "v4-16"}, at=T0 + 40)
    _slice(store, job, T0 + 41, "r1", "RELEASED", "v4-8")
    store.transition(job, J.RESIZING, "resized", data=StateChange(to="v4-16"), at=T0 + 41)
    store.import_event(job, "checkpoint", "saved step 10", {"step": 10, "blocking_s": 0.5}, at=T0 + 41.1)  # late
    store.transition(job, J.PROVISIONING, "requesting v4-16", at=T0 + 41.2)
    _slice(store, job, T0 + 50, "r2", "REQUESTED", "v4-16")
    store.transition(job, J.STARTING, "ready", at=T0 + 60)
    store.transition(job, J.RUNNING, "joined", at=T0 + 70)
    _steps(store, job, 2, 10, 14, T0 + 72)
    _slice(store, job, T0 + 90, "r2", "RELEASED", "v4-16")
    store.transition(job, J.SUCCEEDED, "done", at=T0 + 90)
    g = goodput(store, job)
    _assert_adds_up(g)
    assert (g.checkpoint_save_s, g.productive_s) == pytest.approx((0.5, 15 * STEP_S))
    assert (g.provisioning_s, g.runtime_init_s) == pytest.approx((10 + 18.8, 20))
    assert g.idle_s == pytest.approx(90 - 28.8 - 20 - 0.5 - 15 * STEP_S)  # the 0.2 s of RESIZING among them
    assert g.usd_by == pytest.approx({("v4-8", "spot"): lookup("v4-8").usd_per_hour("spot") * 41 / 3600,
                                      ("v4-16", "spot"): lookup("v4-16").usd_per_hour("spot") * 40 / 3600})
    assert (g.preemptions, g.restarts) == (0, 1)


def test_overlapping_measurements_are_clamped_not_negative(store):
    """Steps claiming more time than their run had: the run is all productive, nothing goes negative."""
    job = "job-o"
    store.create_job(job, "o", {}, at=T0)
    store.transition(job, J.PROVISIONING, "requesting", at=T0)
    store.transition(job, J.STARTING, "ready", at=T0 + 1)
    store.transition(job, J.RUNNING, "joined", at=T0 + 2)
    store.import_event(job, "restore", "x", {"restore_s": 4.0, "compile_s": 4.0, "restored_step": None}, at=T0 + 3)
    store.record_steps(job, 1, [(k, 1.0, None, 5.0) for k in range(10)], at=T0 + 12)
    store.transition(job, J.SUCCEEDED, "done", at=T0 + 12)
    g = goodput(store, job)
    _assert_adds_up(g)
    assert (g.restore_s, g.compile_s, g.productive_s, g.idle_s) == pytest.approx((4.0, 4.0, 2.0, 0.0))


def test_rows_awaiting_recomputation_are_not_productive(store):
    """Between the restore and the recomputation, the old run's rows of the lost steps are lost work."""
    job = preempted_job(store, "job-p")
    g_end = goodput(store, job)
    mid = store  # a second job with the same rows, cut off right after the restore
    mid.create_job("job-m", "m", {}, at=T0)
    for e in store.events(job):
        if e.at > T0 + 85 or e.kind == "state" and e.to_state == "PENDING":
            continue
        if e.kind == "state":
            mid.transition("job-m", JobState(e.to_state), e.reason, data=e.payload, at=e.at)
        else:
            mid.import_event("job-m", e.kind, e.reason, e.data, at=e.at)
    _steps(mid, "job-m", 1, 0, 9, T0 + 42)
    g = goodput(mid, "job-m", now=T0 + 86)
    _assert_adds_up(g)
    assert g.productive_s == pytest.approx(8 * STEP_S)  # steps 8 and 9 of the first run are not kept
    assert g.productive_steps == 8
    assert g.lost_work_s == pytest.approx(g_end.lost_work_s) == pytest.approx(3.0)


def test_to_dict_is_json_and_the_table_names_every_category(store):
    g = goodput(store, preempted_job(store))
    d = json.loads(json.dumps(g.to_dict()))
    assert d["wall_s"] == pytest.approx(110.0) and d["goodput_fraction"] == pytest.approx(30 / 110)
    assert {(u["accelerator"], u["tier"]) for u in d["usd_by"]} == {("v4-8", "spot"), ("v4-8", "on-demand")}
    console = Console(record=True, width=120)
    console.print(render_goodput(g))
    text = console.export_text()
    for category in CATEGORIES:
        assert category.replace("_", " ") in text
    assert "goodput 27.3%" in text and "1 preemptions" in text and "1m 50s" in text


def test_the_first_step_of_each_launch_pays_its_warm_up_to_runtime_init(store):
    """Each launch's first step also sets up the runtime's connections: beyond the median step it is init."""
    preempted_job(store)
    slow = {0: 1, 8: 2}  # the first step of each generation, 2.5 s and 4.0 s slower than the others
    for step, generation in slow.items():
        row = next(m for m in store.steps("job-p") if m.step == step)
        store.record_steps("job-p", generation, [(step, row.loss, row.tokens_per_s, STEP_S + 1.0 + 1.5 * generation)],
                           at=row.at)
    g = goodput(store, "job-p")
    _assert_adds_up(g)
    assert g.productive_s == pytest.approx(30.0)  # 20 kept steps at the median, as before
    assert g.runtime_init_s == pytest.approx(16.0 + 2.5 + 4.0)


def test_a_user_programs_first_step_compile_counts_as_compile(store):
    """A restore event without a compile time (a user's program compiles in its first step): that
    step's warm-up is compile, not runtime init."""
    preempted_job(store, compile_s=(0.0, 0.0))
    slow = {0: 1, 8: 2}
    for step, generation in slow.items():
        row = next(m for m in store.steps("job-p") if m.step == step)
        store.record_steps("job-p", generation, [(step, row.loss, row.tokens_per_s, STEP_S + 6.0)], at=row.at)
    g = goodput(store, "job-p")
    _assert_adds_up(g)
    assert g.compile_s == pytest.approx(2 * 6.0)  # each launch's first step beyond the median
    assert g.runtime_init_s == pytest.approx(16.0)  # STARTING only
    assert g.productive_s == pytest.approx(30.0)


def test_a_slice_is_not_billed_while_it_waits_in_the_queue(store):
    """Billed from when capacity came; a request let go while still queued costs nothing."""
    job = "job-q"
    store.create_job(job, "q", {}, at=T0)
    store.transition(job, J.PROVISIONING, "requesting", at=T0)
    for at, state in ((T0, "REQUESTED"), (T0 + 1, "WAITING"), (T0 + 600, "RELEASED")):  # never got capacity
        _slice(store, job, at, "q1", state, "v4-16")
    for at, state in ((T0 + 600, "REQUESTED"), (T0 + 601, "WAITING"), (T0 + 900, "PROVISIONING"),
                      (T0 + 960, "READY"), (T0 + 4500, "RELEASED")):
        _slice(store, job, at, "q2", state, "v4-8")
    store.transition(job, J.FAILED, "gave up", at=T0 + 4500)
    g = goodput(store, job)
    assert g.usd_by == pytest.approx({("v4-8", "spot"): lookup("v4-8").usd_per_hour("spot") * 3600 / 3600})


def test_lost_work_that_its_run_has_no_room_for_is_taken_from_the_intervals_after_it(store):
    """A run whose steps (timed by the hosts) fill all the time the controller saw it run, then a lost host:
    the lost work it reports is counted all the same, from the recovering and later intervals' unclaimed
    time, and the categories still add up to the wall time (a chaos run once reported 2 steps lost and
    0 s of lost work this way)."""
    job = "job-l"
    store.create_job(job, "l", {}, at=T0)
    store.transition(job, J.PROVISIONING, "requesting", at=T0)
    store.transition(job, J.STARTING, "ready", at=T0 + 1)
    store.transition(job, J.RUNNING, "joined", data=StateChange(generation=1), at=T0 + 2)
    store.record_steps(job, 1, [(k, 1.0, None, 2.0) for k in range(6)], at=T0 + 12)  # 12 s of steps in 10 s
    store.import_event(job, "disruption", "host lost", {"kind": "infra_lost", "step": 5, "generation": 1},
                       at=T0 + 12)
    store.transition(job, J.RECOVERING, "host lost", data=StateChange(outcome="infra_lost"), at=T0 + 12)
    store.transition(job, J.PROVISIONING, "requesting", at=T0 + 13)
    store.transition(job, J.STARTING, "relaunch", at=T0 + 20)
    store.transition(job, J.RUNNING, "joined", data=StateChange(generation=2), at=T0 + 22)
    store.import_event(job, "restore", "restored step 4", {"restore_s": 1.0, "compile_s": 0.0, "restored_step": 4},
                       at=T0 + 23)
    store.import_event(job, "lost_work", "lost 2 steps", {"steps": 2, "seconds": 4.0, "from_step": 6, "to_step": 4},
                       at=T0 + 23)
    store.record_steps(job, 2, [(k, 1.0, None, 2.0) for k in range(4, 10)], at=T0 + 40)
    store.transition(job, J.SUCCEEDED, "done", at=T0 + 40)
    g = goodput(store, job)
    _assert_adds_up(g)
    assert g.lost_steps == 2 and g.lost_work_s == pytest.approx(4.0)
