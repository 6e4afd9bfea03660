"""A launch's workers' ends come back by themselves (`orchestrator.control.ends`): each worker is asked once to
answer when it ends and asked again when that call times out; a look reads what came back without a call; an end,
or a worker gone, wakes the driver at once. Real Ray actors, on Ray's local mode in a subprocess."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO

SCRIPT = r"""
import os, threading, time
os.environ["RAY_AUTH_MODE"] = "disabled"
import ray
from orchestrator.control import ends
from orchestrator.control.ends import WorkerEnds

ends.END_WAIT_S = 0.3

class Worker:
    def __init__(self):
        self.done, self.result, self.asked = threading.Event(), None, 0
    def wait_result(self, timeout_s):
        self.asked += 1
        self.done.wait(timeout_s)
        return self.result
    def finish(self, result):
        self.result = result
        self.done.set()
    def calls(self):
        return self.asked

class Older:
    def result(self):
        return None

ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
try:
    W = ray.remote(max_concurrency=4)(Worker)
    a, b = W.remote(), W.remote()
    assert WorkerEnds.can_wait([a, b]) and not WorkerEnds.can_wait([a, None]) and not WorkerEnds.can_wait([])
    assert not WorkerEnds.can_wait([a, ray.remote(Older).remote()])
    wake = threading.Event()
    watched = WorkerEnds([a, b], wake)
    assert watched.results() == [None, None]
    deadline = time.monotonic() + 30  # each call's wait runs out after 0.3 s: asked again at the next look
    while ray.get(a.calls.remote()) < 3:
        assert time.monotonic() < deadline, f"asked {ray.get(a.calls.remote())} times in 30 s with calls of 0.3 s"
        assert watched.results() == [None, None]
        time.sleep(0.1)

    ends.END_WAIT_S = 600.0  # from here no call runs out: only an end or a death can wake the driver
    a, b = W.remote(), W.remote()
    wake = threading.Event()
    watched = WorkerEnds([a, b], wake)
    assert watched.results() == [None, None] and not wake.wait(1.0)
    a.finish.remote("a ended")
    t0 = time.monotonic()
    assert wake.wait(30), "an end did not wake the driver"
    woke_s = time.monotonic() - t0
    assert watched.results() == ["a ended", None]
    asked = ray.get(a.calls.remote())
    assert watched.results() == ["a ended", None] and ray.get(a.calls.remote()) == asked  # ended: not asked again
    wake.clear()
    ray.kill(b)
    assert wake.wait(30), "a worker gone did not wake the driver"
    try:
        watched.results()
        raise AssertionError("a worker gone read as training")
    except ray.exceptions.RayActorError:
        pass
    print(f"woke {woke_s:.3f} s after the end")
finally:
    ray.shutdown()
"""


def test_ends_come_back_by_themselves_and_wake_the_driver():
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "woke" in done.stdout
