"""Fault injection on a real local multi-host cluster: every disruption ends in the same model.

Each training test runs a 2-host v4-16 job of the built-in trainer, disrupts it (a
worker killed, a host removed, a corrupt checkpoint), and checks that the job SUCCEEDED
with the expected events, and that its per-step losses and final parameters equal those
of an undisturbed run (1e-5 relative). A save cut short, a preemption notice and the
controller killed are run against a user's own program (`test_user_program`): the
built-in trainer runs on the same training API (`workers.api`), so one run covers both.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from orchestrator import JobSpec, JobState
from orchestrator.cluster import kill_host
from orchestrator.observe.goodput import goodput
from tests.conftest import Reference, assert_losses_close, start_reference
from tests.waiting import wait_for, wait_step

STEPS, INTERVAL = 20, 4
MODEL = {"d_model": 256, "n_layers": 2, "n_heads": 4, "d_ff": 1024}  # big enough that a save takes a while


def chaos_spec(name: str, ckpt_root: Path, **recovery) -> JobSpec:
    return JobSpec.from_dict({
        "name": name, "accelerator": "v4-16",
        "workload": {"type": "lm", "steps": STEPS, "global_batch_size": 16, "seq_len": 32, "model": MODEL,
                     "learning_rate": {"warmup_steps": 2}},
        "checkpoint": {"interval_steps": INTERVAL, "keep": 5, "directory": str(ckpt_root / name)},
        "recovery": {"start_timeout_s": 180, "heartbeat_timeout_s": 120, **recovery}})


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The undisturbed run: the same job trained in one plain process on as many devices.

    That a multi-host job equals such a run (1e-5) when nothing disturbs it is checked by
    `test_multihost_job_matches_single_process_reference`. Started at the module's first test, it
    trains while that test's job waits on its slice; `assert_same_model` reads it.
    """
    tmp = tmp_path_factory.mktemp("ref")
    return start_reference(chaos_spec("chaos-ref", tmp), devices=8, tmp_path=tmp)


def host_pgids(client, job) -> list[int]:
    live = client.store.slices(job_id=job.id, live_only=True)
    assert len(live) == 1, live
    return live[0].data["pgids"]


def assert_same_model(job, reference: Reference) -> None:
    st = job.wait(timeout_s=600)
    assert st.state is JobState.SUCCEEDED, (st.reason, job.logs()[-3000:])
    assert_losses_close([m.loss for m in job.metrics()], reference.result()["losses"], rtol=1e-5)
    got, want = job.record().result["param_sums"], reference.result()["param_sums"]
    assert set(got) == set(want)
    for k in want:
        assert abs(got[k] - want[k]) <= 1e-5 * max(1.0, abs(want[k])), (k, got[k], want[k])


def kinds(job, kind: str) -> list:
    return [e for e in job.events() if e.kind == kind]


def test_sigkill_one_workers_process(client, tmp_path, reference):
    """A worker process that dies on a live host is a worker abort (its own budget), never a host loss."""
    job = client.submit(chaos_spec("kill-worker", tmp_path))
    wait_step(job, 10)
    pid = kinds(job, "launched")[-1].data["pids"][1]
    os.kill(pid, signal.SIGKILL)
    assert_same_model(job, reference)
    assert (job.status().preemptions, job.status().failures) == (0, 0)
    disruption = kinds(job, "disruption")[0]
    assert disruption.data["kind"] == "worker_aborted"
    assert ("host 1's worker process died, its host still up: no native error on its stderr (killed from "
            "outside? SIGKILL, the OOM killer)") in disruption.reason, disruption.reason
    restored = kinds(job, "restore")[-1].data["restored_step"]
    assert restored is not None and restored % INTERVAL == 0 and restored >= 8


@pytest.fixture(scope="module")
def undisturbed(client, tmp_path_factory):
    """The same job run on the cluster with nothing disturbing it: the yardstick for goodput."""
    job = client.submit(chaos_spec("undisturbed", tmp_path_factory.mktemp("undisturbed")))
    st = job.wait(timeout_s=600)
    assert st.state is JobState.SUCCEEDED, st.reason
    return goodput(client.store, job.id)


def test_a_host_vanishes(client, tmp_path, reference, undisturbed):
    job = client.submit(chaos_spec("lose-host", tmp_path))
    wait_step(job, 10)
    killed_at = time.time()
    kill_host(client.home, host_pgids(client, job)[1])  # the raylet, its agents and the worker, at once
    assert_same_model(job, reference)
    d = kinds(job, "disruption")[0]
    assert d.data["kind"] == "infra_lost" and "host 1" in d.reason
    assert d.at - killed_at < 10, f"detected after {d.at - killed_at:.1f} s"
    lost = kinds(job, "lost_work")[0].data
    assert lost["steps"] == lost["from_step"] - lost["to_step"] >= 0
    # Goodput accounting saw it: restore and lost work counted, categories adding up to the wall time,
    # and productive time made of the same steps as the undisturbed run's, each counted once. (Not the
    # same seconds: step times on this shared machine vary by more than 10% from one run to the next.)
    g = goodput(client.store, job.id)
    assert g.restore_s > 0 and g.lost_steps == lost["steps"] and g.preemptions == 1
    assert (g.lost_work_s > 0) == (lost["steps"] > 0) and g.lost_work_s <= lost["seconds"] + 1e-6
    assert sum(g.seconds().values()) == pytest.approx(g.wall_s, rel=0.01)
    assert g.productive_steps == undisturbed.productive_steps == STEPS
    step_s = [m.step_time_s for m in client.store.steps(job.id)]
    assert g.productive_s <= sum(step_s) and g.productive_s >= sum(step_s) - g.runtime_init_s


def test_corrupt_latest_checkpoint_falls_back(client, tmp_path, reference):
    spec = chaos_spec("corrupt", tmp_path)
    ckpt = Path(spec.checkpoint.directory)
    job = client.submit(spec)
    wait_step(job, 10)
    wait_for(lambda: (ckpt / "8").exists(), 60, "checkpoint 8")
    kill_host(client.home, host_pgids(client, job)[0])
    for f in (ckpt / "8").rglob("*"):
        if f.is_file():
            f.write_bytes(b"\0garbage")
    assert_same_model(job, reference)
    restore = kinds(job, "restore")[1]
    assert restore.data["restored_step"] == 4 and restore.data["unreadable"] == [8]
    assert "fell back" in restore.reason


def test_user_code_error_fails_after_the_budget(client, tmp_path):
    spec = JobSpec.from_dict({"name": "broken", "accelerator": "v4-8",
                              "workload": {"type": "entrypoint", "entrypoint": "user_code:broken"},
                              "recovery": {"max_failures": 1}})
    job = client.submit(spec, workdir=Path(__file__).parent)
    st = job.wait(timeout_s=300)
    assert st.state is JobState.FAILED
    assert st.reason == ("the job's code failed 2 times (max_failures=1): host 0: ValueError: bad batch on host 0")
    assert "Traceback" in st.error and "user_code.py" in st.error
    assert len(kinds(job, "launched")) == 2 and st.preemptions == 0
    assert "[host-0] host 0 read its first batch" in job.logs()  # the job's own prints reach its log


def test_more_preemptions_than_the_budget(client, tmp_path):
    job = client.submit(chaos_spec("too-many", tmp_path, max_preemptions=1))
    for _ in range(2):
        wait_step(job, job.status().step + 2)
        seen = len(kinds(job, "disruption"))
        kill_host(client.home, host_pgids(client, job)[1])
        wait_for(lambda seen=seen: len(kinds(job, "disruption")) > seen, 60, "the disruption to be seen")
    st = job.wait(timeout_s=300)
    assert st.state is JobState.FAILED
    assert st.reason.startswith("2 preemptions or host losses, more than max_preemptions=1")
    assert not client.store.slices(job_id=job.id, live_only=True)


def test_sigterm_to_one_worker_of_a_two_host_slice_is_a_notice(client, tmp_path, reference):
    """On a multi-host slice XLA's preemption notifier took SIGTERM over, and a SIGTERM gave no notice:
    now both hear it, and every host stops after the same step, that step's checkpoint committed."""
    job = client.submit(chaos_spec("sigterm", tmp_path))
    wait_step(job, 9)
    os.kill(kinds(job, "launched")[-1].data["pids"][1], signal.SIGTERM)
    wait_for(lambda: kinds(job, "disruption"), 120, "the notice to end the attempt")
    assert_same_model(job, reference)
    [notice] = kinds(job, "notice")
    assert notice.data["rank"] == 1 and "(SIGTERM)" in notice.reason, notice.reason
    d = kinds(job, "disruption")[0]
    assert d.data["kind"] == "preempted" and "preemption notice (host 1: SIGTERM)" in d.reason, d.reason
    step = d.data["step"] + 1  # steps done
    stops = [line for line in job.logs().splitlines() if "stopped after step" in line]
    assert sorted(line.split("]")[0] for line in stops) == ["[host-0", "[host-1"], stops
    assert all(f"stopped after step {step} with its checkpoint committed" in line for line in stops), stops
    assert kinds(job, "restore")[1].data["restored_step"] == step
    assert kinds(job, "lost_work")[0].data["steps"] == 0 and job.status().preemptions == 1
