"""One checkpoint folder belongs to one job identity (`orchestrator.control.ownership`).

Each test submits as `Controller.submit` does (`record_job`) into a real store and a real
folder on disk, and checks what a user sees: the error and its message, the job's state and
events, where the old checkpoints went. Step folders are made as orbax names them; what
orbax writes inside them plays no part in whose folder it is.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from orchestrator.control.ownership import IDENTITY, OnExisting, record_job
from orchestrator.domain.spec import JobSpec
from orchestrator.errors import FolderInUseError, FolderMismatchError, RequestError
from orchestrator.state.events import EventKind
from orchestrator.state.states import JobState
from orchestrator.state.store import Store

TINY = {"d_model": 64, "n_layers": 1, "n_heads": 4, "d_ff": 128}


def spec(folder: Path, *, name: str = "lm", steps: int = 300, peak: float = 3e-3, **workload) -> JobSpec:
    return JobSpec.from_dict({"name": name, "workload": {"type": "lm", "steps": steps, "model": TINY, "seq_len": 32,
                                                         "learning_rate": {"peak": peak}, **workload},
                              "checkpoint": {"directory": str(folder)}})


def trained(store: Store, folder: Path, job_id: str, steps: list[int], **settings) -> None:
    """A job that ran to its end in `folder` and left checkpoints of `steps` there."""
    record_job(store, job_id, spec(folder, **settings), OnExisting.CHECK)
    for step in steps:
        (folder / str(step)).mkdir()
    store.transition(job_id, JobState.FAILED, "its slice went for good")  # ended, whichever way


def folder_event(store: Store, job_id: str):
    (event,) = store.events(job_id, kind=EventKind.FOLDER)
    return event


@pytest.fixture
def store(tmp_path) -> Store:
    return Store(tmp_path / "state.db")


def test_a_resubmit_with_another_learning_rate_is_refused_naming_the_setting(store, tmp_path):
    folder = tmp_path / "ckpt"
    trained(store, folder, "lm-aaaaaa", [100, 200, 300], peak=3e-3)
    with pytest.raises(FolderMismatchError) as refused:
        record_job(store, "lm-bbbbbb", spec(folder, peak=1e-3), OnExisting.CHECK)
    e = refused.value
    assert isinstance(e, RequestError)  # the CLI's exit code 2
    assert e.differences == [("workload.learning_rate.peak", 3e-3, 1e-3)]
    assert (e.last_step, e.owner) == (300, "lm-aaaaaa")
    assert str(e).startswith(f"checkpoint folder {folder}: holds checkpoints up to step 300 of job lm-aaaaaa, "
                             "trained with other settings: workload.learning_rate.peak was 0.003, is 0.001. "
                             "To start over, submit with --fresh")
    assert "To continue from step 300 anyway, --resume-anyway" in str(e)
    assert [j.id for j in store.jobs()] == ["lm-aaaaaa"]  # nothing recorded
    assert json.loads((folder / IDENTITY).read_text())["job"] == "lm-aaaaaa"  # the folder still names its run


def test_each_differing_setting_of_model_optimizer_and_data_is_named(store, tmp_path):
    folder = tmp_path / "ckpt"
    trained(store, folder, "lm-aaaaaa", [8])
    other = {**TINY, "d_model": 128}
    with pytest.raises(FolderMismatchError) as refused:
        record_job(store, "lm-bbbbbb", spec(folder, model=other, seed=7, global_batch_size=8), OnExisting.CHECK)
    assert [d[0] for d in refused.value.differences] == [
        "workload.global_batch_size", "workload.model.d_model", "workload.seed"]
    # What changes how a step runs, not what it computes, is no other run: nor is training longer.
    record_job(store, "lm-cccccc", spec(folder, steps=600, remat="full", precision={"compute": "float32"}),
               OnExisting.CHECK)
    event = folder_event(store, "lm-cccccc")
    assert event.payload.action == "resume" and event.payload.previous_job == "lm-aaaaaa"
    assert event.reason == (f"checkpoint folder {folder}: holds checkpoints up to step 8 of job lm-aaaaaa, the same "
                            "run; resuming")


def test_checkpoints_nobody_recorded_are_refused_unless_resumed_anyway(store, tmp_path):
    folder = tmp_path / "ckpt"
    (folder / "40").mkdir(parents=True)  # written by an older version, or a program run by hand
    with pytest.raises(FolderMismatchError, match="holds checkpoints up to step 40, with no record of the run that "
                                                  "wrote them") as refused:
        record_job(store, "lm-aaaaaa", spec(folder), OnExisting.CHECK)
    assert refused.value.owner is None
    record_job(store, "lm-aaaaaa", spec(folder), OnExisting.RESUME_ANYWAY)
    assert folder_event(store, "lm-aaaaaa").payload.action == "resume-anyway"
    assert json.loads((folder / IDENTITY).read_text())["job"] == "lm-aaaaaa"  # the folder is this run's from now on
    assert (folder / "40").is_dir()


def test_resume_anyway_resumes_and_the_event_keeps_what_differed(store, tmp_path):
    folder = tmp_path / "ckpt"
    trained(store, folder, "lm-aaaaaa", [100], peak=3e-3)
    record_job(store, "lm-bbbbbb", spec(folder, peak=1e-3), OnExisting.RESUME_ANYWAY)
    event = folder_event(store, "lm-bbbbbb")
    assert event.payload.differences == [["workload.learning_rate.peak", 3e-3, 1e-3]]
    assert event.reason.endswith("resuming anyway, as asked")
    assert store.job("lm-bbbbbb").state is JobState.PENDING
    record_job_again = spec(folder, peak=1e-3)  # the folder now names the new settings: no question the next time
    store.transition("lm-bbbbbb", JobState.CANCELLED, "cancelled by the user")
    record_job(store, "lm-cccccc", record_job_again, OnExisting.CHECK)
    assert folder_event(store, "lm-cccccc").payload.action == "resume"


def test_fresh_moves_the_old_run_aside_whole_and_starts_from_step_0(store, tmp_path):
    folder = tmp_path / "ckpt"
    trained(store, folder, "lm-aaaaaa", [100, 200], peak=3e-3)
    (folder / "profiles").mkdir()
    record_job(store, "lm-bbbbbb", spec(folder, peak=1e-3), OnExisting.FRESH, now=1764084600.0)
    aside = tmp_path / "ckpt.replaced-20251125T153000Z"
    event = folder_event(store, "lm-bbbbbb")
    assert (event.payload.action, event.payload.set_aside_to) == ("fresh", str(aside))
    assert event.reason == (f"checkpoint folder {folder}: holds checkpoints up to step 200 of job lm-aaaaaa; moved "
                            f"them aside to {aside} and starting from step 0, as asked")
    assert sorted(p.name for p in aside.iterdir()) == ["100", "200", IDENTITY, "profiles"]
    assert sorted(p.name for p in folder.iterdir()) == [IDENTITY]
    assert json.loads((folder / IDENTITY).read_text())["identity"]["workload.learning_rate.peak"] == 1e-3


def test_a_second_job_on_a_folder_in_use_is_refused_naming_the_job(store, tmp_path):
    folder = tmp_path / "ckpt"
    record_job(store, "lm-aaaaaa", spec(folder), OnExisting.CHECK)
    store.transition("lm-aaaaaa", JobState.QUEUED, "waiting for capacity")
    for mode in OnExisting:  # starting fresh does not take a folder from under a job either
        with pytest.raises(FolderInUseError) as refused:
            record_job(store, "lm-bbbbbb", spec(folder, name="other"), mode)
        assert str(refused.value) == (f"checkpoint folder {folder}: in use by job lm-aaaaaa (QUEUED); one folder takes "
                                      "one job at a time: wait for that job to end or cancel it, or set "
                                      "checkpoint.directory to another folder")
    link = tmp_path / "link"
    link.symlink_to(folder)
    with pytest.raises(FolderInUseError):  # the same folder by another path
        record_job(store, "lm-bbbbbb", spec(link), OnExisting.CHECK)
    store.transition("lm-aaaaaa", JobState.CANCELLED, "cancelled by the user")
    record_job(store, "lm-bbbbbb", spec(folder), OnExisting.CHECK)  # ended: the folder is free
    assert [j.id for j in store.jobs()] == ["lm-aaaaaa", "lm-bbbbbb"]


def test_of_two_submits_at_the_same_moment_exactly_one_gets_the_folder(tmp_path):
    """Two controller threads (each its own connection) submit the same job at once, many times over."""
    store = Store(tmp_path / "state.db")
    for round_ in range(10):
        folder = tmp_path / f"ckpt-{round_}"
        start, outcomes = threading.Barrier(2), {}

        def submit(job_id: str, start=start, folder=folder, outcomes=outcomes) -> None:
            start.wait()
            try:
                record_job(Store(tmp_path / "state.db"), job_id, spec(folder), OnExisting.CHECK)
                outcomes[job_id] = "recorded"
            except FolderInUseError as e:
                outcomes[job_id] = e.other_job

        threads = [threading.Thread(target=submit, args=(f"lm-{round_}{side}",)) for side in "ab"]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        winner = [j for j, o in outcomes.items() if o == "recorded"]
        assert len(winner) == 1, outcomes
        loser = ({f"lm-{round_}a", f"lm-{round_}b"} - set(winner)).pop()
        assert outcomes[loser] == winner[0]  # the refusal names the job that has the folder
        assert [j.id for j in store.jobs() if j.id.startswith(f"lm-{round_}")] == winner
        assert json.loads((folder / IDENTITY).read_text())["job"] == winner[0]


def test_a_store_of_the_previous_version_gains_the_folder_column(tmp_path):
    import sqlite3

    path = tmp_path / "state.db"
    Store(path).create_job("old-aaaaaa", "old", {"checkpoint": {"directory": str(tmp_path / "c")}})
    db = sqlite3.connect(path)
    db.execute("DROP INDEX jobs_folder")
    db.execute("ALTER TABLE jobs DROP COLUMN folder")
    db.execute("UPDATE meta SET value='2' WHERE key='schema_version'")
    db.commit()
    db.close()
    store = Store(path)
    assert store.job("old-aaaaaa").state is JobState.PENDING
    # A job recorded by the previous version claims no folder (its row has no key): known, and rare.
    record_job(store, "lm-aaaaaa", spec(tmp_path / "c"), OnExisting.CHECK)
    assert store.job_using(str(tmp_path / "c")).id == "lm-aaaaaa"


def test_in_a_bucket_the_record_is_kept_and_fresh_moves_the_old_run_aside(store, gcs_emulator, request):
    """The same rules on gs:// (the local Cloud Storage emulator), reached through the spec's endpoint."""
    from tests.storage_fixture import unique_folder
    from workers import storage

    folder, url = unique_folder(request), gcs_emulator.url

    def bucket_spec(peak: float) -> JobSpec:
        return JobSpec.from_dict({**spec(Path("/unused"), peak=peak).model_dump(mode="json"),
                                  "checkpoint": {"directory": folder}, "storage": {"endpoint": url}})

    record_job(store, "lm-aaaaaa", bucket_spec(3e-3), OnExisting.CHECK)
    storage.write_text(f"{folder}/100/commit_success.txt", "", endpoint=url)  # step 100, as orbax commits it there
    store.transition("lm-aaaaaa", JobState.CANCELLED, "cancelled by the user")
    with pytest.raises(FolderMismatchError, match="workload.learning_rate.peak was 0.003, is 0.001"):
        record_job(store, "lm-bbbbbb", bucket_spec(1e-3), OnExisting.CHECK)
    record_job(store, "lm-bbbbbb", bucket_spec(1e-3), OnExisting.FRESH, now=1764084600.0)
    aside = f"{folder}.replaced-20251125T153000Z"
    assert folder_event(store, "lm-bbbbbb").payload.set_aside_to == aside
    assert storage.listdir(aside, endpoint=url) == ["100", IDENTITY]
    assert storage.listdir(folder, endpoint=url) == [IDENTITY]
    assert json.loads(storage.read_text(f"{folder}/{IDENTITY}", endpoint=url))["job"] == "lm-bbbbbb"
