"""A VM that goes silent (powered off with no reset: `EmulatedVm.silence`) is seen lost in seconds by the
hosts' beats and a probe of its node (`orchestrator.control.liveness`), not after Ray's health check.

On share-nothing VMs of the TPU API emulator: a one-slice job gets a new slice and restores from the
bucket; a two-slice job goes on on the survivors from their memory, losing no step; a job adopted by a
restarted controller is watched by the new controller's monitor. Each run also checks the rule's other
side on this loaded machine: no host is declared lost before the kill (one disruption in all).
"""

from __future__ import annotations

import time

import pytest
import ray

from orchestrator import JobState
from tests.chaos.test_faults import kinds
from tests.integration.test_local_jobs import tiny_spec
from tests.integration.test_share_nothing import emulated_vms
from tests.storage_fixture import unique_folder
from tests.waiting import wait_for, wait_step
from workers import storage

DETECT_WITHIN_S = 5.0  # Ray's health check took 13.6-16 s here; the beats' rule 1-2 s after the last beat


@pytest.fixture
def vms(client):
    with emulated_vms(client) as world:
        yield world


def silence_host_1(client, backing, job) -> float:
    """Host 1 of the job's first slice powered off silently; when (wall clock)."""
    live = sorted(client.store.slices(job_id=job.id, live_only=True), key=lambda r: r.name)
    at = time.time()
    backing.power_off(live[0].name, 1, silent=True)
    return at


def detection(job, killed: float):
    """Once the silent host is seen lost: its disruption, and how long after `killed` it came."""
    wait_for(lambda: any(e.at >= killed for e in kinds(job, "disruption")) or job.status().done, 60,
             "the silent host to be seen lost")
    disruption = next(e for e in kinds(job, "disruption") if e.at >= killed)
    return disruption, disruption.at - killed


def finished_after_that_loss_alone(job) -> None:
    """The job succeeds, and the silent host was its only disruption (no false loss before it)."""
    st = job.wait(timeout_s=600)
    assert st.state is JobState.SUCCEEDED, (st.reason, job.logs()[-3000:])
    assert [d.data["kind"] for d in kinds(job, "disruption")] == ["infra_lost"]  # no false loss before it


def test_a_silent_vm_of_a_one_slice_job_is_seen_in_seconds_and_the_job_goes_on_on_a_new_slice(
        client, tmp_path, vms, request, gcs_emulator):
    _, gcp, backing = vms
    spec = tiny_spec("silent-one", "v4-16", tmp_path, steps=16, provider="gcp", gcp=gcp,
                     checkpoint={"interval_steps": 4, "directory": unique_folder(request)},
                     storage={"endpoint": gcs_emulator.url}, recovery={"start_timeout_s": 180})
    job = client.submit(spec)
    wait_step(job, 6)
    # Step 4 committed in the bucket (its folder's commit_success.txt, written last): the "saved step 4" event
    # comes when the save stops blocking the loop, and a bucket commits seconds later.
    committed = storage.join(spec.checkpoint.directory, "4", "commit_success.txt")
    wait_for(lambda: storage.exists(committed, endpoint=gcs_emulator.url), 120, "step 4 committed in the bucket")
    killed = silence_host_1(client, backing, job)
    disruption, seen_after = detection(job, killed)
    print(f"one slice: a silent VM seen lost {seen_after:.2f} s after it went: {disruption.reason}")
    assert "no beat for" in disruption.reason and disruption.data["kind"] == "infra_lost", disruption.reason
    assert seen_after < DETECT_WITHIN_S
    finished_after_that_loss_alone(job)
    assert len(kinds(job, "launched")) == 2
    restored = [e.data["restored_step"] for e in kinds(job, "restore")]
    assert restored[-1] is not None and restored[-1] >= 4  # from the bucket's last committed step
    assert [m.step for m in job.metrics()][-1] == 15


def test_a_silent_vm_of_a_two_slice_job_is_seen_in_seconds_and_the_survivors_go_on_from_memory(
        client, tmp_path, vms, request, gcs_emulator):
    _, gcp, backing = vms
    # A copy in memory every step, whatever it costs: the cadence measured from the first copies depends on
    # the machine's load (a CI run measured 6.7% of a step, so every 4 steps, and lost 2), and this test is
    # about the loss being seen and the survivors going on from what they hold, not about the cadence.
    spec = tiny_spec("silent-two", "v4-16", tmp_path, steps=16, provider="gcp", gcp=gcp, slices=2,
                     checkpoint={"interval_steps": 4, "memory_interval_steps": 1, "directory": unique_folder(request)},
                     storage={"endpoint": gcs_emulator.url}, recovery={"start_timeout_s": 180, "regrow": False})
    job = client.submit(spec)
    wait_step(job, 6)
    killed = silence_host_1(client, backing, job)
    disruption, seen_after = detection(job, killed)
    print(f"two slices: a silent VM seen lost {seen_after:.2f} s after it went: {disruption.reason}")
    assert "no beat for" in disruption.reason and disruption.data["kind"] == "infra_lost", disruption.reason
    assert seen_after < DETECT_WITHIN_S
    finished_after_that_loss_alone(job)
    restore = [e for e in kinds(job, "restore") if e.at >= killed]
    assert restore and restore[0].data.get("source") == "memory", [e.reason for e in kinds(job, "restore")]
    assert kinds(job, "lost_work")[-1].data["steps"] == 0
    resumed = [e for e in kinds(job, "resumed") if e.at >= killed]
    print(f"two slices: kill to next step {resumed[0].at - killed:.2f} s")


def test_a_silent_vm_after_the_controller_restarted_is_seen_in_seconds_by_the_new_one(
        client, tmp_path, vms, request, gcs_emulator):
    """The new controller adopts the running workers and points their beats at its own monitor."""
    _, gcp, backing = vms
    spec = tiny_spec("silent-adopted", "v4-16", tmp_path, steps=24, provider="gcp", gcp=gcp,
                     checkpoint={"interval_steps": 4, "directory": unique_folder(request)},
                     storage={"endpoint": gcs_emulator.url}, recovery={"start_timeout_s": 180})
    job = client.submit(spec)
    wait_step(job, 4)
    ray.kill(client.controller(), no_restart=False)  # Ray restarts it; the new one adopts the slice
    wait_for(lambda: any("adopted" in e.reason for e in job.events()) or job.status().done, 120,
             "the new controller to adopt the workers")
    at = job.status().step
    wait_for(lambda: job.status().step >= at + 2 or job.status().done, 120, "two steps after the adoption")
    assert not job.status().done, job.status().reason
    killed = silence_host_1(client, backing, job)
    disruption, seen_after = detection(job, killed)
    print(f"adopted: a silent VM seen lost {seen_after:.2f} s after it went: {disruption.reason}")
    assert "no beat for" in disruption.reason and seen_after < DETECT_WITHIN_S
    finished_after_that_loss_alone(job)
