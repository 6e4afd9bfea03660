"""The CLI as a user sees it: output and exit codes (0 ok, 1 job failed, 2 bad input)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from orchestrator.cli import app
from orchestrator.store import Store
from orchestrator.states import JobState

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("ORCHESTRATOR_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def run(*args):
    return CliRunner().invoke(app, list(args))


def test_validate_ok(tmp_path, home):
    p = tmp_path / "job.yaml"
    p.write_text("name: ok\naccelerator: v4-32\n")
    r = run("validate", str(p))
    assert r.exit_code == 0, r.output
    assert "valid (v4-32: 16 chips on 4 hosts, spot)" in r.output


@pytest.mark.parametrize("text", ["name: a/b\n", "name: a\nbogus: 1\n", "name: [\n"])
def test_bad_job_file_exits_2_and_creates_no_job(tmp_path, home, text):
    p = tmp_path / "job.yaml"
    p.write_text(text)
    for cmd in ("validate", "submit"):
        r = run(cmd, str(p))
        assert r.exit_code == 2, r.output
        assert "job.yaml" in r.output and "error:" in r.output
    assert not (home / "state.db").exists() or Store(home / "state.db").jobs() == []
    assert not (home / "cluster.json").exists()


def test_missing_file_exits_2(tmp_path, home):
    r = run("submit", str(tmp_path / "missing.yaml"))
    assert r.exit_code == 2
    assert "missing.yaml: file not found" in r.output


def test_unknown_command_exits_2(home):
    assert run("frobnicate").exit_code == 2


def test_schema_is_json(home):
    r = run("schema")
    assert r.exit_code == 0
    assert json.loads(r.output)["title"] == "tpu-orchestrator job"


def test_status_exit_codes_follow_the_job(home):
    store = Store(home / "state.db")
    store.create_job("good-1", "good", {"accelerator": "v4-8", "tier": "spot", "workload": {"steps": 5}})
    store.transition("good-1", JobState.PROVISIONING, "x")
    store.transition("good-1", JobState.STARTING, "x")
    store.transition("good-1", JobState.RUNNING, "x")
    store.transition("good-1", JobState.SUCCEEDED, "done")
    store.create_job("bad-1", "bad", {"accelerator": "v4-8", "tier": "spot", "workload": {"steps": 5}})
    store.transition("bad-1", JobState.FAILED, "boom")
    assert run("status", "good-1").exit_code == 0
    r = run("status", "bad", "--events")
    assert r.exit_code == 1 and "FAILED" in r.output and "boom" in r.output
    assert run("status", "nope").exit_code == 2
    listed = json.loads(run("list", "--json").output)
    assert {j["id"]: j["state"] for j in listed} == {"good-1": "SUCCEEDED", "bad-1": "FAILED"}


@pytest.mark.parametrize("content, says", [
    ("not json", "Invalid JSON"),
    ('{"metadata": {}, "data": [1, 0]}', "metadata.gap_seconds"),
    ('{"metadata": {"gap_seconds": 60}, "data": [1, -1]}', "data.1"),
    ('{"metadata": {"gap_seconds": 60}, "data": []}', "data"),
])
def test_plan_with_a_bad_trace_names_the_file_and_field_and_exits_2(tmp_path, home, content, says):
    trace = tmp_path / "trace.json"
    trace.write_text(content)
    r = run("plan", str(EXAMPLES / "plan-1b.yaml"), "--trace", str(trace))
    assert r.exit_code == 2, r.output
    assert str(trace) in r.output and says in r.output and "Traceback" not in r.output
