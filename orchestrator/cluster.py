"""The embedded local Ray cluster: where it lives on disk, how to start, reach and stop it.

Everything the tool keeps is under one state directory (`Home`): ``$ORCHESTRATOR_HOME``,
default ``~/.tpu-orchestrator``. The head node and every local "TPU host" node are
``ray start --block`` processes, each in its own process group so that one signal
removes a node whole (that is also how tests make a host vanish). All of them listen
on 127.0.0.1 only and require Ray's token authentication; the token is a file in the
state directory, readable by its owner only.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import json
import logging
import os
import random
import secrets
import signal
import socket
import stat
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from orchestrator.errors import ClusterError

log = logging.getLogger(__name__)

NAMESPACE = "tpu-orchestrator"
CONTROLLER_NAME = "controller"
CONTROLLER_RESOURCE = "orchestrator-controller"  # only the head has it: the controller never lands on a slice


@dataclass(frozen=True)
class Home:
    """The state directory and the paths inside it."""

    root: Path

    @classmethod
    def default(cls) -> "Home":
        root = os.environ.get("ORCHESTRATOR_HOME") or str(Path.home() / ".tpu-orchestrator")
        return cls(Path(root).expanduser().resolve())

    def ensure(self) -> "Home":
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        for sub in ("jobs", "checkpoints", "logs", "jax-cache"):
            (self.root / sub).mkdir(exist_ok=True)
        return self

    @property
    def db(self) -> Path:
        return self.root / "state.db"

    @property
    def cluster_file(self) -> Path:
        return self.root / "cluster.json"

    @property
    def token_file(self) -> Path:
        return self.root / "auth_token"

    @property
    def compile_cache(self) -> Path:
        return self.root / "jax-cache"

    def job_dir(self, job_id: str) -> Path:
        return _inside(self.root / "jobs", job_id)

    def default_checkpoint_dir(self, job_name: str) -> Path:
        return _inside(self.root / "checkpoints", job_name)


def _inside(parent: Path, name: str) -> Path:
    """`parent/name`, refusing any name that would step outside `parent`."""
    path = (parent / name).resolve()
    if path.parent != parent.resolve() or name in ("", ".", ".."):
        raise ValueError(f"{name!r} would escape {parent}")
    return path


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
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def ensure_token(home: Home) -> None:
    """Make the cluster's token if there is none; refuse a state directory or token others can touch."""
    home.ensure()
    check_private(home)
    if home.token_file.exists():
        return
    fd = os.open(home.token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))


def check_private(home: Home) -> None:
    """The state directory holds the cluster's token and the job store: only its owner may change it.

    Refused (ClusterError): a directory of another user or writable by others, and a token
    file that is a link, another user's, or readable by others (whoever read it controls the
    cluster: make a new one by removing it). A directory others may only read gets a warning.
    """
    st = os.stat(home.root)
    if st.st_uid != os.getuid():
        raise ClusterError(f"the state directory {home.root} belongs to another user (uid {st.st_uid})")
    if st.st_mode & 0o022:
        raise ClusterError(f"the state directory {home.root} is writable by others (mode {st.st_mode & 0o777:o}); "
                           f"run: chmod 700 {home.root}")
    if st.st_mode & 0o077 and not getattr(check_private, "_warned", False):
        check_private._warned = True  # once per process
        log.warning("the state directory %s can be read by others (mode %o); chmod 700 keeps job logs private",
                    home.root, st.st_mode & 0o777)
    try:
        tok = os.lstat(home.token_file)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(tok.st_mode) or not stat.S_ISREG(tok.st_mode):
        raise ClusterError(f"{home.token_file} is not a regular file; remove it and a new token is made")
    if tok.st_uid != os.getuid() or tok.st_mode & 0o077:
        raise ClusterError(f"{home.token_file} can be read by others (mode {tok.st_mode & 0o777:o}): whoever read "
                           "it can control the cluster. Remove it (stop the cluster first: a new token is made "
                           f"at the next start), or if you trust everyone who could read it: chmod 600 {home.token_file}")


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


def _ray_start(home: Home, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    ensure_token(home)
    env = {**os.environ, **ray_env(home), **(env or {}), _MARK_ENV: node_mark(home)}
    for key in list(env):  # a fresh environment: nothing left over from an earlier slice
        if key.startswith(("MEGASCALE_", "TPU_", "JAX_COORDINATOR")):
            del env[key]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    out = open(log_path, "ab")
    try:
        cmd = [sys.executable, "-m", "orchestrator.raynode", "start", "--block", "--disable-usage-stats",
               "--node-ip-address=127.0.0.1", "--object-store-memory", str(128 * 1024 * 1024),
               f"--dashboard-agent-listen-port={free_port()}", f"--metrics-export-port={free_port()}",
               f"--runtime-env-agent-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
               f"--node-manager-port={free_port()}", f"--object-manager-port={free_port()}",
               # Workers bind a port the kernel assigns: every node's workers share Ray's default
               # range on this one machine, and two nodes could hand out the same port.
               "--min-worker-port=0", "--max-worker-port=0", *args]
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
    proc = _ray_start(home, ["--head", f"--port={port}", "--dashboard-host=127.0.0.1",
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
                    log_path: Path, num_cpus: int = 1) -> int:
    """Add one node to the cluster; returns its process group id.

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
                      env={"RAY_enable_worker_prestart": "1"})
    return proc.pid


def _session(sid: int) -> list[int]:
    """Every live process of a node's session.

    A node is started as a new session; Ray gives each worker process its own process
    group inside it, so the session, not the group, is what dies with a host.
    """
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        state, session = fields[0], int(fields[3])
        if session == sid and state != "Z":
            pids.append(int(entry))
    return pids


def group_alive(pgid: int) -> bool:
    """Whether any process of the node started as session `pgid` is still running."""
    return bool(_session(pgid))


# A process id written down earlier (in state.db or cluster.json) may belong to another
# program by now: after a crash or a reboot the kernel hands the number out again. So a
# recorded session is ours only while one of its processes carries this home's node mark
# in its environment: every node this tool starts gets it (the raylet, its agents and its
# workers inherit it), nothing else does, and a process cannot take it on later. The mark
# is derived from the cluster's token, so another state directory's nodes differ too.
_MARK_ENV = "ORCHESTRATOR_NODE_MARK"


def node_mark(home: Home) -> str:
    """The mark in the environment of every node process `home`'s cluster starts (not a secret)."""
    ensure_token(home)
    return hmac.new(home.token_file.read_bytes().strip(), b"orchestrator node", hashlib.sha256).hexdigest()[:32]


def _is_node(pid: int, mark: bytes, home_entry: bytes) -> bool:
    """Whether process `pid` carries the node mark, or is a node process of the same state
    directory started before nodes carried one (its command line and ORCHESTRATOR_HOME say so)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
        if mark in env:
            return True
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"orchestrator.raynode" in f.read().split(b"\0") and home_entry in env
    except OSError:  # gone, or not ours to read
        return False


def session_is_ours(home: Home, sid: int) -> bool:
    """Whether session `sid` is alive and is a node of `home`'s cluster (see `node_mark`)."""
    mark, home_entry = f"{_MARK_ENV}={node_mark(home)}".encode(), f"ORCHESTRATOR_HOME={home.root}".encode()
    return any(_is_node(pid, mark, home_entry) for pid in _session(sid))


def _signal_session(sid: int, sig: int) -> None:
    for pid in _session(sid):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def stop_group(home: Home, pgid: int, *, grace_s: float = 5.0, hard: bool = False) -> list[int]:
    """Stop every process of a node (its session): SIGTERM, then SIGKILL after `grace_s` (or at once).

    ``hard=True`` is a host vanishing: raylet, agents and workers get SIGKILL together.
    Returns the ids left alone, as `stop_groups` does.
    """
    return stop_groups(home, [pgid], grace_s=grace_s, hard=hard)


def stop_groups(home: Home, pgids: list[int], *, grace_s: float = 5.0, hard: bool = False) -> list[int]:
    """`stop_group` for several nodes at once: all are signalled first, then waited for together.

    Only sessions that are `home`'s nodes are signalled (`session_is_ours`); a recorded id
    whose processes are another program's now is left alone, logged, and returned.
    """
    ours, foreign = [], []
    for pgid in pgids:
        if session_is_ours(home, pgid):
            ours.append(pgid)
        elif group_alive(pgid):
            foreign.append(pgid)
    for pgid in foreign:
        log.warning("left process group %d alone: it is recorded as a node of ours, but its processes do not "
                    "carry this cluster's node mark (the id was reused by another program)", pgid)
    for pgid in ours:
        _signal_session(pgid, signal.SIGKILL if hard else signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(group_alive(p) for p in ours):
        for pgid in ours:
            _reap(pgid)
        time.sleep(0.1)
    for pgid in ours:
        if group_alive(pgid):
            _signal_session(pgid, signal.SIGKILL)
        _reap(pgid)
    return foreign


def kill_host(home: Home, pgid: int) -> None:
    """A host vanishing: every process of the node, SIGKILL, at once (fault injection; ours only)."""
    if not session_is_ours(home, pgid):
        raise ClusterError(f"process group {pgid} is not a node of the cluster in {home.root}")
    _signal_session(pgid, signal.SIGKILL)


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def stop_cluster(home: Home) -> bool:
    """Stop the recorded head (the caller releases slices first); False if none ran."""
    info = read_cluster(home)
    if info is None:
        return False
    stop_group(home, info.pgid, grace_s=10.0)
    home.cluster_file.unlink(missing_ok=True)
    return True
