"""An emulated TPU VM: the provider's startup script, run on this machine as a host that shares nothing with it.

A real TPU VM is a fresh machine: it has what its image and startup script give it and none
of the submitting machine's files, and its disk goes with it. Here each VM is one process
tree in namespaces of its own (this machine runs as root, so `unshare` can make them):

- a mount namespace where this machine's state lies under empty tmpfs mounts: /tmp and
  /var/tmp (the tests' folders and Ray's session directories), /var/log and /opt (the VM's
  own disk), the home directory (~/.ray, the default state directory), the orchestrator's
  state directory, the project's sources, and any folder the caller names. What stays is the
  VM's image: the Python interpreter, and at the startup script's venv path the environment its
  pip install would give a real VM (`orchestrator.providers.worker_image`: the hosts' closure, nothing of
  the submitting environment beyond it; read-only, as are the installed files it links to), and
  the VM's own folder;
- a PID namespace, so ``ray stop`` in the script sees only the VM's processes, and killing
  the VM's first process powers it off: every process in it dies, and with them its tmpfs
  mounts, so whatever the host wrote locally is gone;
- its own fake metadata server (the VM's worker number) and a fake ``gcloud`` that answers
  the Secret Manager lookup of the Ray token;
- unless booted with ``stand_in=False`` (a VM like a real one, without the TPU it claims), the
  declaration that its CPU stands in for its TPU chips (`workers.accelerator.CPU_STAND_IN_ENV`)
  in the environment its startup script, and so its Ray node, starts with.

The image's ``ray`` runs Ray's own command kept on 127.0.0.1 (every emulated VM shares this
machine's network; see `orchestrator.cluster.raynode`).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from orchestrator.cluster import MARK_ENV, Home, node_mark
from orchestrator.cluster.nodes import loopback_node_args
from orchestrator.emulator.metadata import FakeMetadataServer
from orchestrator.providers.worker_image import Image, worker_image
from workers.accelerator import stand_in_env

log = logging.getLogger(__name__)

PROJECT_PACKAGES = ("orchestrator", "workers", "kernels", "policies")
IMAGE_VENV = "/opt/tpu-orchestrator/venv"  # `WorkerSetup.venv`: the startup script finds it installed


def project_sources() -> list[Path]:
    """Where this machine has the project: the checkout of an editable install, else each package's folder."""
    paths = []
    for name in PROJECT_PACKAGES:
        package = _module_file(name).parent
        checkout = package.parent
        paths.append(checkout if (checkout / "pyproject.toml").exists() else package)
    return paths


def _module_file(name: str) -> Path:
    """The file module `name` of this installation is imported from (a package's __init__.py)."""
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.origin is not None, f"{name} is a module of this installation"
    return Path(spec.origin)


def hidden_paths(home: Home, extra: Sequence[Path] = ()) -> list[Path]:
    """What a VM must not see of this machine, parents first."""
    paths = {Path("/tmp"), Path("/var/tmp"), Path("/var/log"), Path("/opt"), Path.home(), home.root,
             *project_sources(), *(Path(p) for p in extra)}
    return sorted({p.resolve() for p in paths}, key=lambda p: len(p.parts))


class EmulatedVm:
    """One host of an emulated slice, from boot (`start`) to power-off (`kill`)."""

    def __init__(self, home: Home, name: str, worker_id: int, startup_script: str, *, log_path: Path,
                 secrets: dict[str, str] | None = None, hide: Sequence[Path] = (), stand_in: bool = True):
        self.home, self.name, self.worker_id = home, name, worker_id
        self.stand_in = stand_in
        self.log_path = log_path
        self.dir = Path(tempfile.mkdtemp(prefix=f"tpu-vm-{name}-{worker_id}-", dir="/var/tmp"))
        self.metadata = FakeMetadataServer()
        self.metadata.values["instance/attributes/agent-worker-number"] = str(worker_id)
        self.image = worker_image()
        self._write_image(startup_script, secrets or {})
        self.proc = self._boot(hidden_paths(home, list(hide)))

    # -- the VM's own folder: its startup script, its ray command, its gcloud --------------

    def _write_image(self, startup_script: str, secrets: dict[str, str]) -> None:
        d = self.dir
        (d / "startup.sh").write_text(startup_script)
        shutil.copyfile(_module_file("orchestrator.cluster.raynode"), d / "raynode.py")
        (d / "bin").mkdir()
        q = shlex.quote
        node_args = " ".join(q(a) for a in [*loopback_node_args(), "--num-cpus=1", "--include-log-monitor=False"])
        _executable(d / "ray", f"""#!/bin/sh
# This image's `ray`: Ray's own command, its nodes kept on 127.0.0.1.
if [ "$1" = start ]; then shift; exec {IMAGE_VENV}/bin/python {q(str(d / "raynode.py"))} start {node_args} "$@"; fi
exec {IMAGE_VENV}/bin/python {q(str(d / "raynode.py"))} "$@"
""")
        secret_dir = d / "secrets"
        secret_dir.mkdir(mode=0o700)
        for secret, value in secrets.items():
            (secret_dir / secret).write_text(value)
            (secret_dir / secret).chmod(0o600)
        _executable(d / "bin" / "gcloud", f"""#!/bin/sh
# Secret Manager as this VM's service account sees it (only what the startup script asks for).
case "$1 $2 $3 $4" in
  "secrets versions access latest") exec cat {q(str(secret_dir))}/"${{5#--secret=}}" ;;
  *) echo "gcloud (emulated VM): $*: not supported" >&2; exit 2 ;;
esac
""")

    def _boot(self, hidden: list[Path]) -> subprocess.Popen:
        q = shlex.quote
        # (what, where the VM sees it, read-only), parents before what lies inside them
        base = Path(sys.base_prefix).resolve()
        kept = sorted({(base, base, True), *((p, p, True) for p in _image_sources(self.image)),
                       (self.dir, self.dir, False), (self.image.root, Path(IMAGE_VENV), True)},
                      key=lambda k: len(k[1].parts))
        boot = "\n".join([
            "set -euo pipefail",
            "mount -t tmpfs tmpfs /mnt",  # the image's parts are held here while the rest is hidden
            *(f"mkdir /mnt/{i}; mount --bind {q(str(k))} /mnt/{i}" for i, (k, _, _) in enumerate(kept)),
            *(f"if [ -d {q(str(p))} ]; then mount -t tmpfs -o mode=1777 tmpfs {q(str(p))}; fi" for p in hidden),
            *(f"mkdir -p {q(str(at))}; mount --bind /mnt/{i} {q(str(at))}; umount /mnt/{i}"
              + (f"; mount -o remount,bind,ro {q(str(at))}" if ro else "") for i, (_, at, ro) in enumerate(kept)),
            "umount /mnt",
            f"mount --bind {q(str(self.dir / 'ray'))} {IMAGE_VENV}/bin/ray",  # this VM's own ports
            "mount -t proc proc /proc",  # the VM's own processes only
            "cd /",
            f"bash {q(str(self.dir / 'startup.sh'))} && rc=0 || rc=$?",
            "cat /var/log/tpu-orchestrator-startup.log 2>/dev/null || true",
            'if [ "$rc" -ne 0 ]; then echo "startup script failed ($rc)"; exit "$rc"; fi',
            f"touch {q(str(self.dir / 'booted'))}",  # seen from outside: the VM's own folder is this one
            "trap '' TERM",
            "while :; do sleep 3600 & wait $! || true; done",  # the VM's first process: it reaps orphans
        ])
        env = {
            "PATH": f"{self.dir / 'bin'}:{IMAGE_VENV}/bin:"
                    "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": str(Path.home()), "LANG": "C.UTF-8",
            "GCE_METADATA_HOST": self.metadata.url.removeprefix("http://").split("/")[0],
            "RAY_USAGE_STATS_ENABLED": "0", "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
            "RAY_enable_worker_prestart": "1",
            MARK_ENV: node_mark(self.home),  # `orchestrator down` finds a VM a crashed test left behind
            **(stand_in_env() if self.stand_in else {}),
        }
        if os.environ.get("RAY_AUTH_MODE") == "disabled":
            env["RAY_AUTH_MODE"] = "disabled"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            return subprocess.Popen(["unshare", "--mount", "--pid", "--fork", "--kill-child=SIGKILL",
                                     "--propagation", "private", "bash", "-c", boot],
                                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                    start_new_session=True)

    # -- life --------------------------------------------------------------------------------

    def alive(self) -> bool:
        return self.proc.poll() is None and not self.silenced

    silenced = False  # powered off silently (`silence`): its processes frozen until `kill` ends them

    def booted(self) -> bool:
        """Its startup script ended well (and the VM still runs)."""
        return self.alive() and (self.dir / "booted").exists()

    def silence(self) -> None:
        """Power the VM off as a host that just stops: every process in it frozen (SIGSTOP), so its peers
        see silence, not a reset. `kill` (the slice released) ends them.

        A VM killed outright closes its sockets: the kernel answers every peer with a reset and new
        connections are refused, so collectives fail at once. A real host that loses power or panics
        sends nothing; its peers' collectives and connections just wait. Frozen processes do the same:
        established connections stay open and get no answer, and a new connection to a port it listens
        on is accepted by the kernel (the listen backlog) but never answered."""
        self.silenced = True
        for _ in range(3):  # a process forked while the others were being stopped is caught the next round
            for pid in _in_namespace_of(_children(self.proc.pid)):
                try:
                    os.kill(pid, signal.SIGSTOP)
                except ProcessLookupError:
                    pass

    def kill(self) -> None:
        """Power the VM off: its first process dies, and the kernel kills every other one in it."""
        for pid in _children(self.proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.kill()
            self.proc.wait(timeout=10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            log.warning("emulated VM %s-%d: unshare did not exit", self.name, self.worker_id)
        self.metadata.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def _image_sources(image: Image) -> list[Path]:
    """The installed folders the image links into: kept visible to the VM (read-only), and nothing else of
    this machine's environment."""
    return [p for p in image.sources if not any(p != q and q in p.parents for q in image.sources)]


def _in_namespace_of(pids: list[int]) -> list[int]:
    """Every process in the PID namespaces of `pids` (the VM's first process: every process of the VM)."""
    spaces = set()
    for pid in pids:
        try:
            spaces.add(os.readlink(f"/proc/{pid}/ns/pid"))
        except OSError:
            pass
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.readlink(entry / "ns" / "pid") in spaces:
                    out.append(int(entry.name))
            except OSError:
                continue
    return out


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (FileNotFoundError, ProcessLookupError, ValueError):
        return []


def _executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)
