"""A job whose checkpoints are in a bucket (the local GCS emulator) loses a host and resumes from the bucket.

The real controller runs a 2-host v4-16 job of the built-in trainer on the local provider
with ``checkpoint.directory: gs://...`` and ``storage.endpoint`` naming the emulator: the
controller writes the fence there (a generation precondition), the hosts point themselves at
the emulator from the launch order they are handed (nothing in their environment says so), save
with orbax through tensorstore and restore from the bucket after a host is killed. The
per-step losses and final parameters equal an undisturbed run's (1e-5 relative).
"""

from __future__ import annotations

from orchestrator import JobSpec
from orchestrator.cluster import kill_host
from tests.chaos.test_faults import INTERVAL, MODEL, STEPS, assert_same_model, host_pgids, kinds
from tests.conftest import start_reference
from tests.storage_fixture import unique_folder
from tests.waiting import wait_for, wait_step
from workers import fence as fences
from workers import storage


def bucket_spec(name: str, folder: str, endpoint: str) -> JobSpec:
    return JobSpec.from_dict({
        "name": name, "accelerator": "v4-16",
        "workload": {"type": "lm", "steps": STEPS, "global_batch_size": 16, "seq_len": 32, "model": MODEL,
                     "learning_rate": {"warmup_steps": 2}},
        "checkpoint": {"interval_steps": INTERVAL, "keep": 5, "directory": folder},
        "storage": {"endpoint": endpoint},
        "recovery": {"start_timeout_s": 180, "heartbeat_timeout_s": 120}})


def test_a_host_vanishes_and_the_job_resumes_from_the_bucket(client, gcs_emulator, request, tmp_path):
    folder, url = unique_folder(request), gcs_emulator.url
    spec = bucket_spec("bucket-ckpt", folder, url)
    job = client.submit(spec)
    reference = start_reference(spec, devices=8, tmp_path=tmp_path)  # trains while the slice starts
    wait_step(job, 10)
    # Committed: in a bucket a step's folder is there from the save's first object, its marker comes last.
    wait_for(lambda: storage.exists(storage.join(folder, "8", "commit_success.txt"), endpoint=url), 60,
             "checkpoint 8 committed in the bucket")
    first = fences.read_fence(folder, endpoint=url)
    assert (first.generation, first.owner) == (1, job.id)
    kill_host(client.home, host_pgids(client, job)[1])  # the raylet, its agents and the worker, at once
    assert_same_model(job, reference)
    restore = kinds(job, "restore")[-1].data
    assert restore["restored_step"] >= 8 and restore["restored_step"] % INTERVAL == 0 and restore["unreadable"] == []
    fence = fences.read_fence(folder, endpoint=url)
    assert (fence.generation, fence.owner) == (2, job.id)
    steps = [n for n in storage.listdir(folder, endpoint=url) if n.isdigit()]
    assert sorted(map(int, steps))[-1] == STEPS and fences.FENCE in storage.listdir(folder, endpoint=url)
