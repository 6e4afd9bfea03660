"""The fleet benchmark's world at N=50 (`benchmarks/fleet.py`): many real drivers over one store and one gcp
provider on the TPU API emulator, scripted hosts. Every job must end SUCCEEDED (that end recorded once) with
every step recorded once, every slice's history must run from its request to the state the store holds, a
reclaimed slice's job must go on on a new slice, and no slice may be left behind; and with
more slices than `Polling.list_over` the provider looks at them through the zone's listing, not a GET each.
And at N=20 with the groups outside the controller's process, the controller killed (SIGKILL) once every
job runs: the restarted one adopts every job on its running group through the controller's own adoption pass,
and no step is lost or done twice, no slice left behind, every job ends SUCCEEDED once."""

from __future__ import annotations

import argparse
import sqlite3
import time

import pytest

from benchmarks import fleet, fleet_world
from benchmarks.fleet import job_spec
from benchmarks.fleet_world import FleetWorld
from orchestrator.control.job import loop
from orchestrator.emulator import running_emulator

N, STEPS = 50, 12


@pytest.fixture
def no_fence(monkeypatch):
    """The fence goes to Cloud Storage in production; the benchmark counts it and skips it."""
    monkeypatch.setattr(loop, "write_fence", lambda spec, generation, owner=None: None)


def _run(tmp_path, *, list_over: int | None) -> tuple[FleetWorld, dict[str, int], list[str]]:
    with running_emulator(time_scale=0.005, zones=(fleet_world.ZONE,)) as emu:
        # No create pace: 50 jobs starting at once would wait 40 s at the default 60 a minute (a burst of 10);
        # the pace has tests of its own (tests/unit/test_create_pace.py).
        world = FleetWorld(tmp_path / "home", emu.url, step_s=0.05, notice_every=0, serve=False,
                           list_over=list_over, creates_per_minute=None)
        for i in range(N):
            world.submit(f"fleet-{i:04d}", job_spec(i, emu.url, steps=STEPS, autoscale=i % 4 == 0))
        reclaimed = []
        deadline = time.monotonic() + 90
        while world.running() and time.monotonic() < deadline:
            if not reclaimed:  # one running spot slice taken back by the service, once
                with emu.world._cond:
                    active = [q.name for q in emu.world._qrs.values() if q.state == "ACTIVE" and "spot" in q.spec]
                if active:
                    emu.reclaim(active[0])
                    reclaimed.append(active[0].rsplit("/", 1)[1])
            time.sleep(0.05)
        assert not world.running(), f"{world.running()} jobs still running after 90 s"
        time.sleep(0.5)  # deletes settle
        with emu.world._cond:
            left = [q.name for q in emu.world._qrs.values() if q.state != "DELETING"]
        counts = {m: emu.request_count(m) for m in ("queuedResources.get", "queuedResources.list", "nodes.list")}
    assert not left, f"queued resources left in the API: {left}"
    return world, counts, reclaimed


def _check_store(world: FleetWorld, reclaimed: list[str]) -> None:
    db = sqlite3.connect(world.home.db)
    states = dict(db.execute("SELECT id, state FROM jobs").fetchall())
    assert states == {f"fleet-{i:04d}": "SUCCEEDED" for i in range(N)}
    for job in states:
        steps = [r[0] for r in db.execute("SELECT step FROM steps WHERE job_id=? ORDER BY step", (job,))]
        assert steps == list(range(STEPS)), f"{job} recorded steps {steps}"
    ended = dict(db.execute("SELECT job_id, COUNT(*) FROM events WHERE to_state='SUCCEEDED' GROUP BY job_id"))
    assert ended == {job: 1 for job in states}, "each job's end recorded once"
    for name, job, state in db.execute("SELECT name, job_id, state FROM slices").fetchall():
        # No lost event: a slice's history starts with its request and ends in the state the store holds.
        seen = [s for (s,) in db.execute("SELECT json_extract(data, '$.state') FROM events WHERE kind='slice' AND "
                                         "job_id=? AND json_extract(data, '$.name')=? ORDER BY seq", (job, name))]
        assert seen and seen[0] == "REQUESTED" and seen[-1] == state, f"slice {name}: {seen}, now {state}"
    live = db.execute("SELECT name, state FROM slices WHERE state NOT IN ('RELEASED', 'GONE')").fetchall()
    assert not live, f"slices the store still counts as live: {live}"
    if reclaimed:  # its job went on on another slice
        (job,) = db.execute("SELECT job_id FROM slices WHERE name=?", (reclaimed[0],)).fetchone()
        assert db.execute("SELECT COUNT(*) FROM slices WHERE job_id=?", (job,)).fetchone()[0] >= 2


def test_a_fleet_ends_as_it_should_through_the_zone_listing(tmp_path, no_fence):
    world, counts, reclaimed = _run(tmp_path, list_over=4)
    _check_store(world, reclaimed)
    assert counts["queuedResources.list"] > 0 and counts["nodes.list"] > 0


def test_a_fleet_ends_as_it_should_looking_at_each_slice(tmp_path, no_fence):
    world, counts, reclaimed = _run(tmp_path, list_over=1_000_000)
    _check_store(world, reclaimed)
    assert counts["queuedResources.list"] == 0 and counts["queuedResources.get"] > 0


def test_a_restarted_controller_adopts_every_running_job_and_loses_no_step():
    args = argparse.Namespace(steps=40, step_s=0.25, time_scale=0.005, max_s=120.0, notice_every=0, autoscale_every=4,
                              seed=0, creates_per_minute=0, list_over=None, tick_s=0, query_every_s=1000.0,
                              kill_controller=True, kill_wait_s=60.0, kill_after_s=1.0, down_s=1.0,
                              profile_adoption=False)
    run = fleet.run_one(20, args)
    kill = run["kill"]
    assert run["exit_code"] == 0 and run["job_states"] == {"SUCCEEDED": 20}
    assert kill["running_at_kill"] == 20 and kill["adopted"] == 20 and kill["relaunched"] == []
    assert kill["to_adopt_s"]["n"] == 20
    steps = kill["steps"]
    assert (steps["unrecorded"], steps["recorded_twice"], steps["done_again"], steps["recorded_before_kill_gone"]) \
        == (0, 0, 0, 0), steps
    events = kill["events"]
    assert events["adopted_recorded"] == 20 and events["jobs_adopted_twice"] == [] and events["ends_not_once"] == []
    assert events["slices_with_broken_history"] == []
    assert events["checkpoints_unrecorded"] == 0  # those committed while no controller ran: from the history
    assert run["left_in_api"] == 0 and run["live_slices_in_store"] == 0
