"""Shared fixtures: an isolated state directory, and one embedded local cluster per session.

Integration tests run real Ray nodes (a head plus one node per "TPU host") on this
machine, with token authentication on as users run it; every process they start is
stopped at the end of the session.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest

# XLA's CPU backend at optimization level 1 in every process the suite starts (this one, the cluster's nodes
# and the jobs' hosts, which inherit the environment, the references). Compiling is most of what a stand-in
# host spends on a tiny model. A reference of 60 steps: 10.2-10.7 -> 8.0-8.9 CPU-s, its steps as fast (7.6-8.7
# ms); level 0 compiled a little faster still but doubled the steps (17 ms). The product leaves XLA's default.
# The TPU compiler ignores this flag: the tpu tier's reports (bytes, FLOPs) are the same with it and without.
# Set before anything starts a backend.
CPU_COMPILE_FLAG = "--xla_backend_optimization_level=1"
if CPU_COMPILE_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {CPU_COMPILE_FLAG}".strip()

from tests.storage_fixture import gcs, gcs_emulator  # noqa: E402, F401  (Cloud Storage on the local emulator)
from workers.order import LaunchOrder  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TIERS = ("unit", "checks", "numerics", "integration", "chaos", "kernels", "tpu")  # pyproject.toml's markers


# The tiers whose tests start clusters, jobs and emulators, and the fixtures that share them. Under
# pytest-xdist (`-n 2`, pyproject.toml) their tests are one unit of work (`pytest_xdist_make_scheduler`), run in
# order by one worker, which alone starts the session's cluster; the other worker takes the in-process tiers.
CLUSTER_TIERS = ("integration", "chaos")
CLUSTER_FIXTURES = frozenset({"client", "session_home"})


def in_cluster_tier(nodeid: str) -> bool:
    return nodeid.startswith(tuple(f"tests/{tier}/" for tier in CLUSTER_TIERS))


def pytest_collection_modifyitems(items):
    """Each test carries its tier's marker, the name of its folder under tests/ (`-m unit`, `-m "not numerics"`).
    A test of the session's cluster outside the cluster tiers would start a second cluster beside the first under
    xdist: refused."""
    tests = REPO / "tests"
    for item in items:
        parts = item.path.relative_to(tests).parts if item.path.is_relative_to(tests) else ()
        if len(parts) > 1 and parts[0] in TIERS:
            item.add_marker(parts[0])
        if parts and parts[0] not in CLUSTER_TIERS and CLUSTER_FIXTURES & set(getattr(item, "fixturenames", ())):
            raise pytest.UsageError(f"{item.nodeid} uses the session's cluster: move it to tests/integration or "
                                    "tests/chaos, whose tests run in order on one xdist worker")


def pytest_xdist_make_scheduler(config, log):
    """Work to the xdist workers as `--dist load` gives it, but the cluster tiers are one unit: one worker runs
    them in order (collection order puts tests/chaos first, so that worker starts with them), the other worker
    everything else. (xdist's own `xdist_group` does not group under pytest 9: the id it rewrites is not used.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ClusterTiersTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "cluster" if in_cluster_tier(nodeid) else nodeid

    return ClusterTiersTogether(config, log)


if os.environ.get("PYTEST_XDIST_WORKER"):
    # xdist gives its workers COLUMNS=80; the commands' consoles, made when first imported, would keep that width,
    # and the tests that read a table at a width of their own (COLUMNS) would get 80. A run without xdist has none.
    os.environ.pop("COLUMNS", None)

_worker_role: str | None = None  # under xdist: "cluster" or "in-process", by the first test this worker runs


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """An xdist worker whose first test is not of the cluster group runs the in-process tiers: it yields the
    CPU (nice 10, with the processes it starts) to the cluster tests' jobs, whose timing is theirs to keep,
    and takes what they leave idle."""
    global _worker_role
    if _worker_role is None and os.environ.get("PYTEST_XDIST_WORKER"):
        _worker_role = "cluster" if in_cluster_tier(item.nodeid) else "in-process"
        if _worker_role == "in-process":
            os.nice(10)


@pytest.fixture(scope="session")
def session_home(tmp_path_factory) -> Path:
    home = tmp_path_factory.mktemp("orchestrator-home")
    os.environ["ORCHESTRATOR_HOME"] = str(home)
    return home


@pytest.fixture(scope="session")
def client(session_home):
    """A client connected to a fresh embedded cluster, stopped (with all its slices) at the end."""
    from orchestrator import Client

    c = Client(home=session_home)
    c.connect()
    yield c
    c.down()


def run_reference(spec, devices: int, tmp_path: Path, *, env: dict | None = None) -> dict:
    """Per-step losses and final parameter sums of `spec`'s workload (the built-in trainer or a user
    program) trained in one plain process with `devices` CPU devices, without checkpoints."""
    return start_reference(spec, devices, tmp_path, env=env).result()


def start_reference(spec, devices: int, tmp_path: Path, *, env: dict | None = None) -> Reference:
    """`run_reference` started now and read later (`.result()`): the plain process trains while the
    test's job waits on its slices, instead of after it."""
    from orchestrator.control.launch import launch_order

    t = spec.tpu_type
    return start_workload(launch_order(spec, t.chips, t.hosts), devices, tmp_path, env=env)


def run_workload(order: LaunchOrder, devices: int, tmp_path: Path, *, env: dict | None = None) -> dict:
    """`workers.reference` on a host's launch `order`, without its checkpoints (`env`: extra variables)."""
    return start_workload(order, devices, tmp_path, env=env).result()


REFERENCE_TIMEOUT_S = 600
_running: list[Reference] = []  # started and not yet read or stopped
_compile_cache: list[Path] = []  # the session's, once `_reference_compile_cache` has made it


@pytest.fixture(autouse=True, scope="session")
def _reference_compile_cache(tmp_path_factory):
    """The references of one session share a compile cache: a program another reference compiled
    already is loaded, not compiled again (the same executable, so the same losses)."""
    _compile_cache.append(tmp_path_factory.mktemp("reference-compile-cache"))


class Reference:
    """A `workers.reference` process running in the background; `result()` waits for what it wrote."""

    def __init__(self, order: LaunchOrder, devices: int, tmp_path: Path, env: dict | None):
        tmp_path.mkdir(parents=True, exist_ok=True)
        order_file, self._out = tmp_path / "ref-order.pkl", tmp_path / "ref-out.json"
        settings = dataclasses.replace(order.settings, checkpoint_dir=None)
        order_file.write_bytes(pickle.dumps(dataclasses.replace(order, settings=settings)))
        self._started = time.monotonic()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "workers.reference", "--order", str(order_file), "--devices", str(devices),
             "--out", str(self._out), *(["--compile-cache", str(_compile_cache[0])] if _compile_cache else [])],
            cwd=REPO, env={**os.environ, **(env or {})})
        self._value: dict | None = None
        _running.append(self)

    def result(self) -> dict:
        if self._value is None:
            try:
                rc = self._proc.wait(timeout=max(1.0, REFERENCE_TIMEOUT_S - (time.monotonic() - self._started)))
            finally:
                self.stop()
            if rc != 0:
                raise subprocess.CalledProcessError(rc, self._proc.args)
            self._value = json.loads(self._out.read_text())
        return self._value

    def stop(self) -> None:
        """Ends the process if it still runs (a test that failed before reading it)."""
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        if self in _running:
            _running.remove(self)


def start_workload(order: LaunchOrder, devices: int, tmp_path: Path, *, env: dict | None = None) -> Reference:
    """`run_workload` started now and read later (`.result()`)."""
    return Reference(order, devices, tmp_path, env)


def assert_losses_close(actual: list[float], expected: list[float], rtol: float) -> None:
    assert len(actual) == len(expected), f"{len(actual)} steps, expected {len(expected)}"
    worst = max(abs(a - e) / abs(e) for a, e in zip(actual, expected, strict=True))
    assert worst <= rtol, f"per-step losses differ by up to {worst:.2e} relative (allowed {rtol:.0e})"


@pytest.fixture(autouse=True, scope="module")
def _end_leftover_references():
    """A reference a module's tests started and never read ends with the module, not later beside another's job."""
    yield
    for ref in list(_running):
        ref.stop()


@pytest.fixture(autouse=True)
def _cancel_leftover_jobs(request):
    """A test that fails mid-job must not leave that job competing with the next test."""
    yield
    if "client" not in request.fixturenames:
        return
    c = request.getfixturevalue("client")
    from orchestrator.errors import JobStateError

    for job in c.store.jobs(active_only=True):
        try:
            c.cancel(job.id)
        except JobStateError:  # it ended meanwhile
            pass
    deadline = time.monotonic() + 120
    while c.store.jobs(active_only=True) and time.monotonic() < deadline:
        time.sleep(0.5)
