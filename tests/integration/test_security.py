"""A hardened local deployment: loopback only, token authentication, no secret in logs, no path escapes."""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request

import psutil
import pytest

from orchestrator import JobState
from orchestrator.cluster import read_cluster
from tests.conftest import REPO
from tests.integration.test_local_jobs import tiny_spec
from tests.waiting import wait_step


def _our_processes(client) -> list[psutil.Process]:
    """Every process of the cluster's nodes: each node is a session of its own (its id is the
    recorded one), and Ray puts each worker in a process group of its own inside it."""
    sessions = {read_cluster(client.home).pgid}
    for rec in client.store.slices(live_only=True):
        sessions.update(rec.data["pgids"])
    procs = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) in sessions:
                procs.append(p)
        except (ProcessLookupError, PermissionError, psutil.Error):
            pass
    return procs


def test_everything_listens_on_loopback_only(client, tmp_path):
    job = client.submit(tiny_spec("sockets", "v4-16", tmp_path, steps=30, interval=10))
    wait_step(job, 3)
    listening = []
    for p in _our_processes(client):
        try:
            conns = p.net_connections(kind="inet")
            name = " ".join(p.cmdline()) or p.name()
        except psutil.Error:
            continue
        listening += [(name, c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]
    job.cancel()
    assert len(listening) >= 10, listening  # GCS, raylets, agents, dashboard, workers...
    # The 2-host job's workers are among them: host 0 serves the JAX runtime's coordinator,
    # and every host listens for its peers' collectives (gloo).
    worker_ports = [x for x in listening if "HostWorker" in x[0]]
    assert len(worker_ports) >= 3, listening
    exposed = [x for x in listening
               if not ipaddress.ip_address(x[1].removeprefix("::ffff:")).is_loopback]
    assert exposed == [], f"listening beyond loopback: {exposed}"
    assert job.wait(timeout_s=120).state is JobState.CANCELLED


def test_unauthenticated_clients_are_refused(client):
    info = read_cluster(client.home)
    # The job/dashboard HTTP API: 401 without the token, 200 with it.
    url = f"http://127.0.0.1:{info.dashboard_port}/api/jobs/"
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(url, timeout=10)
    assert refused.value.code == 401
    token = client.home.token_file.read_text().strip()
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    assert urllib.request.urlopen(req, timeout=10).status == 200
    # A Ray driver without the token cannot join the cluster.
    code = (f"import ray; ray.init(address={info.address!r}); print('CONNECTED')")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(RAY_AUTH_MODE="disabled", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", HOME=str(client.home.root / "nohome"))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "CONNECTED" not in r.stdout
    assert (client.home.token_file.stat().st_mode & 0o777) == 0o600


def test_no_token_in_logs_events_or_reports(client, tmp_path):
    job = client.submit(tiny_spec("secrets", "v4-8", tmp_path, steps=4, interval=2))
    assert job.wait(timeout_s=300).state is JobState.SUCCEEDED
    report = tmp_path / "report.html"
    subprocess.run([sys.executable, "-m", "orchestrator", "report", job.id, "-o", str(report)], cwd=REPO,
                   env={**os.environ, "ORCHESTRATOR_HOME": str(client.home.root)}, check=True, timeout=120)
    token = client.home.token_file.read_text().strip()
    texts = [json.dumps([vars(e) for e in job.events()]), job.logs(), report.read_text(errors="replace")]
    for path in client.home.root.rglob("*"):
        if path.is_file() and path.suffix in (".log", ".json", ".txt", ".out", ".err") and path.stat().st_size < 50e6:
            texts.append(path.read_text(errors="replace"))
    assert len(texts) > 5
    assert not [t for t in texts if token in t]
