"""The four plans that used to share `Attempt.resize_to`, each now its own stop request: a user's resize,
the policy releasing the held slice, a switch to slices READY beside, and a regrow. Each test runs the real
driver in the scripted world (`tests/unit/driver_world.py`) and checks the stop the workers were asked for
and what the job did after it."""

from __future__ import annotations

import pytest

from orchestrator.control.job import watch
from orchestrator.control.job.stop import StopKind, StopRequest, Stops
from orchestrator.domain.shape import Shape
from orchestrator.state.events import EventKind
from orchestrator.state.states import JobState, SliceState
from policies.cost.moves import Move
from tests.unit.driver_world import (
    ScriptedGroup,
    ScriptedPolicy,
    World,
    choice,
    lose_the_second_slice_after_step_7,
    option,
    spec,
)


@pytest.fixture
def world(tmp_path, monkeypatch):
    monkeypatch.setattr(watch, "POLL_S", 0.005)  # a poll is a step of the scripted workers
    monkeypatch.setattr(watch, "SETTLE_S", 0.05)
    return World(tmp_path)


@pytest.fixture
def asked(monkeypatch):
    """The stop request each generation's workers were asked to stop for, by generation."""
    stops: dict[int, StopRequest | None] = {}
    request_stop = ScriptedGroup.request_stop

    def record(group, reason):
        stops[group.generation] = group.driver.stops.current
        request_stop(group, reason)

    monkeypatch.setattr(ScriptedGroup, "request_stop", record)
    return stops


def states(world):
    return [e.to_state for e in world.store.events("job") if e.kind is EventKind.STATE]


def events(world, kind):
    return [e for e in world.store.events("job") if e.kind is kind]


def test_a_users_resize_is_a_resize_stop_and_the_next_launch_goes_on_the_size_asked_for(world, asked):
    driver = world.submit(spec())

    def resize_at_step_3(group, step):
        if group.generation == 1 and step == 3:
            driver.resize("v4-32", "spot", "by hand")

    world.on_step = resize_at_step_3
    world.run(driver)
    stop = asked[1]
    assert stop is not None and stop.kind is StopKind.RESIZE and stop.relaunches
    assert stop.target == Shape("v4-32", "spot", 1) and stop.reason == "resize to v4-32: by hand"
    job = world.store.job("job")
    assert job.state is JobState.SUCCEEDED and job.spec.accelerator == "v4-32" and job.preemptions == 0
    # Where it runs is the job's shape; the spec stays as the user submitted it.
    assert job.shape == Shape("v4-32", "spot", 1)
    assert job.submitted.accelerator == job.stored_spec["accelerator"] == "v4-16"
    g1, g2 = world.groups
    assert (g1.hosts, g2.hosts) == (2, 4)
    assert "RESIZING" in states(world) and "RECOVERING" not in states(world)
    assert [e.data["restored_step"] for e in events(world, EventKind.RESTORE)][1] == g1.step + 1  # nothing lost


def test_the_policy_releasing_the_held_slice_is_a_release_stop_and_the_policy_is_asked_again(world, asked):
    policy = ScriptedPolicy()
    driver = world.submit(spec(autoscaling={"accelerators": ["v4-16"]}, deadline="PT24H"), policy=policy)
    asked_before_provisioning = []

    def decide(spec_, current, *, waiting=None, ready=False):
        if current is None:  # before each provisioning
            asked_before_provisioning.append(driver.progress.generation)
            return choice(Move(target=option("v4-16")), "v4-16")
        if driver.progress.generation == 1 and driver.progress.last_step >= 3:
            return choice(Move(target=None, release_held=True), None)  # hold nothing: wait for spot
        return choice(Move(target=option("v4-16")), "v4-16")

    policy.decide = decide
    world.on_step = lambda group, step: driver.moves.ask_now()  # ask the policy every poll
    world.run(driver)
    stop = asked[1]
    assert stop is not None and stop.kind is StopKind.RELEASE and stop.target == Shape("v4-16", "spot", 1)
    assert stop.reason.startswith("the policy releases the slice")
    assert 2 not in asked  # generation 2 ran to its end
    job = world.store.job("job")
    assert job.state is JobState.SUCCEEDED and job.preemptions == 0
    g1, g2 = world.groups
    assert g1.slices != g2.slices and world.provider.slices[g1.slices[0]].state is SliceState.RELEASED
    assert asked_before_provisioning == [0, 1]  # the next attempt asked the policy what to run
    assert any(e.reason.startswith(f"release {g1.slices[0]} and wait for spot") for e in events(world,
                                                                                              EventKind.AUTOSCALE))
    assert "RESIZING" in states(world) and "RECOVERING" not in states(world)


def test_a_switch_to_slices_ready_beside_is_a_move_stop_to_the_requests_shape(world, asked):
    policy = ScriptedPolicy()
    driver = world.submit(spec(autoscaling={"accelerators": ["v4-16", "v4-32"]}, deadline="PT24H"), policy=policy)

    def decide(spec_, current, *, waiting=None, ready=False):
        if current is None:
            return choice(Move(target=option("v4-16")), "v4-16")
        if ready:
            return choice(Move(target=option("v4-32"), switch=True), "v4-32")
        if driver.progress.generation == 1 and driver.progress.last_step >= 3 and waiting is None:
            return choice(Move(target=option("v4-32"), request=option("v4-32")), "v4-16")
        return choice(None, spec_.accelerator)

    policy.decide = decide
    world.on_step = lambda group, step: driver.moves.ask_now()
    world.run(driver)
    g1, g2 = world.groups
    stop = asked[1]
    assert stop is not None and stop.kind is StopKind.MOVE and stop.target == Shape("v4-32", "spot", 1)
    assert stop.reason.startswith(f"move to v4-32 spot: slice {g2.slices[0]} (v4-32 spot) is ready beside "
                                  f"{g1.slices[0]}")
    job = world.store.job("job")
    assert job.state is JobState.SUCCEEDED and job.spec.accelerator == "v4-32" and (g1.hosts, g2.hosts) == (2, 4)
    assert job.shape == Shape("v4-32", "spot", 1) and job.submitted.accelerator == "v4-16"
    assert "RESIZING" in states(world) and "RECOVERING" not in states(world)


def test_a_regrow_onto_a_slice_ready_beside_the_survivors_is_a_regrow_stop_to_the_full_count(world, asked):
    driver = world.submit(spec(slices=2))
    lose_the_second_slice_after_step_7(world)
    world.run(driver)
    g1, g2, g3 = world.groups
    assert 1 not in asked  # a host lost: no stop was asked of generation 1
    stop = asked[2]
    assert stop is not None and stop.kind is StopKind.REGROW and stop.target == Shape("v4-16", "spot", 2)
    assert stop.reason == f"adding slice {g3.slices[0]} back"
    assert g2.slices == g1.slices[:1] and g3.slices == [g3.slices[0], g1.slices[0]]  # the survivor stays
    job = world.store.job("job")
    assert job.state is JobState.SUCCEEDED and job.spec.slices == 2 and job.preemptions == 1


def test_the_first_stop_asked_stands_until_the_next_launch():
    stops = Stops()
    resize = StopRequest(StopKind.RESIZE, "resize to v4-32: by hand", Shape("v4-32", "spot"))
    assert stops.ask(resize) and not stops.ask(StopRequest.notice("host 0: preempted"))
    assert stops.current is resize
    stops.clear()
    assert stops.current is None and stops.ask(StopRequest.cancel()) and stops.current.kind is StopKind.CANCEL


@pytest.mark.parametrize("kind, target", [(StopKind.MOVE, None), (StopKind.NOTICE, Shape("v4-16", "spot"))])
def test_a_stop_names_a_shape_exactly_when_a_launch_follows_it(kind, target):
    with pytest.raises(ValueError, match="StopRequest.target"):
        StopRequest(kind, "why", target)


def test_a_shape_counts_at_least_one_slice():
    with pytest.raises(ValueError, match="Shape.count"):
        Shape("v4-16", "spot", 0)
    assert Shape("v4-16", "spot", 2).label == "2xv4-16 spot" and Shape("v4-32", "on-demand").label == "v4-32 on-demand"


def test_a_resize_behind_a_standing_notice_is_refused_not_lost(world, asked):
    """One stop a launch: a user's resize asked while a notice stands would be dropped silently, so the
    driver refuses it and names the stop that stands (the controller turns that into the user's error)."""
    driver = world.submit(spec())
    refused = []

    def notice_then_resize_at_step_3(group, step):
        if group.generation == 1 and step == 3:
            driver.stops.ask(StopRequest.notice("host 0: preempted"))
            refused.append(driver.resize("v4-32", "spot", "by hand"))

    world.on_step = notice_then_resize_at_step_3
    world.run(driver)
    assert len(refused) == 1 and refused[0] is not None and refused[0].kind is StopKind.NOTICE
    assert asked[1] is refused[0]
    job = world.store.job("job")
    assert job.state is JobState.SUCCEEDED and job.spec.accelerator == "v4-16"  # not resized behind the notice
