"""The job's storage as the hand-off of programs compiled ahead (`workers.stored_programs`): keyed by what
the program is and the shape it was compiled for, sealed with the job's key, selected by a host of that
shape only, refused when altered, moved, or made by another build. No compiler: the bytes stand for an
executable (the test_compile_ahead_storage.py of tests/numerics and of tests/tpu store real ones)."""

from __future__ import annotations

import dataclasses
import os
import secrets

import pytest

from orchestrator import JobSpec, catalog
from orchestrator.control.attempt import Attempt
from orchestrator.control.compile_ahead import NextShape, job_key, launch_programs, next_shapes, option_for, targets
from orchestrator.control.waiting import Waiting
from workers import stored_programs as sp
from workers.order import StoredPrograms

KEY = secrets.token_bytes(32)
SID = sp.stored_id("train_step", {"d_model": 32, "slices": 1})
V4_16 = sp.target_name("v4", "2x2x2", 2, 1)


def test_a_host_of_the_shape_it_was_stored_for_selects_it(tmp_path):
    path = sp.write(str(tmp_path), SID, V4_16, b"executable", KEY)

    assert path == str(tmp_path / "programs" / SID / "v4-2x2x2-2h-1s.sealed")
    found = sp.select(str(tmp_path), SID, V4_16, KEY)
    assert found.used and found.kept == b"executable" and found.target == V4_16


def test_a_host_of_another_shape_does_not_and_says_which_shapes_are_stored(tmp_path):
    sp.write(str(tmp_path), SID, V4_16, b"executable", KEY)

    found = sp.select(str(tmp_path), SID, sp.target_name("v4", "2x2x4", 4, 1), KEY)
    assert not found.used
    assert found.reason == "stored only for other shapes (v4-2x2x2-2h-1s), not this host's v4-2x2x4-4h-1s"
    other_program = sp.select(str(tmp_path), sp.stored_id("train_step", {"d_model": 64}), V4_16, KEY)
    assert other_program.reason == f"none stored for this program on {V4_16}"


@pytest.mark.parametrize("alter", ["flip a byte", "truncate", "other key"])
def test_a_blob_that_was_tampered_with_is_refused(tmp_path, alter, caplog):
    path = sp.write(str(tmp_path), SID, V4_16, b"executable", KEY)
    blob = open(path, "rb").read()
    key = KEY
    if alter == "flip a byte":
        blob = blob[:-1] + bytes([blob[-1] ^ 1])
    elif alter == "truncate":
        blob = blob[:40]
    else:
        key = secrets.token_bytes(32)
    open(path, "wb").write(blob)

    found = sp.select(str(tmp_path), SID, V4_16, key)
    assert not found.used and found.reason == "refused: its seal does not match the job's key"
    assert "refused the program stored at" in caplog.text


def test_a_blob_moved_to_another_shape_s_place_is_refused(tmp_path):
    """The seal covers the place: a v4-16 program copied over a v4-32's name does not open there."""
    v4_32 = sp.target_name("v4", "2x2x4", 4, 1)
    src = sp.write(str(tmp_path), SID, V4_16, b"executable", KEY)
    dst = sp.path_of(str(tmp_path), SID, v4_32)
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    open(dst, "wb").write(open(src, "rb").read())

    assert sp.select(str(tmp_path), SID, v4_32, KEY).reason == "refused: its seal does not match the job's key"


def test_a_program_of_another_jax_or_libtpu_is_compiled_again_and_says_why(tmp_path):
    here = sp.Versions.here()
    sp.write(str(tmp_path), SID, V4_16, b"x", KEY, versions=dataclasses.replace(here, libtpu="0.0.1"))
    assert sp.select(str(tmp_path), SID, V4_16, KEY).reason == f"compiled by libtpu 0.0.1 (this host: {here.libtpu})"

    cpu = sp.target_name("cpu", "4", 1, 1)  # libtpu does not build a CPU executable: it does not count
    sp.write(str(tmp_path), SID, cpu, b"x", KEY, versions=dataclasses.replace(here, libtpu="0.0.1"))
    assert sp.select(str(tmp_path), SID, cpu, KEY).used
    sp.write(str(tmp_path), SID, cpu, b"x", KEY, versions=dataclasses.replace(here, jax="0.0.1"))
    assert sp.select(str(tmp_path), SID, cpu, KEY).reason == f"compiled by jax 0.0.1 (this host: {here.jax})"


def test_take_keeps_it_under_the_host_s_own_program_id_where_compile_keyed_loads_it(tmp_path, monkeypatch):
    from workers import programs as executables

    monkeypatch.setattr(executables, "kept_program_path", lambda key: tmp_path / "cache" / f"program-{key}.pkl")
    config = {"d_model": 32}
    sp.write(str(tmp_path / "job"), sp.stored_id("train_step", config), V4_16, b"executable", KEY)
    programs = StoredPrograms(str(tmp_path / "job"), KEY, {"tpu": V4_16, "cpu": "cpu:4/2h/1s"})

    found = sp.take(programs, endpoint=None, platform="tpu", name="train_step", config=config, program_id="abc")
    assert found is not None and found.used
    assert (tmp_path / "cache" / "program-abc.pkl").read_bytes() == b"executable"
    on_cpu = sp.take(programs, endpoint=None, platform="cpu", name="train_step", config=config, program_id="abd")
    assert on_cpu is not None and not on_cpu.used and not (tmp_path / "cache" / "program-abd.pkl").exists()
    assert sp.take(None, endpoint=None, platform="tpu", name="train_step", config=config, program_id="abc") is None


def _spec(slices: int = 2, **more) -> JobSpec:
    return JobSpec.from_dict({"name": "a", "accelerator": "v4-16", "slices": slices,
                              "checkpoint": {"directory": "/tmp/x"}, **more,
                              "workload": {"type": "lm", "steps": 40, "global_batch_size": 32, "seq_len": 16}})


def test_the_next_shapes_are_the_survivors_the_move_requested_and_the_resize():
    att = Attempt()
    att.slice, att.others = object(), [object()]  # type: ignore[assignment]  # two slices running
    assert next_shapes(_spec(), att) == [NextShape("v4-16", 1, "the survivors of a lost slice")]
    att.waiting = Waiting("r", "v4-32", "spot", 0.0, None, count=2)
    att.resize_to = "v4-64"
    assert [(s.accelerator, s.slices) for s in next_shapes(_spec(), att)] == [("v4-16", 1), ("v4-32", 2),
                                                                              ("v4-64", 2)]
    att.others, att.waiting, att.resize_to = [], None, None
    assert next_shapes(_spec(1), att) == []


def test_an_option_is_what_the_hosts_of_that_shape_are_launched_with():
    from orchestrator.control.launch import launch_order

    spec, t = _spec(), catalog.lookup("v4-16")
    survivors = option_for(spec, NextShape("v4-16", 1, "survivors"), "tpu")
    assert survivors.target == "v4:2x2x2/2h/1s" and survivors.settings == launch_order(spec, 8, 2, slices=1).settings
    assert option_for(spec, NextShape("v4-16", 1, "survivors"), "cpu").target == "cpu:4/2h/1s"
    assert targets(t, 2) == {"tpu": "v4:2x2x2/2h/2s", "cpu": "cpu:4/2h/2s"}


def test_the_job_s_key_is_made_once_and_reaches_its_launches(tmp_path):
    from orchestrator.cluster.home import Home

    home = Home(tmp_path)
    key = job_key(home, "job-1")
    assert job_key(home, "job-1") == key and job_key(home, "job-2") != key
    assert (os.stat(home.job_dir("job-1") / "programs.key").st_mode & 0o777) == 0o600
    given = launch_programs(home, "job-1", _spec(), catalog.lookup("v4-16"), 2)
    assert given == StoredPrograms("/tmp/x", key, targets(catalog.lookup("v4-16"), 2))
    assert key.hex() not in repr(given)  # a launch order that is logged does not show the job's key


def _service(tmp_path):
    from orchestrator.cluster.home import Home
    from orchestrator.control.compile_ahead import ProgramsAhead
    from orchestrator.state.store import Store

    home = Home(tmp_path).ensure()
    store = Store(home.db)
    store.create_job("j", "j", {})
    att = Attempt()
    att.slice, att.others, att.generation = object(), [object()], 1  # type: ignore[assignment]
    return ProgramsAhead(home, "j", store), store, att


def wait_idle(service) -> None:
    import time

    deadline = time.monotonic() + 10
    while service._busy.locked() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_the_service_starts_once_the_hosts_said_what_they_are_and_trained_a_few_steps(tmp_path, monkeypatch):
    from orchestrator.control import compile_ahead

    asked: list = []
    monkeypatch.setattr(compile_ahead, "compile_in_process", lambda options, **kw: asked.append(options) or {
        "options": [{"target": o.target, "ok": True, "seconds": 1.5, "size": 2**20} for o in options]})
    service, store, att = _service(tmp_path)
    spec = _spec()
    att.last_step = 5
    service.poll(lambda: spec, att)
    assert asked == []  # the hosts have not said whether they are TPU hosts or CPU stand-ins
    service.hosts_look_for("v4:2x2x2/2h/2s")
    service.poll(lambda: spec, att)  # the generation's first step seen: it waits AFTER_STEPS more
    att.last_step = 5 + compile_ahead.AFTER_STEPS
    service.poll(lambda: spec, att)
    wait_idle(service)
    service.poll(lambda: spec, att)  # each option once
    wait_idle(service)
    assert [[o.target for o in options] for options in asked] == [["v4:2x2x2/2h/1s"]]
    [event] = [e for e in store.events("j") if e.kind.value == "program"]
    assert event.data["ok"] and event.data["target"] == "v4:2x2x2/2h/1s" and event.data["host"] is None
    assert "stored (1.0 MiB)" in event.reason


def test_a_failed_compile_is_an_event_never_the_job_s_failure_and_cpu_hosts_need_the_switch(tmp_path, monkeypatch):
    from orchestrator.control import compile_ahead

    def fails(options, **kw):
        raise RuntimeError("the compile-ahead process exited with -9")

    monkeypatch.setattr(compile_ahead, "compile_in_process", fails)
    service, store, att = _service(tmp_path)
    service.hosts_look_for("cpu:4/2h/2s")
    att.last_step = 0
    service.poll(_spec, att)
    att.last_step = 10
    service.poll(_spec, att)
    assert not [e for e in store.events("j") if e.kind.value == "program"]  # CPU stand-ins: only with the switch
    (tmp_path / compile_ahead.CPU_SWITCH).touch()
    service.poll(_spec, att)
    wait_idle(service)
    [event] = [e for e in store.events("j") if e.kind.value == "program"]
    assert not event.data["ok"] and event.data["target"] == "cpu:4/2h/1s"
    assert "failed: RuntimeError: the compile-ahead process exited with -9; its hosts will compile" in event.reason


def test_in_a_bucket_the_same(gcs):
    """On gcp the job's storage is its bucket: written, selected, another shape told which are stored."""
    sp.write(gcs.folder, SID, V4_16, b"executable", KEY)

    assert sp.select(gcs.folder, SID, V4_16, KEY).kept == b"executable"
    other = sp.select(gcs.folder, SID, sp.target_name("v4", "2x2x4", 4, 1), KEY)
    assert other.reason == "stored only for other shapes (v4-2x2x2-2h-1s), not this host's v4-2x2x4-4h-1s"
    assert sp.select(gcs.folder, "0" * 64, V4_16, KEY).reason == f"none stored for this program on {V4_16}"
