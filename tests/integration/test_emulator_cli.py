"""`orchestrator emulator --vms` and its subcommands, run as a user runs them: each command a process of its own.

One emulated GCP world for the module: its printed job-file lines make a valid gcp job whose bucket is writable;
slices made with the real TPU client boot share-nothing VMs; `notice`, `poweroff` and `reclaim` change what the
emulator reports (the real client for the API's states, the control API for each VM); a slice or host that does
not exist is one `error:` line and exit 2; Ctrl-C ends it with every VM and the storage process gone; then the
subcommands say no emulator runs (exit 1).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from google.api_core.client_options import ClientOptions
from google.auth.credentials import AnonymousCredentials
from google.cloud import tpu_v2
from typer.testing import CliRunner

from orchestrator.cluster.processes import leftover_nodes
from orchestrator.domain.spec import JobSpec
from orchestrator.emulator import ControlClient
from orchestrator.user.cli import app
from orchestrator.user.preflight import gcp_problems
from tests.waiting import wait_for

pytestmark = pytest.mark.timeout(180)

QRState = tpu_v2.QueuedResourceState.State
NodeState = tpu_v2.Node.State


def orchestrator(home: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """The command in a process of its own, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "orchestrator.user.cli", *args], capture_output=True, text=True,
                          env={**os.environ, "ORCHESTRATOR_HOME": str(home)}, timeout=timeout)


def emulator(home: Path, *args: str) -> subprocess.CompletedProcess:
    """`orchestrator emulator ARGS` in this process (the subcommands are clients of the emulator's HTTP API: the
    same as in a process of their own, without a second or more of imports each on a busy machine)."""
    r = CliRunner().invoke(app, ["emulator", *args], env={"ORCHESTRATOR_HOME": str(home)})
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise r.exception
    return subprocess.CompletedProcess(args, r.exit_code, r.stdout, r.stderr)


class World:
    """The `orchestrator emulator --vms` process, what it printed, and clients for what it serves."""

    def __init__(self, home: Path):
        self.home = home
        self.proc = subprocess.Popen([sys.executable, "-m", "orchestrator.user.cli", "emulator", "--vms", "--port",
                                      "0", "--storage-port", "0", "--time-scale", "0.02"],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                     env={**os.environ, "ORCHESTRATOR_HOME": str(home)})
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [self._lines.put(line) for line in self.proc.stdout], daemon=True).start()
        self.printed = self._read_until("Ctrl-C stops it", timeout_s=60)
        record = json.loads((home / "emulator.json").read_text())
        self.url, self.project, self.zone = record["url"], record["project"], record["zone"]
        self.control = ControlClient(self.url, token=record["control_token"])
        self.tpu = tpu_v2.TpuClient(credentials=AnonymousCredentials(), transport="rest",
                                    client_options=ClientOptions(api_endpoint=self.url))
        self.parent = f"projects/{self.project}/locations/{self.zone}"

    def _read_until(self, last: str, timeout_s: float) -> str:
        lines, deadline = [], time.monotonic() + timeout_s
        while not lines or last not in lines[-1]:
            try:
                lines.append(self._lines.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                raise AssertionError(f"the emulator printed no {last!r} line in {timeout_s} s: {lines}") from None
        return "".join(lines)

    def job_lines(self) -> str:
        return self.printed.split("(checkpoints in gs://emulated-bucket/checkpoints/<job name>):\n")[1].split("\n\n")[0]

    def create_slice(self, name: str) -> None:
        """A spot v4-16 (two hosts) whose VMs' startup script only says it ran; waits for both to boot."""
        node = tpu_v2.Node(accelerator_type="v4-16", runtime_version="tpu-ubuntu2204-base",
                           metadata={"startup-script": "echo booted"})
        spec = tpu_v2.QueuedResource.Tpu.NodeSpec(parent=self.parent, node_id=name, node=node)
        qr = tpu_v2.QueuedResource(tpu=tpu_v2.QueuedResource.Tpu(node_spec=[spec]), spot=tpu_v2.QueuedResource.Spot())
        self.tpu.create_queued_resource(parent=self.parent, queued_resource_id=name, queued_resource=qr)
        wait_for(lambda: [h["booted"] for h in self.hosts(name)] == [True, True], 60, f"{name}'s two VMs to boot")

    def hosts(self, name: str) -> list[dict]:
        return self.control.state()["hosts"].get(name, [])

    def qr_state(self, name: str):
        return self.tpu.get_queued_resource(name=f"{self.parent}/queuedResources/{name}").state.state

    def node_state(self, name: str):
        return self.tpu.get_node(name=f"{self.parent}/nodes/{name}").state


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    home = tmp_path_factory.mktemp("emulator-home")
    w = World(home)
    try:
        yield w
    finally:
        if w.proc.poll() is None:  # as Ctrl-C: it powers its VMs off (one it is still powering off included)
            w.proc.terminate()
            try:
                w.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()


def test_it_prints_the_lines_of_a_valid_gcp_job_whose_bucket_is_writable(world):
    spec = JobSpec.from_dict({"name": "on-the-emulator", "accelerator": "v4-16",
                              **yaml.safe_load(world.job_lines())})
    assert spec.provider == "gcp" and spec.gcp is not None
    assert (spec.gcp.endpoint, spec.gcp.project, spec.gcp.zones) == (world.url, world.project, [world.zone])
    assert spec.storage.endpoint is not None and spec.storage.endpoint.startswith("http://127.0.0.1:")
    assert spec.with_checkpoint_directory("").checkpoint.directory == "gs://emulated-bucket/checkpoints/on-the-emulator"
    # What `submit` checks first: a head on this machine's loopback is fine for the emulator's VMs, the worker
    # environment can be pinned, and a probe object is written to the bucket and read back.
    assert gcp_problems(spec, "127.0.0.1:6379") == []
    assert (world.home / "emulator.json").stat().st_mode & 0o777 == 0o600  # it holds the control token


def test_a_second_one_for_the_same_state_directory_is_refused(world):
    r = orchestrator(world.home, "emulator", "--vms", "--port", "0", "--storage-port", "0")
    assert r.returncode == 1
    assert r.stderr.startswith(f"error: an emulator already runs for {world.home} (process {world.proc.pid}, ")


def test_notice_and_poweroff_act_on_one_host_and_reclaim_on_the_slice(world):
    world.create_slice("s1")
    assert emulator(world.home, "slices").stdout == \
        "s1  v4-16  queued resource ACTIVE  node READY  hosts 0:booted, 1:booted\n"

    r = emulator(world.home, "notice", "s1", "--host", "1")
    assert (r.returncode, r.stdout) == (0, "instance/preempted=TRUE on the metadata server of host 1 of s1\n")
    assert [h["metadata"]["instance/preempted"] for h in world.hosts("s1")] == ["FALSE", "TRUE"]

    r = emulator(world.home, "poweroff", "s1", "--host", "0")
    assert r.returncode == 0, r.stderr
    assert [h["alive"] for h in world.hosts("s1")] == [False, True]
    assert world.node_state("s1") == NodeState.READY  # a crashed host: the API does not know yet

    r = emulator(world.home, "poweroff", "s1", "--host", "1", "--silent")  # its processes frozen, no reset
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("powered off host 1 of ") and r.stdout.endswith(
        "/s1, silently, as a host that lost power: the API still says READY\n"), r.stdout
    assert [h["alive"] for h in world.hosts("s1")] == [False, False]
    assert world.node_state("s1") == NodeState.READY

    r = emulator(world.home, "reclaim", "s1")
    assert r.returncode == 0, r.stderr
    assert world.qr_state("s1") in (QRState.SUSPENDING, QRState.SUSPENDED)
    wait_for(lambda: world.qr_state("s1") == QRState.SUSPENDED and world.node_state("s1") == NodeState.PREEMPTED,
             30, "the reclaim's grace period to end")
    wait_for(lambda: world.hosts("s1") == [], 30, "the reclaimed slice's VMs to be powered off")


def test_poweroff_of_every_host_terminates_the_node(world):
    world.create_slice("s2")
    r = emulator(world.home, "poweroff", "s2")
    assert (r.returncode, r.stdout) == (0, f"powered off every host of {world.parent}/nodes/s2: its node is "
                                           "TERMINATED\n")
    assert world.node_state("s2") == NodeState.TERMINATED
    wait_for(lambda: world.hosts("s2") == [], 30, "s2's VMs to be powered off")


@pytest.mark.parametrize("args, line", [
    (("reclaim", "nope"), "error: no slice 'nope' in the emulator; its slices: "),
    (("notice", "nope", "--host", "0"), "error: no slice 'nope' in the emulator; its slices: "),
    (("poweroff", "s1", "--host", "5"), "error: slice s1 has no host 5; its hosts are 0 to 1"),
    (("notice", "s1", "--host", "-1"), "error: slice s1 has no host -1; its hosts are 0 to 1"),
])
def test_a_slice_or_host_that_does_not_exist_is_one_error_line_and_exit_2(world, args, line):
    if "s1" not in emulator(world.home, "slices").stdout:  # this test alone
        world.create_slice("s1")
    r = emulator(world.home, *args)
    assert (r.returncode, r.stdout, len(r.stderr.splitlines())) == (2, "", 1), r.stderr
    assert r.stderr.startswith(line), r.stderr


def test_ctrl_c_stops_it_and_every_process_it_started_then_the_subcommands_say_none_runs(world):
    world.create_slice("s3")
    started = _descendants(world.proc.pid)
    assert len(started) >= 3, started  # the storage emulator and two VMs at least
    world.proc.send_signal(signal.SIGINT)
    assert world.proc.wait(timeout=30) == 0
    wait_for(lambda: not [p for p in started if _alive(p)], 15, f"the processes it started ({started}) to end")
    assert leftover_nodes(world.home) == []
    assert not (world.home / "emulator.json").exists()
    r = orchestrator(world.home, "emulator", "reclaim", "s3")
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr == f"error: no emulator with VMs runs for {world.home}; start one with `orchestrator emulator " \
                       "--vms` (in another shell; the same ORCHESTRATOR_HOME)\n"


def _descendants(pid: int) -> list[int]:
    """Every process under `pid`, whichever of its threads started it."""
    children = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return children + [d for c in children for d in _descendants(c)]


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False
