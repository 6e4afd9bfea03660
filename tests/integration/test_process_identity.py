"""Process ids written down earlier are signalled only while they are still ours.

After a crash or a reboot the ids in state.db and cluster.json can belong to other
programs. These tests record ids of unrelated processes of the test's own (each in a
session of its own, as the tool's nodes are) and check that the real `orchestrator
down` leaves them alive, while a process that carries the cluster's node mark, as every
node the tool starts does, is stopped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from orchestrator import cluster
from orchestrator.state.states import SliceState
from orchestrator.state.store import Store
from tests.conftest import REPO
from tests.waiting import wait_for


@pytest.fixture
def home(tmp_path):
    return cluster.Home(tmp_path / "home").ensure()


def _sleeper(env: dict | None = None) -> subprocess.Popen:
    """A process in a session of its own (its pid is its session id, like a recorded node's)."""
    return subprocess.Popen(["sleep", "300"], start_new_session=True, env={**os.environ, **(env or {})})


def _alive(proc: subprocess.Popen) -> bool:
    return proc.poll() is None


def _down(home: cluster.Home) -> subprocess.CompletedProcess:
    env = {**os.environ, "ORCHESTRATOR_HOME": str(home.root), "RAY_AUTH_MODE": "disabled"}
    return subprocess.run([sys.executable, "-m", "orchestrator", "down"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def _record_slice(home: cluster.Home, pgid: int) -> None:
    store = Store(home.db)
    for state in ("REQUESTED", "PROVISIONING", "READY"):
        store.put_slice("job-1-1", "job-1", "local", "v4-8", "spot", state,
                        {"pgids": [pgid], "hosts": ["slice-job-1-1-w0"]})


def test_down_leaves_a_recorded_slice_alone_when_its_pgid_is_another_programs(home):
    stranger = _sleeper()
    try:
        _record_slice(home, stranger.pid)
        r = _down(home)
        assert r.returncode == 0, r.stderr
        assert "no cluster was running" in r.stdout
        assert f"left process group {stranger.pid} alone" in r.stderr
        time.sleep(0.3)  # time for a signal from `down`, were there one, to end it: the check is that none came
        assert _alive(stranger)
        assert [s.state for s in Store(home.db).slices()] == [SliceState.RELEASED]  # the record is settled all the same
    finally:
        stranger.kill()
        stranger.wait()


def test_a_stale_cluster_record_is_dropped_at_once_and_its_pgid_left_alone(home):
    stranger = _sleeper()
    try:
        home.cluster_file.write_text(json.dumps(
            {"address": "127.0.0.1:1", "pgid": stranger.pid, "dashboard_port": 1, "started_at": 0.0}))
        (home.root / "metrics.json").write_text(json.dumps({"url": "http://127.0.0.1:1/metrics"}))
        r = _down(home)  # before: retried the dead address for over 200 s, then killed this session
        assert r.returncode == 0, r.stderr
        assert "no cluster was running" in r.stdout
        assert not home.cluster_file.exists()
        assert not (home.root / "metrics.json").exists()  # no stale metrics address either
        time.sleep(0.3)  # time for a signal from `down`, were there one, to end it: the check is that none came
        assert _alive(stranger)
    finally:
        stranger.kill()
        stranger.wait()


def test_a_session_that_carries_the_node_mark_is_ours_and_is_stopped(home):
    ours = _sleeper({cluster.MARK_ENV: cluster.node_mark(home)})
    stranger = _sleeper()
    other_home = cluster.Home(home.root.parent / "other").ensure()
    theirs = _sleeper({cluster.MARK_ENV: cluster.node_mark(other_home)})  # another state directory's node
    try:
        assert cluster.session_is_ours(home, ours.pid)
        assert not cluster.session_is_ours(home, stranger.pid)
        assert not cluster.session_is_ours(home, theirs.pid)
        left = cluster.stop_groups(home, [ours.pid, stranger.pid, theirs.pid], grace_s=5.0)
        assert sorted(left) == sorted([stranger.pid, theirs.pid])
        assert ours.wait(timeout=10) is not None
        assert _alive(stranger) and _alive(theirs)
        with pytest.raises(cluster.ClusterError, match="not a node"):
            cluster.kill_host(home, stranger.pid)
        assert _alive(stranger)
    finally:
        for p in (ours, stranger, theirs):
            p.kill()
            p.wait()


def test_the_mark_is_not_in_the_drivers_own_environment(home):
    """Drivers (`apply_ray_env` puts `ray_env` in their environment), and so whatever a user's
    shell or a test starts beside them, never carry it: only node processes do."""
    assert cluster.MARK_ENV not in cluster.ray_env(home)
    assert cluster.MARK_ENV not in os.environ


def test_a_head_that_does_not_answer_is_told_apart_from_one_that_does(home):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        listening = cluster.ClusterInfo(f"127.0.0.1:{s.getsockname()[1]}", 0, 0, 0.0)
        assert cluster.answers(listening)
    assert not cluster.answers(cluster.ClusterInfo("127.0.0.1:1", 0, 0, 0.0), timeout_s=1.0)


def _orchestrator(home_root, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "ORCHESTRATOR_HOME": str(home_root), "RAY_AUTH_MODE": "disabled"}
    return subprocess.run([sys.executable, "-m", "orchestrator", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def test_a_token_others_can_read_is_refused_with_a_way_out(home):
    cluster.ensure_token(home)
    home.token_file.chmod(0o644)
    r = _orchestrator(home.root, "up")
    assert r.returncode == 1
    assert "can be read by others (mode 644)" in r.stderr and "Traceback" not in r.stderr
    assert not home.cluster_file.exists()  # nothing was started
    home.token_file.chmod(0o600)
    cluster.check_private(home)  # mended: accepted


def test_a_token_that_is_a_link_is_refused(home, tmp_path):
    target = tmp_path / "elsewhere"
    target.write_text("x" * 64)
    target.chmod(0o600)
    home.token_file.symlink_to(target)
    with pytest.raises(cluster.ClusterError, match="not a regular file"):
        cluster.ensure_token(home)


def test_a_state_directory_others_can_write_is_refused(home):
    home.root.chmod(0o777)
    try:
        r = _orchestrator(home.root, "up")
        assert r.returncode == 1
        assert "writable by others" in r.stderr and f"chmod 700 {home.root}" in r.stderr
        assert not home.cluster_file.exists() and not home.token_file.exists()
    finally:
        home.root.chmod(0o700)


def test_a_node_started_before_nodes_carried_the_mark_is_still_ours(home):
    """An upgrade with the cluster up: its nodes have no mark, but they are `orchestrator.raynode`
    processes started for this state directory; a process with only one of the two is not a node."""
    def fake_node(*, home_root: str, raynode: bool) -> subprocess.Popen:
        args = ([sys.executable, "-c", "import time; time.sleep(300)"]
                + (["-m", "orchestrator.raynode"] if raynode else []))
        env = {k: v for k, v in os.environ.items() if k != cluster.MARK_ENV}
        return subprocess.Popen(args, start_new_session=True, env={**env, "ORCHESTRATOR_HOME": home_root})

    old = fake_node(home_root=str(home.root), raynode=True)
    other_home = fake_node(home_root=str(home.root.parent / "other"), raynode=True)
    shell = fake_node(home_root=str(home.root), raynode=False)  # e.g. a shell with ORCHESTRATOR_HOME exported
    try:
        wait_for(lambda: cluster.session_is_ours(home, old.pid), 10, "the old node's program to run")
        assert not cluster.session_is_ours(home, other_home.pid)
        assert not cluster.session_is_ours(home, shell.pid)
    finally:
        for p in (old, other_home, shell):
            p.kill()
            p.wait()


def test_ci_stops_only_the_nodes_of_its_own_state_directories(tmp_path):
    """`.ci/run` ends leftover nodes by their node mark under its own temporary folder, not by a
    command-line pattern (`pkill -f orchestrator.cluster.raynode`) that matches anyone's nodes."""
    from orchestrator.cluster.processes import leftover_nodes

    ours = cluster.Home(tmp_path / "run" / "pytest" / "test-a" / "home").ensure()
    cluster.ensure_token(ours)
    theirs = cluster.Home(tmp_path / "elsewhere" / "home").ensure()
    cluster.ensure_token(theirs)
    fake_node = [sys.executable, "-c", "import time; time.sleep(300)", "-m", "orchestrator.cluster.raynode"]
    procs = [subprocess.Popen(fake_node, start_new_session=True, env={**os.environ, cluster.MARK_ENV: mark})
             for mark in (cluster.node_mark(ours), cluster.node_mark(theirs), "not-a-mark")]
    try:
        assert leftover_nodes(tmp_path / "run") == [procs[0].pid]
        assert leftover_nodes(tmp_path / "nothing-here") == []
    finally:
        for p in procs:
            p.kill()
            p.wait()
    script = (REPO / ".ci" / "run").read_text()
    assert "leftover_nodes" in script and "pkill" not in script and "pgrep" not in script


def test_down_ends_what_a_jobs_code_hid_from_the_nodes_sessions(home):
    """A daemon that forked twice and left its node's session still carries the node mark: `down` ends it."""
    cluster.ensure_token(home)
    daemon = _sleeper({cluster.MARK_ENV: cluster.node_mark(home)})  # a session of its own, recorded nowhere
    stranger = _sleeper()
    try:
        r = _down(home)
        assert r.returncode == 0, r.stderr
        assert daemon.wait(timeout=30) is not None
        assert f"ended 1 process(es) left behind by the cluster's nodes (they carried its node mark): " \
               f"{daemon.pid}" in r.stderr
        assert _alive(stranger)
    finally:
        for p in (daemon, stranger):
            p.kill()
            p.wait()
