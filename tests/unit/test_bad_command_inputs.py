"""Bad input to every command, as a probe found it: one `error:` line naming the field or file and what is
wrong, exit 2, nothing written, no traceback, no hang, never a wrong exit 0. No cluster is started: each
input is refused before one would be."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from orchestrator.state.store import Store
from orchestrator.user.cli import app

GOOD_JOB = "name: tiny\n"


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("ORCHESTRATOR_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture(autouse=True)
def no_emulator_served(monkeypatch):
    """An emulator command that got past its checks would serve until interrupted: fail instead."""
    import orchestrator.emulator.__main__ as emulator_main

    def serve(argv):
        pytest.fail(f"the emulator was started with {argv}")

    monkeypatch.setattr(emulator_main, "main", serve)


def run(*args) -> tuple[int, str, list[str]]:
    """Exit code, stdout and the lines on stderr (a traceback fails the test)."""
    r = CliRunner().invoke(app, [str(a) for a in args])
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert "Traceback" not in r.output, r.output
    return r.exit_code, r.stdout, [line for line in r.stderr.splitlines() if line]


def closed_port() -> int:
    """A localhost port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def nothing_created(home: Path) -> bool:
    return (not (home / "state.db").exists() or Store(home / "state.db").jobs() == []) and \
        not (home / "cluster.json").exists()


# -- job files: validate and submit ------------------------------------------------------------------


def nested_lists(tmp: Path) -> Path:
    (tmp / "job.yaml").write_text("name: a\nx: " + "[" * 20_000 + "]" * 20_000 + "\n")
    return tmp / "job.yaml"


def nested_maps(tmp: Path) -> Path:
    (tmp / "job.yaml").write_text("name: a\nx: " + "{a: " * 5_000 + "1" + "}" * 5_000 + "\n")
    return tmp / "job.yaml"


def long_seed(tmp: Path) -> Path:
    (tmp / "job.yaml").write_text("name: a\nworkload: {type: lm, seed: " + "9" * 5_000 + "}\n")
    return tmp / "job.yaml"


def symlink_loop(tmp: Path) -> Path:
    (tmp / "a.yaml").symlink_to(tmp / "b.yaml")
    (tmp / "b.yaml").symlink_to(tmp / "a.yaml")
    return tmp / "a.yaml"


def long_name(tmp: Path) -> Path:
    return tmp / ("j" * 295 + ".yaml")


def unix_socket(tmp: Path) -> Path:
    path = tmp / "job.yaml"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))  # closed with the test's process; the file stays
    s.close()
    return path


def fifo(tmp: Path) -> Path:
    os.mkfifo(tmp / "job.yaml")
    return tmp / "job.yaml"


def directory(tmp: Path) -> Path:
    (tmp / "job.yaml").mkdir()
    return tmp / "job.yaml"


def checkpoints_in_proc(tmp: Path) -> Path:
    (tmp / "job.yaml").write_text("name: a\ncheckpoint: {directory: /proc/self/ckpt}\n")
    return tmp / "job.yaml"


JOB_FILES: dict[str, tuple[Callable[[Path], Path], str]] = {  # case -> (the file, what follows "error: FILE: ")
    "20,000 nested lists": (nested_lists, "nested more than 64 levels deep at line 2, column 67; a job file's "
                                          "settings are at most a few levels deep"),
    "5,000 nested maps": (nested_maps, "nested more than 64 levels deep at line 2, column 256; a job file's "
                                       "settings are at most a few levels deep"),
    "a 5,000-digit seed": (long_seed, "workload.seed: an integer of 5,000 characters at line 2; the limit is 100 "
                                      "(no setting needs more than 20)"),
    "a symlink loop": (symlink_loop, "is a loop of symbolic links (or a chain of more than the system follows)"),
    "a 300-character name": (long_name, "cannot read the file: its name is too long for the file system"),
    "a unix socket": (unix_socket, "is a socket, not a regular file; give the job's YAML file"),
    "a FIFO with no writer": (fifo, "is a FIFO (named pipe), not a regular file; give the job's YAML file"),
    "a directory": (directory, "is a directory, not a regular file; give the job's YAML file"),
    "checkpoints under /proc/self": (checkpoints_in_proc, "checkpoint.directory: '/proc/self/ckpt' is in /proc, "
                                                          "the kernel's view of processes, not a place for files; "
                                                          "use a folder on a disk"),
}


@pytest.mark.parametrize("command", ["validate", "submit"])
@pytest.mark.parametrize("case", list(JOB_FILES))
def test_a_bad_job_file_is_one_line_exit_2(tmp_path, home, case, command):
    make, says = JOB_FILES[case]
    path = make(tmp_path)
    unblock = threading.Timer(10, _open_for_writing, [path])  # a reader blocked on a FIFO gets its EOF: no hang
    unblock.start()
    started = time.monotonic()
    try:
        code, stdout, lines = run(command, path)
    finally:
        unblock.cancel()
    assert (code, stdout, lines) == (2, "", [f"error: {path}: {says}"])
    assert time.monotonic() - started < 10
    assert nothing_created(home)


def _open_for_writing(path: Path) -> None:
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:  # not a FIFO, or no reader: nothing blocks
        pass


def test_a_relative_workdir_is_taken_from_the_job_files_folder(tmp_path, home):
    """As README and the spec say of a job file's paths (checkpoint.directory, data, trace): documented, exit 0."""
    from orchestrator.domain.spec import JobSpec

    (tmp_path / "jobs").mkdir()
    path = tmp_path / "jobs" / "job.yaml"
    path.write_text("name: a\nworkdir: code\n")
    assert run("validate", path)[0] == 0
    assert JobSpec.from_yaml(path).workdir == str(tmp_path / "jobs" / "code")


# -- command arguments -----------------------------------------------------------------------------------

DEADLINE = "--deadline-hours must be a deadline from one minute to 90 days (0.0167 to 2160 hours), got {} hours"
OPTIONS: dict[str, tuple[tuple[str, ...], str]] = {  # case -> (arguments, the error line); {tmp}: tmp_path
    "plan --deadline-hours nan": (("plan", "{job}", "--deadline-hours", "nan"), DEADLINE.format("nan")),
    "plan --deadline-hours inf": (("plan", "{job}", "--deadline-hours", "inf"), DEADLINE.format("inf")),
    "plan --deadline-hours -1": (("plan", "{job}", "--deadline-hours", "-1"), DEADLINE.format("-1")),
    "plan --deadline-hours 0": (("plan", "{job}", "--deadline-hours", "0"), DEADLINE.format("0")),
    "plan --deadline-hours 1e-9": (("plan", "{job}", "--deadline-hours", "1e-9"), DEADLINE.format("1e-09")),
    "emulator --port -1": (("emulator", "--port", "-1"), "--port must be 0 to 65535 (0 picks a free port), got -1"),
    "emulator --port 70000": (("emulator", "--port", "70000"),
                              "--port must be 0 to 65535 (0 picks a free port), got 70000"),
    "emulator --time-scale nan": (("emulator", "--time-scale", "nan"),
                                  "--time-scale must be above 0 and at most 100, got nan"),
    "gc --endpoint ''": (("gc", "--project", "p", "--zone", "us-central2-b", "--endpoint", ""),
                         "--endpoint must be an http:// or https:// URL like http://127.0.0.1:8471, got ''"),
    "profile --host ²": (("profile", "tiny", "--host", "²"), "--host must be all or a host's number, got '²'"),
    "profile --timeout nan": (("profile", "tiny", "--timeout", "nan"),
                              "--timeout must be a number of seconds above 0, got nan"),
    "export --step -1": (("export", "tiny", "-o", "{tmp}/out", "--step", "-1"),
                         "--step must be a committed step (0 or more), got -1"),
    "export --latest --step 10": (("export", "tiny", "-o", "{tmp}/out", "--latest", "--step", "10"),
                                  "--latest and --step exclude each other: the newest committed step, or step N"),
    "export -o a file": (("export", "tiny", "-o", "{tmp}/file", "--force"),
                         "{tmp}/file: exists and is not a folder (even --force replaces only a folder)"),
    "export -o a line break": (("export", "tiny", "-o", "{tmp}/a\nb"),
                               "'{tmp}/a\\nb': a folder's name must not be empty nor contain line breaks or other "
                               "control characters"),
    "export -o gs://": (("export", "tiny", "-o", "gs://"), "gs://: names no bucket; give gs://BUCKET/FOLDER"),
    "export -o gs:///x": (("export", "tiny", "-o", "gs:///x"), "gs:///x: names no bucket; give gs://BUCKET/FOLDER"),
    "export -o /proc/self/x": (("export", "tiny", "-o", "/proc/self/x"),
                               "/proc/self/x: is in /proc, the kernel's view of processes, not a place for files; "
                               "use a folder on a disk"),
    "data prepare -o /proc/self/x": (("data", "prepare", "{tmp}/src", "-o", "/proc/self/x"),
                                     "/proc/self/x: is in /proc, the kernel's view of processes, not a place for "
                                     "files; use a folder on a disk"),
    "data prepare -o gs://": (("data", "prepare", "{tmp}/src", "-o", "gs://"),
                              "gs://: names no bucket; give gs://BUCKET/FOLDER"),
    "data prepare -o a bucket's root": (("data", "prepare", "{tmp}/src", "-o", "gs://my-bucket"),
                                        "gs://my-bucket: names no folder in the bucket; give gs://my-bucket/FOLDER "
                                        "(a bucket's root is not written over)"),
}


@pytest.mark.parametrize("case", list(OPTIONS))
def test_a_bad_option_is_one_line_exit_2_before_anything_is_asked(tmp_path, home, case):
    args, says = OPTIONS[case]
    (tmp_path / "job.yaml").write_text(GOOD_JOB)
    (tmp_path / "file").write_text("keep me")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("some text\n")
    fill = {"tmp": str(tmp_path), "job": str(tmp_path / "job.yaml")}
    before = sorted(p.name for p in tmp_path.iterdir())
    code, stdout, lines = run(*(a.format(**fill) for a in args))
    assert (code, stdout, lines) == (2, "", ["error: " + says.format(**fill)])
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no state directory, no output
    assert (tmp_path / "file").read_text() == "keep me"


def test_data_prepare_to_a_bucket_with_nothing_listening_fails_in_seconds(tmp_path, home, monkeypatch):
    port = closed_port()
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("some text\n")
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{port}")
    started = time.monotonic()
    code, stdout, lines = run("data", "prepare", tmp_path / "src", "-o", "gs://tokens-bucket/tiny")
    took = time.monotonic() - started
    assert (code, stdout, len(lines)) == (2, "", 1)
    assert lines[0].startswith(f"error: gs://tokens-bucket/tiny: cannot reach the Cloud Storage endpoint "
                               f"http://127.0.0.1:{port}: Connection refused (3 tries in "), lines[0]
    assert took < 10, took  # gcsfs's own retries took 108 s


def test_export_to_a_bucket_with_nothing_listening_fails_in_seconds(tmp_path, home):
    port = closed_port()
    Store(home / "state.db").create_job("tiny-abc123", "tiny", {
        "name": "tiny", "accelerator": "v4-8", "tier": "spot", "checkpoint": {"directory": str(tmp_path / "ckpt")},
        "storage": {"endpoint": f"http://127.0.0.1:{port}"}})
    started = time.monotonic()
    code, stdout, lines = run("export", "tiny", "-o", "gs://weights-bucket/tiny", "--latest")
    assert (code, stdout, len(lines)) == (2, "", 1)
    assert lines[0].startswith(f"error: gs://weights-bucket/tiny: cannot reach the Cloud Storage endpoint "
                               f"http://127.0.0.1:{port}: Connection refused"), lines[0]
    assert time.monotonic() - started < 10


def test_report_among_the_devices_is_refused(tmp_path, home):
    from tests.unit.test_goodput import preempted_job

    job = preempted_job(Store(home / "state.db"), "job-p")
    there = Path("/dev/full.png").exists()  # as root, /dev took the file
    code, stdout, lines = run("report", job, "-o", "/dev/full.png")
    assert (code, stdout, lines) == (2, "", ["error: /dev/full.png: is in /dev, device files, not a place for files; "
                                             "use a folder on a disk"])
    assert Path("/dev/full.png").exists() == there
