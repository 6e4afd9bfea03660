"""A generation's launch plan: resolved once from the placed spec, recorded, shown by `status`, and what the hosts get.

The driver runs as in production against the fake cloud of `tests/unit/driver_world.py`;
the hosts' side is the `workers.order.LaunchOrder` as Ray carries it (pickled).
"""

from __future__ import annotations

import dataclasses
import io
import pickle

import pytest
from rich.console import Console
from typer.testing import CliRunner

from orchestrator import JobSpec, catalog
from orchestrator.cluster.home import Home
from orchestrator.control import group as groups
from orchestrator.control.compile_ahead import job_key, targets
from orchestrator.control.job import watch
from orchestrator.control.launch import LaunchPlan, launch_order, launch_plan
from orchestrator.control.launched import Launch
from orchestrator.observe.timeline import plan_line
from orchestrator.providers.base import Host, Slice
from orchestrator.state.events import EventKind, Planned
from orchestrator.state.states import JobState, SliceState
from orchestrator.state.store import Store
from orchestrator.user import cli
from orchestrator.user.commands import console
from tests.unit.driver_world import World, lose_the_second_slice_after_step_7, spec
from workers.order import BuiltInTrainer, LaunchOrder, StoredPrograms, UserEntrypoint

# Two slices of v4-16, whose plan differs from the defaults in every field the plan shows.
TWO_SLICES = spec(slices=2, checkpoint={"interval_steps": 5, "memory_interval_steps": 3})
TWO_SLICES["workload"] = {**TWO_SLICES["workload"], "gradient_accumulation": 2, "mesh": {"fsdp": 2}}


@pytest.fixture
def world(tmp_path, monkeypatch):
    monkeypatch.setattr(watch, "POLL_S", 0.005)  # a poll is a step of the scripted workers
    monkeypatch.setattr(watch, "SETTLE_S", 0.05)
    return World(tmp_path)


def status_lines(home: Home, monkeypatch, job_id: str, width: int = 200) -> list[str]:
    """`orchestrator status JOB` as a user sees it, at `width` columns."""
    monkeypatch.setenv("ORCHESTRATOR_HOME", str(home.root))
    buf = io.StringIO()
    monkeypatch.setattr(console, "out", Console(file=buf, width=width, soft_wrap=True, color_system=None))
    r = CliRunner().invoke(cli.app, ["status", job_id])
    assert r.exit_code == 0, r.output
    return (buf.getvalue() + r.stdout).splitlines()


def test_each_generation_records_its_plan_and_status_shows_the_current_one(world, monkeypatch):
    """Two slices, the survivor of a lost one from its memory, then two slices again (make-before-break):
    three plans, each the one its generation's workers were handed, and `status` shows the one running."""
    driver = world.submit(TWO_SLICES)
    lose_the_second_slice_after_step_7(world)
    lose_a_slice = world.on_step
    handed: dict[int, LaunchPlan | None] = {}
    shown_while_running: dict[int, str | None] = {}

    def on_step(group, step):
        handed[group.generation] = driver.launched.plan if driver.launched is not None else None
        shown_while_running[group.generation] = plan_line(world.store, world.store.job("job"))
        lose_a_slice(group, step)

    world.on_step = on_step
    world.run(driver)

    assert world.store.job("job").state is JobState.SUCCEEDED
    events = world.store.events("job", kind=EventKind.PLAN)
    plans = [e.payload_as(Planned) for e in events]
    assert [(p.generation, p.slices, p.memory_step) for p in plans] == [(1, 2, None), (2, 1, 8), (3, 2, None)]
    two = "2 x v4-16 spot, mesh (8,2,1), 2 microbatches, checkpoint every 5 steps, memory copy every 3 steps"
    survivor = "v4-16 spot, mesh (4,2,1), 2 microbatches, checkpoint every 5 steps, restoring step 8 from memory"
    lines = [f"gen 1 on {two}", f"gen 2 on {survivor}", f"gen 3 on {two}"]
    assert [p.line for p in plans] == lines
    assert [e.reason for e in events] == [f"plan: {line}" for line in lines]
    for generation, plan in handed.items():  # what the workers were handed is what was recorded
        assert plan is not None and plan.planned == plans[generation - 1]
    assert shown_while_running == {1: lines[0], 2: lines[1], 3: lines[2]}

    shown = status_lines(world.home, monkeypatch, "job")
    assert [line for line in shown if "plan:" in line] == [f"  plan: {lines[2]}"]
    assert all(len(line) <= 80 for line in status_lines(world.home, monkeypatch, "job", width=80))


def test_status_shows_no_plan_before_the_first_launch(tmp_path, monkeypatch):
    home = Home(tmp_path / "home").ensure()
    Store(home.db).create_job("new-1", "new", {"name": "new", "accelerator": "v4-8", "workload": {"type": "lm"}})
    assert not [line for line in status_lines(home, monkeypatch, "new-1") if "plan:" in line]


def test_the_plan_is_resolved_as_the_launch_order_is():
    s = JobSpec.from_dict(TWO_SLICES).with_checkpoint_directory("/ckpt/a")
    plan = launch_plan(s, 4, 1, memory_step=8)
    assert (plan.generation, plan.shape.key) == (4, ("v4-16", "spot", 1))
    assert plan.order == launch_order(s, 8, 2, slices=1, memory_step=8)
    assert plan.planned == Planned(generation=4, accelerator="v4-16", tier="spot", slices=1, mesh=[4, 2, 1],
                                   microbatches=2, checkpoint_interval=5, memory_interval=None, memory_step=8)


@pytest.mark.parametrize("planned, line", [
    (Planned(1, "v4-8", "on-demand", 1, None, 1, None), "gen 1 on v4-8 on-demand, 1 microbatch, no checkpoints"),
    (Planned(2, "v5e-16", "spot", 3, [12, 1, 1], 4, 100, None),
     "gen 2 on 3 x v5e-16 spot, mesh (12,1,1), 4 microbatches, checkpoint every 100 steps, "
     "memory copy interval measured"),
])
def test_a_plan_reads_as_one_line(planned, line):
    assert planned.line == line


def _order(program) -> LaunchOrder:
    s = JobSpec.from_dict(TWO_SLICES)
    return dataclasses.replace(launch_order(s, 8, 2, slices=2), program=program,
                               programs=StoredPrograms("gs://b/ckpt", b"k" * 32, targets(catalog.lookup("v4-16"), 2)))


@pytest.mark.parametrize("program", [
    BuiltInTrainer(launch_order(JobSpec.from_dict(TWO_SLICES), 8, 2, slices=2).program.lm),
    UserEntrypoint("train:main", {"lr": 0.1, "layers": [1, 2]}, "/home/me/job"),
])
def test_an_order_reaches_the_hosts_as_it_was_made(program):
    order = _order(program)
    carried = pickle.loads(pickle.dumps(order))  # as Ray carries it to each host's `HostWorker.start`
    assert carried == order and type(carried.program) is type(program)
    assert (b"k" * 32).hex() not in repr(order) and "kkkk" not in repr(order)  # logged, it keeps the job's key


def test_a_user_entrypoint_names_its_module_and_function():
    program = UserEntrypoint("pkg.train:main")
    assert (program.module, program.function) == ("pkg.train", "main")
    with pytest.raises(ValueError, match="module:function"):
        UserEntrypoint("train")


def _group(tmp_path, spec_data: dict) -> groups.RayWorkerGroup:
    """A Ray group for generation 1 of `spec_data` on one v4-16 (made, not launched: nothing of Ray is asked)."""
    home = Home(tmp_path / "home").ensure()
    s = JobSpec.from_dict(spec_data).with_checkpoint_directory(str(tmp_path / "ckpt"))
    t = catalog.lookup("v4-16")
    hosts = tuple(Host(i, f"s-w{i}") for i in range(t.hosts))
    sl = Slice("s", "job", t, catalog.Tier.SPOT, None, SliceState.READY, hosts, "local")
    launch = Launch.of(launch_plan(s, 1, 1), (sl,))
    return groups.RayWorkerGroup(Store(home.db), home, "job", s, launch, on_lost=lambda name: None)


def test_the_hosts_get_the_plan_s_order_with_where_their_program_is_stored(tmp_path):
    group = _group(tmp_path, spec())
    order = group._order(shipped=False)
    plan = group.launched.plan
    assert plan is not None and dataclasses.replace(order, programs=None) == plan.order
    assert order.programs == StoredPrograms(str(tmp_path / "ckpt"), job_key(group.home, "job"),
                                            targets(catalog.lookup("v4-16"), 1))


def test_a_shipped_user_program_is_imported_from_its_shipped_copy(tmp_path):
    (tmp_path / "job").mkdir()
    group = _group(tmp_path, {**spec(), "workdir": str(tmp_path / "job"),
                              "workload": {"type": "entrypoint", "entrypoint": "train:main", "args": {"a": 1}}})
    program = group.launched.plan.order.program
    assert program == UserEntrypoint("train:main", {"a": 1}, str(tmp_path / "job"))
    assert group._order(shipped=False).program == program
    assert group._order(shipped=True).program == UserEntrypoint("train:main", {"a": 1}, None)
    assert group._order(shipped=True).programs is None  # only the built-in trainer's step is compiled ahead
