"""Elastic resize: a job moved 2 hosts -> 4 hosts -> 2 hosts mid-run continues the same loss curve."""

from __future__ import annotations

import time

import ray

from orchestrator import JobState
from tests.conftest import assert_losses_close, start_reference
from tests.integration.test_local_jobs import tiny_spec


def wait_running_at(job, step: int, generation: int = 1) -> None:
    """Until `generation` (its n-th launch) runs past `step`: the old slice may train a few steps more
    before it stops at the agreed step, so a step alone does not say the new slice runs."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        st = job.status()
        launches = sum(1 for e in job.events() if e.kind == "launched")
        if st.state is JobState.RUNNING and st.step >= step and launches >= generation:
            return
        assert not st.done, st.reason
        time.sleep(0.1)
    raise AssertionError(f"job never ran past step {step}")


def test_resize_up_and_down_keeps_the_loss_curve(client, tmp_path):
    spec = tiny_spec("elastic", "v4-16", tmp_path, steps=18, interval=100)  # only resizes checkpoint
    job = client.submit(spec)
    ref = start_reference(spec, devices=8, tmp_path=tmp_path)  # trains while the job waits on its slices
    ctrl = client.controller()
    wait_running_at(job, 5)
    ray.get(ctrl.resize.remote(job.id, "v4-32", "test: more speed"))
    wait_running_at(job, 11, generation=2)
    assert job.record().spec.accelerator == "v4-32"
    ray.get(ctrl.resize.remote(job.id, "v4-16", "test: back down"))
    st = job.wait(timeout_s=600)
    assert st.state is JobState.SUCCEEDED, st.reason
    hosts = [len(e.data["nodes"]) for e in job.events() if e.kind == "launched"]
    assert hosts == [2, 4, 2]
    resizes = [e for e in job.events() if e.to_state == "RESIZING"]
    assert len(resizes) == 2 and st.preemptions == 0
    restored = [e.data["restored_step"] for e in job.events() if e.kind == "restore"]
    assert restored[0] is None and restored[1] >= 5 and restored[2] >= 11
    assert all(e.data["steps"] == 0 for e in job.events() if e.kind == "lost_work")
    assert_losses_close([m.loss for m in job.metrics()], ref.result()["losses"], rtol=1e-5)
