"""A crash of the whole local cluster: `status` says so at once, and the next `up` resumes the job.

Run through the command line with a state directory of its own, as a user meets it:
every process of the cluster is killed (SIGKILL) while a job trains.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from orchestrator import cluster
from orchestrator.cluster.processes import leftover_nodes
from orchestrator.state.store import Store
from tests.conftest import REPO
from tests.integration.test_local_jobs import tiny_spec


def test_status_after_a_cluster_crash_and_up_resumes_the_job(tmp_path):
    home = cluster.Home(tmp_path / "home").ensure()
    env = {**os.environ, "ORCHESTRATOR_HOME": str(home.root)}

    def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "orchestrator", *args], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=timeout)

    job_file = tmp_path / "job.yaml"
    job_file.write_text(tiny_spec("crashy", "v4-8", tmp_path, steps=40, interval=5).to_yaml())
    try:
        assert cli("up").returncode == 0
        r = cli("submit", str(job_file), "--detach")
        assert r.returncode == 0, r.stderr
        job_id = r.stdout.split()[0]
        store = Store(home.db)
        deadline = time.monotonic() + 300
        # Past step 6 and a checkpoint committed (its folder renamed from the temporary name to its step). The
        # "saved step 5" event comes when the save stops blocking the loop, before the commit: under load step 6
        # and that event came before the commit, and the job rightly resumed from scratch. Any committed step
        # will do: step 5's folder goes once three newer ones are kept, and a fast run left that window (about
        # 14 steps) between two looks here, with the step rows written a moment after the reports.
        while ((last := store.last_step(job_id)) is None or last.step < 6
               or not any(p.name.isdigit() for p in (tmp_path / "ckpt-crashy").glob("*") if p.is_dir())):
            assert time.monotonic() < deadline, store.job(job_id).reason
            time.sleep(0.5)

        # Everything goes at once: the head, its controller, and the slice's host.
        sessions = [cluster.read_cluster(home).pgid] + [p for s in store.slices(live_only=True)
                                                         for p in s.data["pgids"]]
        for sid in sessions:
            cluster.kill_host(home, sid)
        deadline = time.monotonic() + 30
        while any(cluster.group_alive(s) for s in sessions):
            assert time.monotonic() < deadline
            time.sleep(0.2)

        st = cli("status", job_id)
        assert st.returncode == 0
        said = " ".join(st.stdout.split())  # as read: status wraps its lines at 80 columns
        assert "RUNNING" in said  # what the store last knew...
        assert "the local cluster is not running" in said  # ...and that nothing runs it now
        assert "`orchestrator up`" in said and "last committed checkpoint" in said
        listed = cli("list", "--json")
        assert json.loads(listed.stdout)[0]["cluster"] == "gone"

        assert cli("up").returncode == 0  # the new controller finds the job and relaunches it
        deadline = time.monotonic() + 400
        while not store.job(job_id).state.terminal:
            assert time.monotonic() < deadline, store.job(job_id).reason
            time.sleep(1.0)
        assert store.job(job_id).state.value == "SUCCEEDED", store.job(job_id).reason
        assert [m.step for m in store.steps(job_id)] == list(range(40))
        restored = [e.data["restored_step"] for e in store.events(job_id) if e.kind == "restore"]
        assert restored[-1] is not None and restored[-1] >= 5  # resumed from a checkpoint, not from scratch
        # The crash is a disruption like a host loss, and the steps computed again are lost work.
        [d] = [e for e in store.events(job_id) if e.kind == "disruption"]
        assert d.data["kind"] == "infra_lost" and "the cluster went down while the job ran" in d.reason
        assert store.job(job_id).preemptions == 1
        [lost] = [e.data for e in store.events(job_id) if e.kind == "lost_work"]
        assert lost["from_step"] == d.data["step"] + 1 >= 7 and lost["to_step"] == restored[-1]
        assert lost["steps"] == lost["from_step"] - lost["to_step"] >= 0  # none only if it crashed at a save
        from orchestrator.observe.goodput import goodput

        assert goodput(store, job_id).lost_steps == lost["steps"]
        after = cli("status", job_id)
        assert "the local cluster is not running" not in " ".join(after.stdout.split())
    finally:
        try:
            cli("down")
        finally:  # whatever `down` could not end (it timed out, or failed under load): no node outlives the test
            for pid in leftover_nodes(tmp_path):
                os.kill(pid, signal.SIGKILL)
