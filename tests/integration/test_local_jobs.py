"""Jobs end to end on a real local Ray cluster: one host (issue: foundation) and several (multi-host).

Every test here runs real Ray nodes, real multi-process JAX over gloo and real orbax
checkpoints on disk, through the same controller users run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray

from orchestrator import JobSpec, JobState
from orchestrator.state.states import SliceState
from tests.conftest import REPO, assert_losses_close, start_reference
from tests.waiting import wait_step

TINY_MODEL = {"d_model": 64, "n_layers": 1, "n_heads": 4, "d_ff": 128}


def tiny_spec(name: str, accelerator: str, tmp_path: Path, *, steps: int = 8, interval: int = 4, **extra) -> JobSpec:
    data = {"name": name, "accelerator": accelerator,
            "workload": {"type": "lm", "steps": steps, "global_batch_size": 16, "seq_len": 32, "model": TINY_MODEL,
                         "learning_rate": {"warmup_steps": 2}},
            "checkpoint": {"interval_steps": interval, "directory": str(tmp_path / f"ckpt-{name}")},
            "recovery": {"start_timeout_s": 120}}
    data.update(extra)
    return JobSpec.from_dict(data)


def losses(job) -> list[float]:
    return [m.loss for m in job.metrics()]


def launched_nodes(job) -> list[str]:
    return [e.data["nodes"] for e in job.events() if e.kind == "launched"][-1]


@pytest.fixture
def busy_cores():
    """Two processes spinning at 100% beside the test (one per core of a 2-core machine), always ended."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        yield spinners
    finally:
        for p in spinners:
            p.kill()
            p.wait()


def test_example_job_from_the_cli(tmp_path, busy_cores):
    """`orchestrator submit examples/tiny-lm.yaml` as a new user runs it: a fresh state dir, its own cluster,
    with both cores busy (issue 40: the embedded cluster gave up under load)."""
    home = tmp_path / "home"
    env = {**os.environ, "ORCHESTRATOR_HOME": str(home)}
    cli = [sys.executable, "-m", "orchestrator.user.cli"]
    try:
        r = subprocess.run([*cli, "submit", "examples/tiny-lm.yaml"], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=600)
        assert all(p.poll() is None for p in busy_cores), "a spinning process ended before the job did"
        assert r.returncode == 0, r.stdout + r.stderr
        job_id = r.stdout.splitlines()[0]
        assert job_id.startswith("tiny-lm-")
        assert f"SUCCEEDED {job_id}: training finished" in r.stdout
        ckpts = sorted(int(p.name) for p in (home / "checkpoints" / "tiny-lm").iterdir() if p.name.isdigit())
        assert ckpts == [50, 75, 100]  # interval 25, keep 3
        from orchestrator.state.store import Store

        steps = Store(home / "state.db").steps(job_id)
        assert len(steps) == 100
        first, last = steps[0].loss, sum(m.loss for m in steps[-5:]) / 5
        assert last < 0.6 * first, f"loss {first:.3f} -> {last:.3f}"
        # The cluster the command started is gone again, and with it every process it started.
        assert not (home / "cluster.json").exists()
        st = subprocess.run([*cli, "status", job_id], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
        assert st.returncode == 0 and "SUCCEEDED" in st.stdout
    finally:  # a failed or timed-out submit may leave its cluster: this home's own, stopped here
        if (home / "cluster.json").exists():
            subprocess.run([*cli, "down"], cwd=REPO, env=env, capture_output=True, timeout=120)


def test_resumed_run_equals_uninterrupted(client, tmp_path):
    """Cancel a job mid-run, resubmit it with the same checkpoint directory: identical per-step losses.

    The cancel checkpoints the step the hosts reached, so the second run restores
    exactly there: nothing was lost, and every step of the first run was recorded.
    """
    # 64 steps of a tiny model: a busy 2-core machine once ran the last 23 of 32 before the cancel landed.
    # The uninterrupted run trains on its own one-host slice beside the first one, not before it.
    reference = client.submit(tiny_spec("ref", "v4-8", tmp_path, steps=64, interval=8))
    spec = tiny_spec("resume", "v4-8", tmp_path, steps=64, interval=8)
    first = client.submit(spec)
    wait_step(first, 9)
    first.cancel()
    assert first.wait(timeout_s=120).state is JobState.CANCELLED
    done_before = len(losses(first))
    assert 9 <= done_before < 64
    second = client.submit(spec)
    assert second.wait(timeout_s=300).state is JobState.SUCCEEDED
    restored = [e.data["restored_step"] for e in second.events() if e.kind == "restore"]
    assert restored == [done_before], (restored, done_before)
    assert reference.wait(timeout_s=300).state is JobState.SUCCEEDED
    combined = losses(first) + [m.loss for m in second.metrics() if m.step >= done_before]
    assert_losses_close(combined, losses(reference), rtol=1e-6)


@pytest.mark.parametrize("accelerator,hosts", [("v4-16", 2), ("v4-32", 4)])
def test_multihost_job_matches_single_process_reference(client, tmp_path, accelerator, hosts):
    spec = tiny_spec(f"mh{hosts}", accelerator, tmp_path, steps=6, interval=3)
    job = client.submit(spec)
    ref = start_reference(spec, devices=spec.tpu_type.chips, tmp_path=tmp_path)  # trains while the slice starts
    st = job.wait(timeout_s=420)
    assert st.state is JobState.SUCCEEDED, (st.reason, job.logs()[-2000:])
    # Every worker ran on its own node, and each node belongs to this job's slice, in worker-id order.
    nodes = launched_nodes(job)
    assert len(set(nodes)) == hosts
    slice_name = next(e.data["slice"] for e in job.events() if e.kind == "launched")
    labels = {n["NodeID"]: n["Labels"] for n in ray.nodes()}
    for rank, node_id in enumerate(nodes):
        assert labels[node_id]["ray.io/tpu-slice-name"] == slice_name
        assert labels[node_id]["ray.io/tpu-worker-id"] == str(rank)
        assert labels[node_id]["ray.io/tpu-pod-type"] == accelerator
    # The slice's nodes are gone once the job ended.
    assert not any(n["Alive"] and n["Labels"].get("ray.io/tpu-slice-name") == slice_name for n in ray.nodes())
    # One orbax checkpoint written by all processes together, and the same losses as one process.
    assert sorted(int(p.name) for p in Path(spec.checkpoint.directory).iterdir() if p.name.isdigit()) == [3, 6]
    assert_losses_close(losses(job), ref.result()["losses"], rtol=1e-5)
    logs = job.logs()
    assert "[host-0]" in logs and "step 6/6" in logs


def test_two_jobs_at_once_keep_to_their_own_slices(client, tmp_path):
    a = client.submit(tiny_spec("job-a", "v4-16", tmp_path, steps=6, interval=3))
    b = client.submit(tiny_spec("job-b", "v4-8", tmp_path, steps=5, interval=5))
    assert a.wait(timeout_s=420).state is JobState.SUCCEEDED
    assert b.wait(timeout_s=420).state is JobState.SUCCEEDED
    assert not set(launched_nodes(a)) & set(launched_nodes(b))
    assert sorted(p.name for p in (tmp_path / "ckpt-job-a").iterdir()) == [".fence", "3", "6", "identity.json"]
    assert sorted(p.name for p in (tmp_path / "ckpt-job-b").iterdir()) == [".fence", "5", "identity.json"]
    assert "step 6/6" in a.logs() and "/5 " not in a.logs()
    assert "step 5/5" in b.logs() and "/6 " not in b.logs()
    assert len(a.metrics()) == 6 and len(b.metrics()) == 5


def test_a_job_whose_folder_another_controller_took_stops_at_its_next_save_and_says_so(client, tmp_path):
    """Two state directories pointed at one checkpoint folder: the other's controller writes the fence with its
    own job as owner (`launch.write_fence`, as its launch does). This job must not train on with no checkpoint."""
    from orchestrator.control.launch import write_fence

    spec = tiny_spec("taken", "v4-8", tmp_path, steps=400, interval=5)
    job = client.submit(spec)
    wait_step(job, 6, timeout_s=300)
    write_fence(spec, generation=1, owner="other-job-1234")  # the other controller's first launch
    st = job.wait(timeout_s=300)
    assert st.state is JobState.FAILED, (st.state, st.reason)
    assert st.cause == "storage", st.cause
    assert "taken by job other-job-1234" in st.reason and "not tried again" in st.reason, st.reason
    assert st.step < 400
    saved = sorted(int(p.name) for p in Path(spec.checkpoint.directory).iterdir() if p.name.isdigit())
    assert saved and max(saved) <= st.step
    assert len([e for e in job.events() if e.kind == "launched"]) == 1  # never tried again


def test_slice_too_big_for_the_provider_fails_clearly(client, tmp_path):
    spec = tiny_spec("huge", "v4-128", tmp_path, workload={"type": "lm", "global_batch_size": 64, "steps": 2,
                                                               "learning_rate": {"warmup_steps": 1}})
    job = client.submit(spec)
    st = job.wait(timeout_s=60)
    assert st.state is JobState.FAILED
    assert st.reason == ("could not provision: local provider: v4-128 needs 16 hosts but this machine is set up "
                         "for at most 8")


def test_workers_that_cannot_all_start_fail_clearly_and_release_the_slice(client, tmp_path):
    ctrl = client.controller()  # the fault is the local provider's, reached inside the controller's actor
    ray.get(ctrl.__ray_call__.remote(lambda c: c.provider.inject_fault("short_host", worker_id=1)))
    try:
        spec = tiny_spec("short", "v4-16", tmp_path, recovery={"start_timeout_s": 20, "max_failures": 0})
        job = client.submit(spec)
        st = job.wait(timeout_s=240)
    finally:
        ray.get(ctrl.__ray_call__.remote(lambda c: c.provider.inject_fault("clear")))
    assert st.state is JobState.FAILED
    assert "could not all be placed within 20 s (each needs 4 TPU chips on its own host)" in st.reason
    slices = client.store.slices(job_id=job.id)
    assert slices and all(s.state is SliceState.RELEASED for s in slices)
    names = {s.name for s in slices}

    def hosts_left() -> list:
        return [n for n in ray.nodes() if n["Alive"] and n["Labels"].get("ray.io/tpu-slice-name") in names]

    deadline = time.monotonic() + 30  # a released host's node goes within seconds; Ray marks it dead after
    while hosts_left() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not hosts_left()
