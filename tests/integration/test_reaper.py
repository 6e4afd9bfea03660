"""What a job's code starts on a host ends with its worker: a daemon that forked twice and left the session too."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import REPO
from workers import reaper

WORKER = """
import os, sys, time
from workers import reaper

reaper.guard("job-1-g1-w0")
subprocess_child = os.fork()
if subprocess_child == 0:  # the job's code: a daemon, forked twice, in a session of its own
    os.setsid()
    if os.fork() == 0:
        open(sys.argv[1], "w").write(str(os.getpid()))
        while True:
            time.sleep(1)
    os._exit(0)
os.waitpid(subprocess_child, 0)
print("ready", flush=True)
time.sleep(300)
"""


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_double_forked_daemon_ends_once_its_worker_is_gone(tmp_path):
    pidfile = tmp_path / "daemon.pid"
    worker = subprocess.Popen([sys.executable, "-c", WORKER, str(pidfile)], cwd=REPO, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert worker.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 10
        while not pidfile.exists() or not pidfile.read_text():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        daemon = int(pidfile.read_text())
        assert int(Path(f"/proc/{daemon}/stat").read_text().rsplit(")", 1)[1].split()[1]) == worker.pid  # subreaper
        # Two looks of the watcher (POLL_S apart): it has noted the daemon, and spares it while the worker lives.
        time.sleep(2 * reaper.POLL_S)
        assert running(daemon)
        os.kill(worker.pid, signal.SIGKILL)  # as Ray ends a worker at teardown
        worker.wait()
        deadline = time.monotonic() + 15
        while running(daemon) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not running(daemon), "the daemon outlived its worker"
    finally:
        worker.kill()
        if pidfile.exists() and pidfile.read_text() and running(int(pidfile.read_text())):
            os.kill(int(pidfile.read_text()), signal.SIGKILL)
