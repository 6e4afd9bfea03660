"""Errors the controller raises reach the user as themselves, through a real local Ray cluster.

The controller is a Ray actor: an exception it raises is pickled into a `RayTaskError`.
These tests check that a `SpecError` arrives with its problems (not as Ray's
`UnserializableException`), that a resize the job's state does not allow is a
`JobStateError`, and what the command line shows for each: one `error:` line, exit 2.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import ray

from orchestrator import JobSpec, JobState
from orchestrator.domain.spec import LmWorkload
from orchestrator.errors import JobStateError, SpecError, UnknownAcceleratorError
from tests.conftest import REPO

BAD_NAME = ("name", "'Bad/Name' is not a valid job name: use 1 to 40 lowercase letters, digits and dashes, "
                    "starting and ending with a letter or digit")


def bad_spec() -> JobSpec:
    """A spec that skipped validation (as a client of another version might send it)."""
    return JobSpec.model_construct(name="Bad/Name", workload=LmWorkload.model_construct(steps=0))


def test_a_spec_the_controller_refuses_arrives_as_a_spec_error(client):
    before = client.store.jobs()
    with pytest.raises(SpecError) as info:
        client.submit(bad_spec())
    assert info.value.problems == [BAD_NAME, ("workload.steps", "Input should be greater than 0")]
    assert info.value.source == "<spec>"
    assert client.store.jobs() == before  # nothing recorded


def test_ray_itself_carries_the_spec_error(client):
    """Below the client: what `ray.get` raises is a SpecError (Ray's dual class) whose cause has the data."""
    with pytest.raises(ray.exceptions.RayTaskError) as info:
        ray.get(client.controller().submit.remote({"name": "Bad/Name"}, None), timeout=60)
    assert isinstance(info.value, SpecError) and isinstance(info.value.cause, SpecError)
    assert info.value.cause.problems == [BAD_NAME]


def pending_job(client, job_id: str, tmp_path, **workload) -> str:
    """A job the store holds as PENDING but no controller runs: resizable by no one."""
    spec = JobSpec.from_dict({"name": "waiting", "accelerator": "v4-8",
                              "workload": {"type": "lm", "steps": 5, "seq_len": 32,
                                           "learning_rate": {"warmup_steps": 2}, **workload},
                              "checkpoint": {"directory": str(tmp_path / job_id)}})
    client.store.create_job(job_id, spec.name, spec.model_dump(mode="json"))
    return job_id


def test_resize_of_a_job_that_is_not_running_is_a_job_state_error(client, tmp_path):
    job_id = pending_job(client, "waiting-aaa111", tmp_path)
    with pytest.raises(JobStateError) as info:
        client.resize(job_id, "v4-16", reason="test")
    e = info.value
    assert (e.job_id, e.state, e.action, e.allowed) == (job_id, "PENDING", "resized", ("RUNNING",))
    assert str(e) == f"job {job_id} is PENDING; only a RUNNING job can be resized"
    assert [ev.kind for ev in client.store.events(job_id)] == ["state"]  # no resize recorded


def test_resize_to_a_slice_the_job_does_not_fit_is_a_spec_error(client, tmp_path):
    job_id = pending_job(client, "waiting-bbb222", tmp_path, global_batch_size=4)
    with pytest.raises(SpecError) as info:
        client.resize(job_id, "v4-16")
    assert info.value.problems == [("workload.global_batch_size", "global_batch_size=4 is not divisible by "
                                    "data*fsdp=8 (accelerator v4-16 has 8 devices)")]


def test_resize_to_an_unknown_type_is_refused_before_the_controller(client, tmp_path):
    job_id = pending_job(client, "waiting-ccc333", tmp_path)
    with pytest.raises(UnknownAcceleratorError) as info:
        client.resize(job_id, "v9-999")
    assert info.value.name == "v9-999" and "v4-8" in info.value.valid


def cli(*args: str, home) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator.user.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "ORCHESTRATOR_HOME": str(home)})


def test_the_command_line_shows_one_line_for_each_refusal(client, session_home, tmp_path):
    waiting = pending_job(client, "waiting-ddd444", tmp_path)
    small = pending_job(client, "waiting-eee555", tmp_path, global_batch_size=4)
    r = cli("resize", waiting, "v4-16", home=session_home)
    assert (r.returncode, r.stderr) == (2, f"error: job {waiting} is PENDING; only a RUNNING job can be resized\n")
    r = cli("resize", small, "v4-16", home=session_home)
    assert (r.returncode, r.stderr) == (2, f"error: resize of {small} to v4-16: workload.global_batch_size: "
                                           "global_batch_size=4 is not divisible by data*fsdp=8 (accelerator "
                                           "v4-16 has 8 devices)\n")
    assert client.store.job(waiting).state is JobState.PENDING and client.store.job(small).state is JobState.PENDING
