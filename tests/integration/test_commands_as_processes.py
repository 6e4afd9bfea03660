"""The commands run as users run them, each in a process of its own (not the test runner's invoke): what they
print on stdout and stderr, their exit codes, and how they end.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from orchestrator.emulator import ControlClient, ControlError
from orchestrator.state.states import JobState
from orchestrator.state.store import Store
from tests.conftest import REPO
from tests.unit.test_cli import RUNNING, home, tiny_job  # noqa: F401  (home: a fixture)

# -- export of a step the checkpoint does not have: the real command, its whole stderr ------------------

WRITER = """
import sys
import jax
jax.config.update("jax_platforms", "cpu")
import numpy as np
import orbax.checkpoint as ocp
mngr = ocp.CheckpointManager(sys.argv[1], options=ocp.CheckpointManagerOptions(create=True))
mngr.save(3, args=ocp.args.Composite(state=ocp.args.StandardSave({"params": {"w": np.ones(4, np.float32)}}),
                                     meta=ocp.args.JsonSave({"step": 3})))
mngr.wait_until_finished()
mngr.close()
"""


def test_export_of_a_step_not_saved_is_one_line_on_stderr_and_nothing_else(tmp_path, home):
    """Run as users run it: JAX looking for a TPU on a machine with libtpu and none printed a page of warnings."""
    subprocess.run([sys.executable, "-c", WRITER, str(tmp_path / "ckpt")], check=True, timeout=120, cwd=REPO)
    store = Store(home / "state.db")
    store.create_job("tiny-abc123", "tiny", {"name": "tiny", "accelerator": "v4-8", "tier": "spot",
                                             "checkpoint": {"directory": str(tmp_path / "ckpt")}})
    for state in (JobState.PROVISIONING, JobState.STARTING, JobState.RUNNING, JobState.SUCCEEDED):
        store.transition("tiny-abc123", state, "test")
    r = subprocess.run([sys.executable, "-m", "orchestrator.user.cli", "export", "tiny", "-o", str(tmp_path / "out"),
                        "--step", "99999"], cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "ORCHESTRATOR_HOME": str(home)})
    assert (r.returncode, r.stdout, r.stderr) == (2, "", f"error: {tmp_path / 'ckpt'}: has no committed checkpoint "
                                                         "of step 99999; it has 3\n")
    assert not (tmp_path / "out").exists()


# -- the CLI's own output: one error line, and a reader that goes away ------------------------------------


def test_the_installed_command_prints_one_line_and_exits_2(home):
    """Through `main()` in a real process, as a user runs it (not the test runner's invoke)."""
    store = Store(home / "state.db")
    tiny_job(store, "tiny-abc123", *RUNNING)
    r = subprocess.run([sys.executable, "-m", "orchestrator.user.cli", "resize", "tiny", "v9-999"], cwd=REPO,
                       capture_output=True, text=True, timeout=120, env={**os.environ, "ORCHESTRATOR_HOME": str(home)})
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("error: unknown accelerator 'v9-999'; valid types are: v4-8, ")
    assert r.stderr.count("\n") == 1 and "\x1b[" not in r.stderr  # one line, no colour codes in a pipe


def test_a_reader_that_stops_reading_ends_the_command_quietly_exit_0(home):
    """`orchestrator schema | head`: the reader went before the output was written."""
    p = subprocess.Popen([sys.executable, "-m", "orchestrator.user.cli", "schema"], cwd=REPO, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env={**os.environ, "ORCHESTRATOR_HOME": str(home)})
    p.stdout.close()  # before it writes: every write meets a closed pipe
    _, stderr = p.communicate(timeout=120)
    assert (p.returncode, stderr.decode()) == (0, "")
    r = subprocess.run(f"{sys.executable} -m orchestrator.user.cli schema | head -n 2", shell=True, cwd=REPO,
                       capture_output=True, text=True, timeout=120, executable="/bin/bash",
                       env={**os.environ, "ORCHESTRATOR_HOME": str(home)})
    assert (r.stdout, r.stderr) == ('{\n  "$defs": {\n', "")


def test_validate_names_the_field_and_exits_2(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("name: pre\nprovider: gcp\n"
                   "gcp: {project: p, zones: [us-central2-b], bucket: my-bucket, head_address: '127.0.0.1:6379'}\n")
    r = subprocess.run([sys.executable, "-m", "orchestrator.user.cli", "validate", str(job)], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "error:" in r.stderr and "gcp.head_address" in r.stderr and "loopback" in r.stderr


# -- the TPU API emulator's command --------------------------------------------------------------------


@pytest.mark.timeout(60)  # as every emulator test
def test_main_serves_until_interrupted_and_prints_its_token(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    token_file = tmp_path / "token"
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.emulator", "--port", "0", "--log-level", "WARNING",
                             "--control-token-file", str(token_file)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        url = next(w for w in proc.stdout.readline().split() if w.startswith("http"))
        assert url.startswith("http://127.0.0.1:")
        label, _, token = proc.stdout.readline().strip().partition(": ")
        assert label == "control token" and token
        assert ControlClient(url, token=token).state()["queuedResources"] == []
        with pytest.raises(ControlError, match="401"):
            ControlClient(url).state()
        assert token_file.read_text() == token + "\n" and (token_file.stat().st_mode & 0o777) == 0o600
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
