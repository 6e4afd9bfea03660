"""The CLI as a user sees it: output and exit codes (0 ok, 1 job failed, 2 bad input)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from orchestrator.state.states import JobState
from orchestrator.state.store import Store
from orchestrator.user.cli import app

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"


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
    store.create_job("good-1", "good", {"name": "good", "accelerator": "v4-8", "workload": {"type": "lm", "steps": 5}})
    store.transition("good-1", JobState.PROVISIONING, "x")
    store.transition("good-1", JobState.STARTING, "x")
    store.transition("good-1", JobState.RUNNING, "x")
    store.transition("good-1", JobState.SUCCEEDED, "done")
    store.create_job("bad-1", "bad", {"name": "bad", "accelerator": "v4-8", "workload": {"type": "lm", "steps": 5}})
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


# -- errors: one `error:` line each, the right exit code, nothing left behind ---------------------


def error_lines(r) -> list[str]:
    assert "Traceback" not in r.output, r.output
    return [line for line in r.stderr.splitlines() if line]


def tiny_job(store: Store, job_id: str, *states: JobState) -> str:
    store.create_job(job_id, job_id.rsplit("-", 1)[0], {"name": "tiny", "accelerator": "v4-8", "tier": "spot"})
    for state in states:
        store.transition(job_id, state, "test")
    return job_id


RUNNING = (JobState.PROVISIONING, JobState.STARTING, JobState.RUNNING)


def test_resize_to_an_unknown_type_is_one_line_and_asks_no_cluster(home):
    job = tiny_job(Store(home / "state.db"), "tiny-abc123", *RUNNING)
    r = run("resize", job, "v9-999")
    assert r.exit_code == 2
    assert error_lines(r) == ["error: unknown accelerator 'v9-999'; valid types are: v4-8, v4-16, v4-32, v4-64, "
                              "v4-128, v5litepod-1, v5litepod-4, v5litepod-8, v5litepod-16, v5litepod-32, "
                              "v5litepod-64, v5p-8, v5p-16, v5p-32, v5p-64, v5p-128, v6e-1, v6e-4, v6e-8, v6e-16, "
                              "v6e-32, v6e-64"]
    assert not (home / "cluster.json").exists()  # no cluster was started to be asked
    assert [e.kind for e in Store(home / "state.db").events(job)] == ["state"] * 4  # no resize recorded


def test_resize_of_an_ended_or_unknown_job_is_one_line(home):
    job = tiny_job(Store(home / "state.db"), "tiny-abc123", *RUNNING, JobState.SUCCEEDED)
    r = run("resize", "tiny", "v4-16")
    assert (r.exit_code, error_lines(r)) == (2, [f"error: job {job} is SUCCEEDED; only a RUNNING job can be resized"])
    r = run("resize", "nope", "v4-16")
    assert (r.exit_code, error_lines(r)) == (2, ["error: no job 'nope'"])
    assert not (home / "cluster.json").exists()


@pytest.mark.parametrize("command", [("status",), ("logs",), ("cancel",), ("report", "-o", "r.html")])
def test_an_unknown_job_is_one_line_exit_2(home, command):
    r = run(command[0], "nope", *command[1:])
    assert (r.exit_code, error_lines(r)) == (2, ["error: no job 'nope'"])


def test_job_prefixes_match_underscores_and_percent_literally(home):
    store = Store(home / "state.db")
    tiny_job(store, "tinyx2h-aaa111")
    tiny_job(store, "tiny_2h-bbb222")
    r = run("status", "tiny_2h", "--json")  # as a LIKE pattern, "_" also matched "tinyx2h-..."
    assert r.exit_code == 0 and json.loads(r.stdout)["id"] == "tiny_2h-bbb222"
    assert json.loads(run("status", "tinyx", "--json").stdout)["id"] == "tinyx2h-aaa111"
    for pattern in ("tin_x", "tiny%", "%", "_"):
        r = run("status", pattern)
        assert (r.exit_code, error_lines(r)) == (2, [f"error: no job '{pattern}'"]), pattern


def test_each_problem_of_a_job_file_is_its_own_error_line(tmp_path, home):
    p = tmp_path / "job.yaml"
    p.write_text("name: A\naccelerator: v9\nworkload: {type: lm, steps: 0, seed: 4294967296}\n")
    r = run("validate", str(p))
    assert r.exit_code == 2
    lines = error_lines(r)
    assert [line.split(": ")[:3] for line in lines] == [
        ["error", str(p), field] for field in ("name", "accelerator", "workload.steps", "workload.seed")]
    assert lines[3].endswith("workload.seed: Input should be less than or equal to 4294967295")


# -- report -o -------------------------------------------------------------------------------------


@pytest.fixture
def reported_job(home) -> str:
    from tests.unit.test_goodput import preempted_job

    return preempted_job(Store(home / "state.db"), "job-p")


def test_report_through_a_symlink_is_refused_and_its_target_untouched(tmp_path, reported_job):
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    link = tmp_path / "link.html"
    link.symlink_to(target)
    r = run("report", reported_job, "-o", str(link))
    assert (r.exit_code, error_lines(r)) == (2, [f"error: {link}: is a symbolic link; give the path of a regular "
                                                 "file (its target is left alone)"])
    assert target.read_text() == "keep me" and link.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home", "link.html", "precious.txt"]


def test_report_into_a_missing_folder_or_onto_a_directory_is_one_line(tmp_path, reported_job):
    missing = tmp_path / "missing_dir" / "x.html"
    r = run("report", reported_job, "-o", str(missing))
    assert (r.exit_code, error_lines(r)) == (2, [f"error: {missing}: the folder {missing.parent} does not exist"])
    assert not missing.parent.exists()
    folder = tmp_path / "out.html"
    folder.mkdir()
    r = run("report", reported_job, "-o", str(folder))
    assert (r.exit_code, error_lines(r)) == (2, [f"error: {folder}: is a directory; give a file name, "
                                                 "e.g. report.html"])
    assert list(folder.iterdir()) == []
    r = run("report", reported_job, "-o", str(tmp_path))
    assert (r.exit_code, error_lines(r)) == (2, [f"error: {tmp_path}: a report's file name must end in .png or "
                                                 ".html"])


def test_report_replaces_a_file_only_with_force_whole_and_leaves_no_temporary_file(tmp_path, reported_job):
    out_file = tmp_path / "r.html"
    out_file.write_text("old report")
    r = run("report", reported_job, "-o", str(out_file))  # as export and data prepare: not without --force
    assert (r.exit_code, error_lines(r)) == (2, [f"error: {out_file}: exists (--force replaces it)"])
    assert out_file.read_text() == "old report"
    r = run("report", reported_job, "-o", str(out_file), "--force")
    assert r.exit_code == 0 and r.stdout == f"wrote {out_file}\n"
    assert out_file.read_text().startswith("<!doctype html>") and out_file.stat().st_mode & 0o777 == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home", "r.html"]


def test_report_of_a_job_without_steps_is_one_line(tmp_path, home):
    job = tiny_job(Store(home / "state.db"), "tiny-abc123")
    r = run("report", job, "-o", str(tmp_path / "r.png"))
    assert (r.exit_code, error_lines(r)) == (2, [f"error: job '{job}' has no recorded steps yet; there is nothing "
                                                 "to plot"])
    assert not (tmp_path / "r.png").exists()


# -- cancel of an ended job; a reader that stops reading ---------------------------------------


@pytest.mark.parametrize("state", [JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED])
def test_cancel_of_an_ended_job_is_one_line_exit_2(home, state):
    store = Store(home / "state.db")
    job = tiny_job(store, "tiny-abc123", *(RUNNING if state is JobState.SUCCEEDED else ()), state)
    r = run("cancel", "tiny")
    assert (r.exit_code, r.stdout) == (2, "")
    assert error_lines(r) == [f"error: job {job} is {state.value}; it has ended: nothing to cancel"]
    assert not store.job(job).cancel_requested and store.job(job).state is state
    assert not (home / "cluster.json").exists()  # no cluster was started to be asked


# -- profile: refused before any cluster is asked ---------------------------------------------------


@pytest.mark.parametrize("states,state", [((JobState.QUEUED,), "QUEUED"), ((*RUNNING, JobState.SUCCEEDED), "SUCCEEDED"),
                                          ((JobState.CANCELLED,), "CANCELLED")])
def test_profile_of_a_job_not_running_is_one_line_exit_2(home, states, state):
    job = tiny_job(Store(home / "state.db"), "tiny-abc123", *states)
    r = run("profile", "tiny")
    assert (r.exit_code, error_lines(r)) == (2, [f"error: job {job} is {state}; only a RUNNING job can be profiled"])
    assert not (home / "cluster.json").exists()


@pytest.mark.parametrize("args,says", [
    (("--steps", "0"), "--steps must be 1 to 100, got 0"), (("--steps", "101"), "--steps must be 1 to 100, got 101"),
    (("--host", "first"), "--host must be all or a host's number, got 'first'"),
    (("--host", "1"), "--host 1: job tiny-abc123 runs on 1 host (0), or use --host all")])
def test_profile_with_bad_steps_or_host_is_one_line_exit_2(home, args, says):
    job = tiny_job(Store(home / "state.db"), "tiny-abc123", *RUNNING)
    r = run("profile", job, *args)
    assert (r.exit_code, error_lines(r)) == (2, [f"error: {says}"])
    assert not (home / "cluster.json").exists()
    assert [e.kind for e in Store(home / "state.db").events(job)] == ["state"] * 4  # nothing asked


# -- submit onto a checkpoint folder that is not the job's --------------------------------------


def test_submit_onto_another_runs_checkpoints_is_one_line_exit_2_and_starts_nothing(tmp_path, home):
    from orchestrator.control.ownership import OnExisting, record_job
    from orchestrator.domain.spec import JobSpec

    job_file = tmp_path / "job.yaml"
    job_file.write_text("name: tiny\nworkload: {type: lm, steps: 300, learning_rate: {peak: 3.0e-3}}\n"
                        "checkpoint: {directory: ckpt}\n")
    store = Store(home / "state.db")
    record_job(store, "tiny-aaaaaa", JobSpec.from_yaml(job_file), OnExisting.CHECK)  # the first run...
    (tmp_path / "ckpt" / "300").mkdir()
    store.transition("tiny-aaaaaa", JobState.CANCELLED, "cancelled by the user")  # ...saved step 300 and ended
    job_file.write_text(job_file.read_text().replace("3.0e-3", "1.0e-3"))
    r = run("submit", str(job_file))
    assert (r.exit_code, r.stdout) == (2, "")
    (line,) = error_lines(r)
    assert line.startswith(f"error: checkpoint folder {tmp_path / 'ckpt'}: holds checkpoints up to step 300 of job "
                           "tiny-aaaaaa, trained with other settings: workload.learning_rate.peak was 0.003, is 0.001.")
    assert "--fresh" in line and "--resume-anyway" in line
    assert [j.id for j in store.jobs()] == ["tiny-aaaaaa"]
    assert not (home / "cluster.json").exists()  # refused before any cluster was started


def test_fresh_and_resume_anyway_together_are_one_line_exit_2(tmp_path, home):
    job_file = tmp_path / "job.yaml"
    job_file.write_text("name: tiny\n")
    r = run("submit", str(job_file), "--fresh", "--resume-anyway")
    assert (r.exit_code, error_lines(r)) == (2, ["error: --fresh and --resume-anyway exclude each other: start "
                                                 "over, or resume"])
    assert not (home / "cluster.json").exists()
