"""A state store that cannot be written while a job trains, on a real cluster: its disk fills up, or
`state.db` is made read-only.

For the full disk, the state directory is a small file system of its own (tmpfs) and the
cluster is driven through the command line; the job's checkpoints are elsewhere, so only the
store, the logs and the compile cache share the full disk. What the user sees: `status` and
`logs` name the fault while it lasts, a new job is refused with it, the job is not lost, and
once the fault is gone it finishes by itself, every step recorded, with no `down`/`up`.

A deleted store, as processes of their own see it: the commands beside the running cluster say so
and make no empty store, and the documented way back (`down`, `mv state.db.rescued state.db`, `up`)
opens it again.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from orchestrator import JobState
from orchestrator.state.store import Store
from tests.conftest import REPO
from tests.integration.test_local_jobs import tiny_spec
from tests.unit.test_store_faults import fill, make_read_only

STEPS = 150


@pytest.fixture
def small_home(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m,mode=700", "tmpfs", str(home)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        # Mounting needs root (CAP_SYS_ADMIN). CI and this project's machines run as root, so there the test
        # runs; a user without it cannot make the small disk the test is about, and the skip says why.
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    yield home
    subprocess.run(["umount", "-l", str(home)], check=True)


def test_a_full_state_disk_holds_the_job_and_it_finishes_by_itself_once_freed(small_home, tmp_path):
    env = {**os.environ, "ORCHESTRATOR_HOME": str(small_home)}

    def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "orchestrator", *args], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=timeout)

    job_file = tmp_path / "job.yaml"
    job_file.write_text(tiny_spec("full-disk", "v4-8", tmp_path, steps=STEPS, interval=50).to_yaml())
    filler = None
    try:
        assert cli("up").returncode == 0
        r = cli("submit", str(job_file), "--detach")
        assert r.returncode == 0, r.stderr
        job_id = r.stdout.split()[0]
        store = Store(small_home / "state.db")
        deadline = time.monotonic() + 120
        while (last := store.last_step(job_id)) is None or last.step < 2:
            assert time.monotonic() < deadline, store.job(job_id).reason
            time.sleep(0.2)

        filler = fill(small_home)
        deadline = time.monotonic() + 20
        while "state store not writable: disk full" not in (said := " ".join(cli("status", job_id).stdout.split())):
            assert time.monotonic() < deadline, said
            time.sleep(0.5)
        st = cli("status", job_id)
        assert st.returncode == 0 and "RUNNING" in st.stdout  # not failed, not lost: held
        assert "picks up by itself" in " ".join(st.stdout.split())
        logs = cli("logs", job_id)
        assert logs.returncode == 0 and "state store not writable: disk full" in " ".join(logs.stderr.split())
        held_at = store.last_step(job_id).step
        other = tmp_path / "other.yaml"
        other.write_text(tiny_spec("other", "v4-8", tmp_path, steps=4).to_yaml())
        refused = cli("submit", str(other), "--detach")  # a new job is refused with the cause, and no id
        assert refused.returncode == 1 and refused.stdout == "", refused.stdout
        assert "error: state store not writable: disk full" in refused.stderr

        filler.unlink()
        deadline = time.monotonic() + 120
        while not store.job(job_id).state.terminal:
            assert time.monotonic() < deadline, store.job(job_id).reason
            time.sleep(0.5)
        st = cli("status", job_id)
        said = " ".join(st.stdout.split())
        assert st.returncode == 0 and "SUCCEEDED" in said and "not writable" not in said, said
        assert held_at < STEPS - 1  # steps were left when the disk filled...
        assert [m.step for m in store.steps(job_id)] == list(range(STEPS))  # ...and what it did meanwhile is recorded
        [fault] = [e for e in store.events(job_id) if e.kind == "store"]
        assert fault.data["cause"] == "disk full" and fault.data["seconds"] > 0
        assert "state store writable again" in cli("logs", job_id).stdout
    finally:
        if filler is not None and filler.exists():  # a failed check above: `down` needs room to record the ends
            filler.unlink()
        assert cli("down").returncode == 0


def test_a_read_only_state_db_holds_the_job_and_it_finishes_by_itself_once_writable(client, tmp_path):
    job = client.submit(tiny_spec("read-only-db", "v4-8", tmp_path, steps=STEPS, interval=50))
    deadline = time.monotonic() + 120
    while (last := client.store.last_step(job.id)) is None or last.step < 2:
        assert time.monotonic() < deadline, job.status().reason
        time.sleep(0.2)
    make_read_only(client.store.path)
    try:
        deadline = time.monotonic() + 20
        while "state store not writable: read-only" not in (job.status().store_fault or ""):
            assert time.monotonic() < deadline, job.status()
            time.sleep(0.5)
        st = job.status()
        assert st.state is JobState.RUNNING and "picks up by itself" in st.store_fault
        held_at = client.store.last_step(job.id).step
    finally:
        make_read_only(client.store.path, False)
    final = job.wait(timeout_s=120)
    assert final.state is JobState.SUCCEEDED, final.reason
    assert held_at < STEPS - 1 and [m.step for m in job.metrics()] == list(range(STEPS))
    [fault] = [e for e in job.events() if e.kind == "store"]
    assert fault.data["cause"] == "read-only"


def test_the_documented_way_back_from_a_deleted_store_opens_in_other_processes(tmp_path):
    """`down`, `mv state.db.rescued state.db`, `up`: each opens the store in a process of its own while the
    deleted store's write-ahead log is still beside it (the controller held it open). SQLite took that log
    for the new store's, and every open failed with "disk I/O error"; it is set aside now."""
    store = Store(tmp_path / "state.db")
    store.create_job("j1", "j", {})
    store.record_steps("j1", 1, [(0, 2.5, None, None)])
    store.path.unlink()
    store.copy_to(tmp_path / "state.db.rescued")  # what the controller does on seeing it gone
    assert (tmp_path / "state.db-wal").exists()
    opened = ("import sys; from orchestrator.state.store import Store; "
              "print([j.id for j in Store(sys.argv[1]).jobs()])")

    def open_in_a_process() -> str:
        r = subprocess.run([sys.executable, "-c", opened, str(tmp_path / "state.db")], cwd=REPO, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stderr[-2000:]
        return r.stdout.strip()

    assert open_in_a_process() == "[]"  # as `down` opens it: a new, empty store
    assert sorted(p.name.split(".orphaned-")[0] for p in tmp_path.glob("*.orphaned-*")) == ["state.db-shm",
                                                                                           "state.db-wal"]
    assert not list(tmp_path.glob("state.db-wal")), "a store closed with its process leaves no log behind"
    os.replace(tmp_path / "state.db.rescued", tmp_path / "state.db")
    assert open_in_a_process() == "['j1']"  # as `up` opens it: every job back


def test_a_command_beside_a_running_cluster_whose_store_was_deleted_says_so_and_makes_no_empty_store(tmp_path):
    home = tmp_path / "home"
    store = Store(home / "state.db")
    store.create_job("j1", "j", {})
    (home / "cluster.json").write_text("{}")  # a cluster is recorded as running
    store.path.unlink()
    env = {**os.environ, "ORCHESTRATOR_HOME": str(home)}
    for command in (["status", "j1"], ["list"], ["cancel", "j1"]):
        r = subprocess.run([sys.executable, "-m", "orchestrator", *command], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=60)
        said = " ".join(r.stderr.split())
        assert r.returncode == 1, said
        assert "error: state store not writable: deleted" in said and "the running cluster's store is gone" in said
        assert f"mv {home / 'state.db.rescued'} {home / 'state.db'}" in said and "orchestrator up" in said
        assert "Traceback" not in r.stderr
    assert not store.path.exists()  # no empty store took its place
