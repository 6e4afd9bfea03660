"""The job driver as a state machine, in seconds and without Ray (`tests/unit/driver_world.py`).

Each test runs the real driver (its loop, `watch`, the recovery rules, limits, the records it
keeps) against a provider that hands out slices at once and worker groups that train a step a
poll; the chaos suite runs the same paths on real hosts, slowly.
"""

from __future__ import annotations

import logging
import time

import pytest

from orchestrator.control.job import watch
from orchestrator.observe.goodput import billed_slices
from orchestrator.providers.base import SliceEventKind
from orchestrator.state.events import EventKind
from orchestrator.state.states import FailedBecause, JobState, SliceState
from policies.cost.moves import Move
from tests.unit.driver_world import ScriptedPolicy, World, choice, lose_the_second_slice_after_step_7, option, spec


@pytest.fixture
def world(tmp_path, monkeypatch):
    monkeypatch.setattr(watch, "POLL_S", 0.005)  # a poll is a step of the scripted workers
    monkeypatch.setattr(watch, "SETTLE_S", 0.05)
    return World(tmp_path)


def states(world, job_id="job"):
    return [e.to_state for e in world.store.events(job_id) if e.kind is EventKind.STATE]


def events(world, kind, job_id="job"):
    return [e for e in world.store.events(job_id) if e.kind is kind]


def slice_states(world):
    return {name: s.state for name, s in world.provider.slices.items()}


def lose_a_host_after_step_7(world) -> None:
    """Generation 1 loses a host after steps 0-7 (5 committed)."""
    def lose_a_host(group, step):
        if group.generation == 1 and step == 7:
            world.provider.send(group.slice_name, SliceEventKind.HOST_LOST, "host 1 of the slice vanished")

    world.on_step = lose_a_host


def test_a_host_lost_mid_run_recovers_on_a_new_slice_from_the_last_checkpoint(world):
    driver = world.submit(spec())
    lose_a_host_after_step_7(world)
    world.run(driver)
    job = world.store.job("job")
    assert job.state is JobState.SUCCEEDED and job.preemptions == 1 and job.failures == 0  # spends max_preemptions
    assert states(world) == ["PENDING", "PROVISIONING", "STARTING", "RUNNING", "RECOVERING", "PROVISIONING", "STARTING",
                             "RUNNING", "SUCCEEDED"]
    [disrupted] = events(world, EventKind.DISRUPTION)
    assert disrupted.data["kind"] == "infra_lost" and "vanished" in disrupted.reason
    assert [e.data["restored_step"] for e in events(world, EventKind.RESTORE)] == [None, 5]
    [lost] = events(world, EventKind.LOST_WORK)
    assert lost.data["steps"] == 3  # steps 5, 6 and 7 run again
    g1, g2 = world.groups
    assert g1.stopped and g2.stopped and (g1.generation, g2.generation) == (1, 2)
    # "Resumed after" is the time the job trained nothing: from its last step before the loss (step 7; the
    # controller learns of a loss later) to its first step after. Steps 5-7 are kept as generation 2 ran them,
    # so of generation 1 the store keeps steps up to 4, which came before step 7.
    [resumed] = events(world, EventKind.RESUMED)
    steps = world.store.steps("job")
    step_4 = max(m.at for m in steps if m.generation == 1)
    first_after = min(m.at for m in steps if m.generation == 2)
    assert first_after - disrupted.at < resumed.data["seconds"] < first_after - step_4
    assert set(slice_states(world).values()) == {SliceState.RELEASED}  # both slices given back
    assert [m.step for m in world.store.steps("job")][-1] == 19


def test_a_notice_stops_at_a_committed_step_and_nothing_is_recomputed(world):
    driver = world.submit(spec())

    def notice(group, step):
        if group.generation == 1 and step == 7:
            world.provider.send(group.slice_name, SliceEventKind.PREEMPTION_NOTICE, "maintenance in 30 s")

    world.on_step = notice
    world.run(driver)
    job = world.store.job("job")
    assert job.state is JobState.SUCCEEDED and job.preemptions == 1
    [disrupted] = events(world, EventKind.DISRUPTION)
    assert disrupted.data["kind"] == "preempted" and "maintenance in 30 s" in disrupted.reason
    restored = [e.data["restored_step"] for e in events(world, EventKind.RESTORE)]
    assert restored[0] is None and restored[1] == disrupted.data["step"] + 1  # saved at the step it stopped after
    assert events(world, EventKind.LOST_WORK)[0].data["steps"] == 0


def test_a_lost_slice_of_three_goes_on_on_the_others_from_their_memory(world):
    """A multi-slice job: a host of one slice goes; the next generation runs on the other two at once
    (no slice requested), restoring the last step done from their memory; the lost slice is released."""
    driver = world.submit(spec(slices=3, workload={**spec()["workload"], "global_batch_size": 48},
                               recovery={"regrow": False}))

    def lose_a_slice(group, step):
        if group.generation == 1 and step == 7:  # steps 0-7 done; 5 committed
            world.lost_memory.add(group.slices[2])
            world.provider.send(group.slices[2], SliceEventKind.HOST_LOST, "host 0 of the third slice vanished")

    world.on_step = lose_a_slice
    world.run(driver)
    job = world.store.job("job")
    assert job.state is JobState.SUCCEEDED and job.preemptions == 1
    assert states(world) == ["PENDING", "PROVISIONING", "STARTING", "RUNNING", "RECOVERING", "PROVISIONING", "STARTING",
                             "RUNNING", "SUCCEEDED"]
    going_on = [e.reason for e in world.store.events("job") if e.to_state == "PROVISIONING"][1]
    assert going_on.startswith("going on on the 2 surviving slices of 3 slices") and "step 8 from their memory" in \
        going_on, going_on
    g1, g2 = world.groups
    assert len(g1.slices) == 3 and g2.slices == g1.slices[:2] and g2.hosts == 4
    assert [(e.data["restored_step"], e.data["source"]) for e in events(world, EventKind.RESTORE)] == \
        [(None, "storage"), (8, "memory")]
    assert events(world, EventKind.LOST_WORK)[0].data["steps"] == 0
    assert len(world.provider.slices) == 3  # nothing asked for after the loss
    assert set(slice_states(world).values()) == {SliceState.RELEASED}


def test_survivors_without_a_common_copy_restore_from_storage_and_the_last_slice_restarts(world):
    driver = world.submit(spec(slices=2, recovery={"regrow": False}))

    def lose(group, step):
        if group.generation == 1 and step == 7:  # the survivor's memory is gone too: storage
            world.lost_memory.update(group.slices)
            world.provider.send(group.slices[1], SliceEventKind.HOST_LOST, "host 1 of the second slice vanished")
        if group.generation == 2 and step == 12:  # the last slice goes: a new one, from storage
            world.provider.send(group.slices[0], SliceEventKind.HOST_LOST, "host 0 of the last slice vanished")

    world.on_step = lose
    world.run(driver)
    assert world.store.job("job").state is JobState.SUCCEEDED
    g1, g2, g3 = world.groups
    assert g2.slices == g1.slices[:1] and len(g3.slices) == 2 and not set(g3.slices) & set(g1.slices)
    assert [(e.data["restored_step"], e.data["source"]) for e in events(world, EventKind.RESTORE)] == \
        [(None, "storage"), (5, "storage"), (10, "storage")]
    assert set(slice_states(world).values()) == {SliceState.RELEASED}


def test_a_job_short_of_a_slice_adds_one_back_make_before_break(world):
    """After a shrink the job asks for a slice beside the survivors; once it is READY every host stops
    at a committed step and the next generation runs on all of them, restored from storage."""
    driver = world.submit(spec(slices=2))
    lose_the_second_slice_after_step_7(world)
    world.run(driver)
    job = world.store.job("job")
    assert job.state is JobState.SUCCEEDED and job.preemptions == 1
    assert states(world)[4:] == ["RECOVERING", "PROVISIONING", "STARTING", "RUNNING", "RESIZING", "PROVISIONING",
                                 "STARTING", "RUNNING", "SUCCEEDED"]
    g1, g2, g3 = world.groups
    assert g2.slices == g1.slices[:1] and len(g3.slices) == 2 and g3.slices[1] == g1.slices[0]  # the survivor stays
    [resize] = events(world, EventKind.RESIZE)
    assert f"slice {g3.slices[0]} is ready beside the 1 running" in resize.reason
    restores = [(e.data["restored_step"], e.data["source"]) for e in events(world, EventKind.RESTORE)]
    assert restores[:2] == [(None, "storage"), (8, "memory")] and restores[2][1] == "storage"
    assert restores[2][0] >= resize.data["step"]  # the step every host stopped after, committed (nothing lost)
    assert [e.data["steps"] for e in events(world, EventKind.LOST_WORK)] == [0, 0]
    assert set(slice_states(world).values()) == {SliceState.RELEASED}


def test_a_transition_the_store_refuses_stops_the_driver_loudly(world, caplog):
    driver = world.submit(spec())

    def another_writer_moves_the_job(group, step):
        if step == 3:  # as a second controller on the same store might: RUNNING -> RESIZING
            world.store.transition("job", JobState.RESIZING, "someone else's write")

    world.on_step = another_writer_moves_the_job
    with caplog.at_level(logging.ERROR, logger="orchestrator.control.job.loop"):
        world.run(driver)
    job = world.store.job("job")
    assert job.state is JobState.FAILED and job.cause == FailedBecause.CONTROLLER.value
    assert "controller error: IllegalTransitionError" in job.reason
    assert "cannot go from RESIZING to SUCCEEDED" in job.reason  # the training ended; the store refused
    assert "controller error" in caplog.text
    [group] = world.groups
    assert group.stopped and set(slice_states(world).values()) == {SliceState.RELEASED}


def test_a_make_before_break_move_switches_to_the_slice_that_came_ready_beside(world):
    policy = ScriptedPolicy()
    driver = world.submit(spec(autoscaling={"accelerators": ["v4-16", "v4-32"]}, deadline="PT24H"), policy=policy)
    moving = {}

    def decide(spec_, current, *, waiting=None, ready=False):
        if current is None:  # before the first provisioning: v4-16 spot
            return choice(Move(target=option("v4-16")), "v4-16")
        if driver.progress.generation == 1 and driver.progress.last_step >= 4 and waiting is None and not moving:
            moving["asked_at"] = driver.progress.last_step
            return choice(Move(target=option("v4-32"), request=option("v4-32")), "v4-16")
        if ready:
            return choice(Move(target=option("v4-32"), switch=True), "v4-32")
        return choice(None, spec_.accelerator)

    policy.decide = decide
    driver.moves.ask_now()
    world.on_step = lambda group, step: driver.moves.ask_now()  # ask the policy every poll
    world.run(driver)
    job = world.store.job("job")
    assert job.state is JobState.SUCCEEDED and job.spec.accelerator == "v4-32"
    g1, g2 = world.groups
    assert (g1.hosts, g2.hosts) == (2, 4)
    names = [e.data["name"] for e in events(world, EventKind.SLICE) if e.data.get("state") == "READY"]
    assert len(names) == 2  # the v4-32 came ready while the v4-16 trained
    [asked] = events(world, EventKind.RESIZE)
    assert asked.data["to"] == "v4-32"
    assert [e.data["restored_step"] for e in events(world, EventKind.RESTORE)][1] == g1.step + 1  # nothing lost
    assert "RESIZING" in states(world) and "RECOVERING" not in states(world)
    starting = [e for e in world.store.events("job") if e.kind is EventKind.STATE and e.to_state == "STARTING"][1]
    assert starting.data.get("overlap_s") is not None  # the new slice overlapped the old one


def test_an_autoscaled_job_takes_the_slices_it_can_get_then_adds_one_beside_them_make_before_break(world):
    """The policy chooses 2 x v4-16 spot while the zone has room for one: the job starts on the one
    (the other request is let go), and when capacity comes the policy's grow asks for one slice
    beside it, which the job switches onto at a committed step, keeping the running one."""
    policy = ScriptedPolicy()
    driver = world.submit(spec(autoscaling={"accelerators": ["v4-16"], "max_slices": 2}, deadline="PT24H"),
                          policy=policy)
    world.provider.spot_slots = 1
    two = option("v4-16", 2)
    seen = []

    def decide(spec_, current, *, waiting=None, ready=False):
        seen.append((current, waiting, ready))
        if current is None:
            return choice(Move(target=two), "v4-16", 2)
        if ready:
            return choice(Move(target=two, switch=True), "v4-16", 2)
        if current == ("v4-16", "spot", 1) and driver.progress.last_step >= 4 and waiting is None:
            world.provider.spot_slots = 2  # capacity for the second came
            return choice(Move(target=two, request=two, beside=True), "v4-16", 2)
        return choice(Move(target=option("v4-16", current[2])), "v4-16", current[2])

    policy.decide = decide
    driver.moves.ask_now()
    world.on_step = lambda group, step: driver.moves.ask_now()  # ask the policy every poll
    world.run(driver)
    job = world.store.job("job")
    assert job.state is JobState.SUCCEEDED and job.failures == 0 and job.spec.slices == 2
    g1, g2 = world.groups
    assert (len(g1.slices), g1.hosts, len(g2.slices), g2.hosts) == (1, 2, 2, 4)
    assert g1.slices[0] in g2.slices  # the running slice was kept: slices added beside it
    assert (g1.spec.slices, g2.spec.slices) == (1, 2)  # each launch's spec says the slices it goes on
    asked = [name for name, s in world.provider.slices.items()]
    first_attempt = [n for n in asked if n.startswith("job-1")]
    assert len(first_attempt) == 2 and world.provider.slices[first_attempt[1]].state is SliceState.RELEASED
    assert any(e.reason.startswith("1 of 2 slices could be had now") for e in events(world, EventKind.AUTOSCALE))
    assert ("v4-16", "spot", 1) in [c for c, _, _ in seen]  # asked about the one slice it ran on
    assert (("v4-16", "spot", 1), ("v4-16", "spot", 2), True) in seen  # told the grow is READY
    [resize] = events(world, EventKind.RESIZE)
    assert "ready beside" in resize.reason and "2xv4-16 spot" in resize.reason
    restored = [e.data["restored_step"] for e in events(world, EventKind.RESTORE)]
    assert restored[1] == g1.step + 1  # nothing lost across the grow
    assert "RECOVERING" not in states(world)


def test_an_autoscaled_job_that_loses_one_of_its_slices_goes_on_from_memory_and_the_policy_adds_one_back(world):
    """2 x v4-16 chosen by the policy; a host of the second slice goes: the job goes on on the first
    from memory (its spec now says 1 slice, as the policy is told), and the policy's grow adds one
    beside it, make-before-break."""
    policy = ScriptedPolicy()
    driver = world.submit(spec(autoscaling={"accelerators": ["v4-16"], "max_slices": 2}, deadline="PT24H",
                               workload={**spec()["workload"], "steps": 30}), policy=policy)
    two = option("v4-16", 2)
    told = []

    def decide(spec_, current, *, waiting=None, ready=False):
        told.append(current)
        if current is None:
            return choice(Move(target=two), "v4-16", 2)
        if ready:
            return choice(Move(target=two, switch=True), "v4-16", 2)
        if current == ("v4-16", "spot", 1) and driver.progress.last_step >= 12 and waiting is None:
            return choice(Move(target=two, request=two, beside=True), "v4-16", 2)
        return choice(Move(target=option("v4-16", current[2])), "v4-16", current[2])

    def lose_a_slice(group, step):
        driver.moves.ask_now()  # ask the policy every poll
        if group.generation == 1 and step == 7:
            world.lost_memory.add(group.slices[1])
            world.provider.send(group.slices[1], SliceEventKind.HOST_LOST, "host 1 of the second slice vanished")

    policy.decide = decide
    world.on_step = lose_a_slice
    world.run(driver)
    job = world.store.job("job")
    assert job.state is JobState.SUCCEEDED and job.preemptions == 1 and job.spec.slices == 2
    g1, g2, g3 = world.groups
    assert [len(g.slices) for g in world.groups] == [2, 1, 2] and g2.slices == g1.slices[:1]
    assert [g.spec.slices for g in world.groups] == [2, 1, 2]
    assert g2.slices[0] in g3.slices  # the survivor kept, one slice added beside it
    assert ("v4-16", "spot", 1) in told
    assert [(e.data["restored_step"], e.data["source"]) for e in events(world, EventKind.RESTORE)] == \
        [(None, "storage"), (8, "memory"), (g2.step + 1, "storage")]
    assert [e.data["steps"] for e in events(world, EventKind.LOST_WORK)] == [0, 0]


def test_a_move_to_several_slices_of_another_type_waits_for_all_of_them_then_releases_the_old_slice(world):
    policy = ScriptedPolicy()
    driver = world.submit(spec(accelerator="v4-32", autoscaling={"accelerators": ["v4-16", "v4-32"],
                                                                  "max_slices": 2}, deadline="PT24H"), policy=policy)
    two = option("v4-16", 2)

    def decide(spec_, current, *, waiting=None, ready=False):
        if current is None:
            return choice(Move(target=option("v4-32")), "v4-32")
        if ready:
            return choice(Move(target=two, switch=True), "v4-16", 2)
        if current == ("v4-32", "spot", 1) and driver.progress.last_step >= 3 and waiting is None:
            return choice(Move(target=two, request=two, beside=True), "v4-16", 2)
        return choice(Move(target=option(current[0], current[2])), current[0], current[2])

    policy.decide = decide
    driver.moves.ask_now()
    world.on_step = lambda group, step: driver.moves.ask_now()
    world.run(driver)
    job = world.store.job("job")
    assert job.state is JobState.SUCCEEDED and (job.spec.accelerator, job.spec.slices) == ("v4-16", 2)
    g1, g2 = world.groups
    assert (g1.hosts, len(g2.slices), g2.hosts) == (4, 2, 4)
    assert g1.slices[0] not in g2.slices
    history = [(e.data["name"], e.data["state"]) for e in events(world, EventKind.SLICE)]
    old_released = history.index((g1.slices[0], "RELEASED"))
    assert all(history.index((n, "READY")) < old_released for n in g2.slices)  # make before break
    assert (g1.spec.slices, g2.spec.slices) == (1, 2)


def test_a_refused_request_is_followed_by_the_policys_next_choice_without_a_failure(world):
    """An autoscaled job's spot request refused at once: the policy is asked again and its next choice
    requested (PROVISIONING again, an allowed move), spending no failure and queueing nothing."""
    policy = ScriptedPolicy()
    driver = world.submit(spec(autoscaling={"accelerators": ["v4-16", "v4-32"]}, deadline="PT24H"), policy=policy)
    world.provider.refuse = ["v4-32"]
    asked = []

    def decide(spec_, current, *, waiting=None, ready=False):
        asked.append(current)
        name = "v4-32" if len(asked) == 1 else "v4-16"  # the big one first; refused, the small one
        return choice(Move(target=option(name)), name)

    policy.decide = decide
    world.run(driver)
    job = world.store.job("job")
    assert job.state is JobState.SUCCEEDED and job.failures == 0 and job.spec.accelerator == "v4-16"
    assert states(world)[:4] == ["PENDING", "PROVISIONING", "PROVISIONING", "STARTING"]
    assert "QUEUED" not in states(world) and len(world.groups) == 1


def test_a_slice_that_comes_ready_between_two_looks_takes_the_job_from_queued_through_provisioning(world):
    driver = world.submit(spec())
    world.provider.waits = 2
    world.run(driver)
    assert world.store.job("job").state is JobState.SUCCEEDED
    assert states(world)[:5] == ["PENDING", "PROVISIONING", "QUEUED", "PROVISIONING", "STARTING"]


def test_a_budget_stop_ends_the_job_failed_budget_at_a_committed_step(world, monkeypatch):
    from orchestrator.control import limits
    from policies.decisions import limits as rules

    monkeypatch.setattr(limits, "CHECK_S", 0.0)
    monkeypatch.setattr(limits, "RELEASE_S", 0.0)  # a fake slice is given back at once
    monkeypatch.setattr(rules, "MIN_RUN_S", 1.0)
    # A v4-32 on demand costs $51.52/h: the cap is about 3.5 s of it, the stop 1 s.
    driver = world.submit(spec(accelerator="v4-32", tier="on-demand", budget_usd=0.05,
                               recovery={"grace_period_s": 1},
                               workload={**spec()["workload"], "steps": 100_000}))
    world.on_step = lambda group, step: time.sleep(0.01)  # steps that take time: the budget is spent by the clock
    world.run(driver, timeout_s=30)
    job = world.store.job("job")
    assert job.state is JobState.FAILED and job.cause == FailedBecause.BUDGET.value, job.reason
    assert job.reason.startswith("budget_usd is $0.05") and "with its checkpoint committed" in job.reason
    [group] = world.groups
    assert group.ended is not None and group.ended[0].ending == "stopped"  # stopped at a step it committed
    assert world.committed == group.ended[0].steps
    spent = sum(s.usd for s in billed_slices(world.store.events("job"), end=time.time()))
    assert 0.03 < spent <= 0.05  # it trained on most of the cap and did not pass it


@pytest.mark.parametrize("accelerators, max_slices, hosts, chips", [
    (["v4-16"], 1, 8, 8), (["v4-16"], 2, 8, 16), (["v4-16"], 4, 8, 32),  # v4-16 x 4: 32 chips on 8 hosts
    (["v4-16"], 4, 6, 24),  # this machine's 6 hosts hold 3 of them
    (["v4-16", "v4-32"], 4, 8, 32),  # 32 chips at most: v4-32 x 2
])
def test_the_spot_chips_a_job_may_ask_for_count_the_slices_it_may_hold(world, accelerators, max_slices, hosts,
                                                                         chips):
    driver = world.submit(spec(autoscaling={"accelerators": accelerators, "max_slices": max_slices},
                               deadline="PT24H"))
    world.provider.max_hosts = hosts
    from orchestrator.control.job.policy import StoredFactsPolicy

    assert isinstance(driver.policy, StoredFactsPolicy)  # the real policy, when no test scripts one
    assert driver.policy.spot_chips_available(driver.spec()) == chips


def test_a_generation_lost_before_its_first_step_is_lost_where_it_restored(world, monkeypatch):
    """Generation 2 restores step 5 and loses a host before it trains: it was lost after step 5, not 'after
    step 0', and nothing was lost by it (its disruption and lost work say so)."""
    from tests.unit.driver_world import ScriptedGroup

    launch = ScriptedGroup.launch

    def launch_then_lose_a_host(group):
        launch(group)
        if group.generation == 2:
            world.provider.send(group.slice_name, SliceEventKind.HOST_LOST, "host 0 vanished before its first step")

    monkeypatch.setattr(ScriptedGroup, "launch", launch_then_lose_a_host)
    driver = world.submit(spec())
    lose_a_host_after_step_7(world)
    world.run(driver)
    assert world.store.job("job").state is JobState.SUCCEEDED
    first, second = events(world, EventKind.DISRUPTION)[:2]
    assert "before its first step" in second.reason, second.reason
    assert second.data["step"] == 4 and "(after step 5)" in second.reason, second.reason
    lost = events(world, EventKind.LOST_WORK)
    assert [e.data["steps"] for e in lost][:2] == [3, 0], [e.reason for e in lost]
