"""Ray nodes of the embedded cluster: the head and each local "TPU host", started, found and stopped.

Every node is a ``ray start --block`` process (through `orchestrator.cluster.raynode`,
kept on 127.0.0.1) in a session of its own, with Ray's token authentication on and this
state directory's node mark in its environment. A host node's CPU stands in for its TPU
chips, and its environment says so (`workers.accelerator.CPU_STAND_IN_ENV`), unless it
is started as a TPU host would be (``stand_in=False``).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import random
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from orchestrator.cluster.home import Home, ensure_token, node_mark
from orchestrator.cluster.processes import MARK_ENV, group_alive, session_is_ours, stop_group
from orchestrator.errors import ClusterError
from workers.accelerator import CPU_STAND_IN_ENV, stand_in_env

log = logging.getLogger(__name__)

NAMESPACE = "tpu-orchestrator"
CONTROLLER_NAME = "controller"
CONTROLLER_RESOURCE = "orchestrator-controller"  # only the head has it: the controller never lands on a slice


@dataclass(frozen=True)
class ClusterInfo:
    address: str  # GCS address, 127.0.0.1:PORT
    pgid: int  # process group of the head's `ray start --block`
    dashboard_port: int
    started_at: float
    owner: str = "up"  # "up" (orchestrator up) or "submit" (started for one job)


def ray_env(home: Home) -> dict[str, str]:
    """Environment for every Ray process and driver of the embedded cluster."""
    env = {
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # node address 127.0.0.1, ports bound to loopback
        "RAY_AUTH_TOKEN_PATH": str(home.token_file),
        "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "token"),  # tests may set "disabled"
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",  # a released host goes at once
        "ORCHESTRATOR_HOME": str(home.root),
    }
    return env


def apply_ray_env(home: Home) -> None:
    """Set `ray_env` in this process (before it talks to Ray) and make sure the token exists."""
    ensure_token(home)
    os.environ.update(ray_env(home))
    import ray._private.ray_constants as ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False  # read at call time: keeps this driver on 127.0.0.1
    # Ray caches its config and token at import; make this process see the values just set.
    # ray._raylet's type stub lacks these names.
    from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


# Ports the tool hands to Ray processes come from below the kernel's ephemeral range
# (32768-60999 on Linux) and above Ray's worker ports (10002-19999). A port is chosen
# here but bound later by another process; an ephemeral one could meanwhile become the
# local end of some outgoing connection (Ray's processes open many), and the raylet that
# gets it dies with "Address already in use", a 30 s stall before it is started again.
_PORT_RANGE = (20000, 32000)
_recently_handed_out: collections.deque[int] = collections.deque(maxlen=1024)  # not yet bound, maybe


def free_port() -> int:
    """A port free on 127.0.0.1 now, outside the ephemeral range, not among the last ones this process handed out."""
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(*_PORT_RANGE)
        if port in _recently_handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _recently_handed_out.append(port)
        return port
    raise ClusterError(f"no free port on 127.0.0.1 in {_PORT_RANGE[0]}-{_PORT_RANGE[1]}")


def loopback_node_args() -> list[str]:
    """`ray start` arguments of a node that shares this machine with others: on 127.0.0.1, its own ports."""
    return ["--disable-usage-stats", "--node-ip-address=127.0.0.1", "--object-store-memory", str(128 * 1024 * 1024),
            f"--dashboard-agent-listen-port={free_port()}", f"--metrics-export-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
            f"--node-manager-port={free_port()}", f"--object-manager-port={free_port()}",
            # Workers bind a port the kernel assigns: every node's workers share Ray's default
            # range on this one machine, and two nodes could hand out the same port.
            "--min-worker-port=0", "--max-worker-port=0"]


def _ray_start(home: Home, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    ensure_token(home)
    base = {**os.environ, **ray_env(home)}
    for key in list(base):  # a fresh environment: nothing left over from an earlier slice, no inherited declaration
        if key.startswith(("MEGASCALE_", "TPU_", "JAX_COORDINATOR")) or key == CPU_STAND_IN_ENV:
            del base[key]
    env = {**base, **(env or {}), MARK_ENV: node_mark(home)}
    log_path.parent.mkdir(parents=True, exist_ok=True)
    out = open(log_path, "ab")
    try:
        cmd = [sys.executable, "-m", "orchestrator.cluster.raynode", "start", "--block", *loopback_node_args(),
               *args]
        # The node runs in a session of its own (its id is the returned pid) and is not our child:
        # a shell starts it in the background and exits. Ray kills a worker's child processes
        # when the worker dies, and the controller (a Ray worker) starts nodes: as its children,
        # they would die with a restarting controller.
        proc = subprocess.Popen(["/bin/sh", "-c", '"$@" &', "sh", *cmd], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        proc.wait(timeout=30)
        return proc
    finally:
        out.close()


def _wait_port(port: int, proc: subprocess.Popen, timeout_s: float, log_path: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not group_alive(proc.pid):
            raise ClusterError(f"the Ray head exited; see {log_path}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.3)
    raise ClusterError(f"the Ray head did not open port {port} within {timeout_s:.0f} s; see {log_path}")


def start_head(home: Home, *, num_cpus: int = 2, owner: str = "up", timeout_s: float = 90.0) -> ClusterInfo:
    home.ensure()
    port, dash = free_port(), free_port()
    log_path = home.root / "logs" / "head.log"
    # No log monitor: it streams workers' output to drivers, and every driver here connects with
    # `log_to_driver=False`; every node of this machine writes to one session folder, so the head's
    # monitor would read the output of every host's workers (about 4% of a core while jobs train).
    proc = _ray_start(home, ["--head", "--include-log-monitor=False", f"--port={port}", "--dashboard-host=127.0.0.1",
                             f"--dashboard-port={dash}", f"--ray-client-server-port={free_port()}",
                             f"--num-cpus={num_cpus}", f"--resources={json.dumps({CONTROLLER_RESOURCE: 1})}"], log_path)
    try:
        _wait_port(port, proc, timeout_s, log_path)
    except ClusterError:
        stop_group(home, proc.pid)
        raise
    info = ClusterInfo(f"127.0.0.1:{port}", proc.pid, dash, time.time(), owner)
    home.cluster_file.write_text(json.dumps(asdict(info)))
    log.info("started Ray head at %s (dashboard 127.0.0.1:%d)", info.address, dash)
    return info


def read_cluster(home: Home) -> ClusterInfo | None:
    """The running cluster recorded in `home`, or None.

    A stale record (its head's processes gone, or its process id now another program's)
    is removed at once; it is never retried or signalled.
    """
    try:
        info = ClusterInfo(**json.loads(home.cluster_file.read_text()))
    except (FileNotFoundError, json.JSONDecodeError, TypeError):
        return None
    if not session_is_ours(home, info.pgid):
        log.info("removing the stale cluster record %s (its head is gone)", home.cluster_file)
        home.cluster_file.unlink(missing_ok=True)
        return None
    return info


def answers(info: ClusterInfo, timeout_s: float = 2.0) -> bool:
    """Whether the head's GCS accepts connections (a driver would retry a dead one for minutes)."""
    host, port = info.address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
        return True
    except OSError:
        return False


def start_host_node(home: Home, *, address: str, resources: dict[str, float], labels: dict[str, str],
                    log_path: Path, num_cpus: int = 1, stand_in: bool = True) -> int:
    """Add one node to the cluster; returns its process group id.

    `stand_in`: the node declares that its CPU stands in for its TPU chips (its workers run
    on CPU devices); False starts it as a TPU host, whose workers look for the TPU.

    Two settings make a restart faster, since starting nodes is most of it:
    - no log monitor: it would only stream worker output to Ray drivers, and workers
      ship their log lines to the controller themselves; one Python process (about 1 s
      of CPU) less per host;
    - the raylet starts its Python worker (one per CPU: one) while it registers, so the
      host's worker actor finds a process that has imported Ray already.
    """
    label_arg = ",".join(f"{k}={v}" for k, v in labels.items())
    proc = _ray_start(home, [f"--address={address}", f"--num-cpus={num_cpus}", "--include-log-monitor=False",
                             f"--resources={json.dumps(resources)}", f"--labels={label_arg}"], log_path,
                      env={"RAY_enable_worker_prestart": "1", **(stand_in_env() if stand_in else {})})
    return proc.pid


def stop_cluster(home: Home) -> bool:
    """Stop the recorded head (the caller releases slices first); False if none ran."""
    info = read_cluster(home)
    if info is None:
        return False
    stop_group(home, info.pgid, grace_s=10.0)
    home.cluster_file.unlink(missing_ok=True)
    return True
