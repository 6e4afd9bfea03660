"""Errors survive pickling (how they cross Ray from the controller) with their message and fields."""

from __future__ import annotations

import inspect
import os
import pickle

import pytest

from orchestrator import errors
from orchestrator.errors import (
    ClusterError,
    IllegalTransitionError,
    JobNotFoundError,
    JobStateError,
    OrchestratorError,
    OutputFileError,
    ProvisioningError,
    RequestError,
    SpecError,
    UnknownAcceleratorError,
)
from orchestrator.observe.report import write_atomically
from orchestrator.observe.report_series import NoStepsError
from orchestrator.providers.gcp import CloudApiError, NoCapacityError

EXAMPLES = [
    OrchestratorError("something went wrong"),
    RequestError("cannot do that"),
    SpecError("job.yaml", [("name", "'A' is not a valid job name"), ("", "file not found")]),
    UnknownAcceleratorError("v9-999", ["v4-8", "v4-16"]),
    JobNotFoundError("tiny-abc123"),
    JobStateError("tiny-abc123", "SUCCEEDED", "resized", ("RUNNING",)),
    OutputFileError("/tmp/x/r.html", "the folder /tmp/x does not exist"),
    IllegalTransitionError("job", "tiny-abc123", "SUCCEEDED", "RUNNING"),
    ClusterError("cannot reach the Ray cluster at 127.0.0.1:6379"),
    ProvisioningError("slice s1 did not start", slice_name="s1", transient=True),
    NoStepsError("tiny-abc123"),
    errors.ProfileError("--steps must be 1 to 100, got 0"),
    errors.CaptureError("no host began capture 20261125-120130-ab12 within 300 s"),
    CloudApiError(action="create", project="p", zone="us-central2-b", code=429, reason="RATE", message="slow down",
                  transient=True, slice_name="s1"),
    NoCapacityError("s1", ["us-central2-b", "europe-west4-a"], "no v4-32 free"),
    errors.CheckpointFolderError("gs://b/ckpt", "cannot be read: Forbidden"),
    errors.FolderInUseError("/ckpt/tiny", "tiny-abc123", "RUNNING"),
    errors.StoreFaultError("/home/u/.tpu-orchestrator/state.db", "disk full", "database or disk is full"),
    errors.FolderMismatchError("/ckpt/tiny", "holds checkpoints up to step 300 of job tiny-abc123, trained with other "
                               "settings", differences=[("workload.seed", 0, 1)], last_step=300, owner="tiny-abc123"),
]


def test_every_error_class_of_the_errors_module_has_an_example():
    defined = {cls for _, cls in inspect.getmembers(errors, inspect.isclass)
               if issubclass(cls, OrchestratorError) and cls.__module__ == errors.__name__}
    assert defined - {type(e) for e in EXAMPLES} == set()


@pytest.mark.parametrize("error", EXAMPLES, ids=lambda e: type(e).__name__)
def test_pickle_round_trip_keeps_the_message_and_fields(error):
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error)
    assert (str(copy), copy.args, vars(copy)) == (str(error), error.args, vars(error))


def test_a_spec_error_raised_in_a_ray_task_arrives_with_its_problems():
    """Ray pickles the task's exception inside a RayTaskError; the client unwraps `.cause`."""
    import ray.cloudpickle
    from ray.exceptions import RayTaskError

    error = SpecError("<spec>", [("name", "'A' is not a valid job name"), ("workload.steps", "too many")])
    wrapped = RayTaskError("Controller.submit", "Traceback (most recent call last): ...", error,
                           proctitle="ray::Controller.submit", pid=1, ip="127.0.0.1")
    arrived = ray.cloudpickle.loads(ray.cloudpickle.dumps(wrapped.as_instanceof_cause()))
    assert isinstance(arrived, SpecError) and isinstance(arrived.cause, SpecError)
    assert arrived.cause.problems == error.problems and str(arrived.cause) == str(error)


def test_request_errors_are_the_ones_to_fix_in_the_request():
    request = {type(e) for e in EXAMPLES if isinstance(e, RequestError)}
    assert request == {RequestError, SpecError, UnknownAcceleratorError, JobNotFoundError, JobStateError,
                       OutputFileError, NoStepsError, errors.ProfileError, errors.CheckpointFolderError,
                       errors.FolderInUseError, errors.FolderMismatchError}


def test_a_failed_write_leaves_the_old_file_and_no_temporary_file(tmp_path, monkeypatch):
    out = tmp_path / "r.html"
    out.write_text("old")

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(OutputFileError) as info:
        write_atomically(out, b"new")
    assert str(info.value) == f"{out}: cannot write the file: No space left on device"
    assert out.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["r.html"]


def test_a_write_replaces_the_file_whole(tmp_path):
    out = tmp_path / "r.png"
    out.write_bytes(b"old")
    write_atomically(out, b"new picture")
    assert out.read_bytes() == b"new picture" and [p.name for p in tmp_path.iterdir()] == ["r.png"]
