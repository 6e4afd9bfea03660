"""Each way a job's code can end, on a real local cluster: what the user sees (state, cause, reason, counts).

The rules are `policies.decisions.recovery.RULES` (table-tested in tests/unit/test_recovery.py);
here the workers and the controller say what happened, and nothing is guessed from a
timeout when a worker could tell: a program's sys.exit(0) at step 0 is not a hang (it was
taken for one and retried as a preemption for hours), an import error or a full disk is
not retried, and a worker's native abort on a live host is its own outcome with its native
error in status, the events and `orchestrator logs`, spending `max_aborts`, never a preemption.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from orchestrator import JobSpec, JobState
from orchestrator.state.states import FailedBecause

PROGRAMS = Path(__file__).parent / "endings"


def spec(name: str, entrypoint: str, tmp_path: Path, *, steps: int = 6, checkpoint: Path | None = None,
         args: dict | None = None, **recovery) -> JobSpec:
    return JobSpec.from_dict({
        "name": name, "accelerator": "v4-8",
        "workload": {"type": "entrypoint", "entrypoint": entrypoint, "steps": steps, "seq_len": 8,
                     "global_batch_size": 4, "args": args or {}},
        "checkpoint": {"interval_steps": 2, "directory": str(checkpoint or tmp_path / "ckpt")},
        "recovery": {"start_timeout_s": 120, **recovery}})


def run(client, s: JobSpec, timeout_s: float = 300):
    job = client.submit(s, workdir=PROGRAMS)
    return job, job.wait(timeout_s=timeout_s)


def disruptions(job) -> list:
    return [e for e in job.events() if e.kind == "disruption"]


def test_sys_exit_0_at_step_0_ends_the_job_at_once_not_as_a_hang(client, tmp_path):
    t0 = time.monotonic()
    job, st = run(client, spec("exit-zero", "programs:exits_0_at_step_0", tmp_path))  # heartbeat 120 s, 100 preemptions
    assert (st.state, st.cause, st.state_name) == (JobState.FAILED, FailedBecause.USER_EXIT, "FAILED_USER_EXIT")
    assert st.reason == ("host 0: the job's code called sys.exit(0) with 0 of 6 steps done; not tried again: the "
                         "program ended itself with status 0; run again it would do the same")
    assert time.monotonic() - t0 < 100  # not after a heartbeat timeout
    assert (st.preemptions, st.failures) == (0, 1)
    assert [d.data["kind"] for d in disruptions(job)] == ["user_exit"]
    assert len([e for e in job.events() if e.kind == "launched"]) == 1


def test_sys_exit_with_a_status_is_retried_against_max_failures(client, tmp_path):
    job, st = run(client, spec("exit-three", "programs:exits_3", tmp_path, max_failures=1))
    assert (st.state, st.cause) == (JobState.FAILED, FailedBecause.USER_EXIT)
    assert st.reason == ("the job's code exited 2 times (max_failures=1): host 0: the job's code called sys.exit(3) "
                         "with 1 of 6 steps done")
    assert (st.preemptions, st.failures) == (0, 2)
    assert [d.data["kind"] for d in disruptions(job)] == ["user_exit", "user_exit"]


def test_an_import_error_on_the_hosts_is_not_retried(client, tmp_path):
    job, st = run(client, spec("bad-import", "imports_a_missing_package:main", tmp_path))
    assert (st.state, st.cause, st.state_name) == (JobState.FAILED, FailedBecause.SETUP, "FAILED_SETUP")
    assert st.reason == ("host 0: cannot import the entrypoint imports_a_missing_package:main: ModuleNotFoundError: "
                         "No module named 'a_package_no_host_has'; not tried again: every slice would import the "
                         "same code; fix it and submit again")
    assert (st.preemptions, st.failures) == (0, 1) and "Traceback" in st.error
    assert [d.data["kind"] for d in disruptions(job)] == ["import_error"]


@pytest.fixture
def full_disk(tmp_path):
    """A 1 MiB file system for the checkpoints (tmpfs; needs the right to mount)."""
    where = tmp_path / "small-disk"
    where.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)], capture_output=True, text=True)
    if r.returncode != 0:
        # Mounting needs root (CAP_SYS_ADMIN). CI and this project's machines run as root, so there the test
        # runs; a user without it cannot make the small disk the test is about, and the skip says why.
        pytest.skip(f"cannot mount a small file system here: {r.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_full_checkpoint_disk_is_not_taken_for_the_codes_failure(client, tmp_path, full_disk):
    job, st = run(client, spec("full-disk", "programs:big_state", tmp_path, checkpoint=full_disk / "ckpt"))
    assert (st.state, st.cause) == (JobState.FAILED, FailedBecause.STORAGE)
    assert [d.data["kind"] for d in disruptions(job)] == ["storage_failed"]
    assert "No space left on device" in st.reason, st.reason
    assert st.reason.endswith("; not tried again: the disk would refuse again; free space (or point "
                              "checkpoint.directory elsewhere) and submit again: it goes on from the last committed "
                              "step")
    assert (st.preemptions, st.failures) == (0, 1)
    assert len([e for e in job.events() if e.kind == "launched"]) == 1


def test_a_native_abort_on_a_live_host_is_its_own_outcome(client, tmp_path):
    job, st = run(client, spec("abort", "programs:aborts_once", tmp_path, args={"marker": str(tmp_path / "m")}))
    assert st.state is JobState.SUCCEEDED, (st.reason, job.logs()[-3000:])
    [d] = disruptions(job)
    assert d.data["kind"] == "worker_aborted"
    native = "pjrt_client.cc:77] Check failed: buffer != nullptr (0 vs. 1) device buffer gone"
    assert d.reason == f"worker_aborted: host 0's worker process died, its host still up: SIGABRT: {native} " \
                       f"(after step {d.data['step'] + 1})"
    assert (st.preemptions, st.failures) == (0, 0)  # never a preemption; its own budget
    assert native in st.error  # the job's error (status --json, and "last error" if it fails)
    recovering = [e for e in job.events() if e.to_state == "RECOVERING"]
    assert recovering[0].reason.endswith("(abort 1 of at most 2)"), recovering[0].reason
    assert f"[host-0] its worker process died: SIGABRT: {native}" in job.logs()  # orchestrator logs


def test_a_hang_is_a_hang_only_while_every_worker_answers(client, tmp_path):
    job, st = run(client, spec("hang", "programs:hangs_at_step_2", tmp_path, heartbeat_timeout_s=8,
                               max_failures=0))
    assert (st.state, st.cause) == (JobState.FAILED, FailedBecause.USER_CODE)
    assert st.reason == "the job hung 1 time (max_failures=0): no step for 8 s while every worker answers (hung)"
    assert (st.preemptions, st.failures) == (0, 1)
    assert [d.data["kind"] for d in disruptions(job)] == ["hung"]


def test_a_daemon_of_the_jobs_code_ends_with_the_job(client, tmp_path):
    pidfile = tmp_path / "daemon.pid"
    job, st = run(client, spec("daemon", "programs:starts_a_daemon", tmp_path, args={"pidfile": str(pidfile)}))
    assert st.state is JobState.SUCCEEDED, (st.reason, job.logs()[-3000:])
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 20
    while running(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not running(pid), "the daemon outlived its job"


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False
