"""The state directory (`Home`): where the tool keeps its token, its store, logs and checkpoints.

``$ORCHESTRATOR_HOME``, default ``~/.tpu-orchestrator``, owned by one user and closed to
others: it holds the cluster's token, and whoever reads that controls the cluster.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

from orchestrator.errors import ClusterError

log = logging.getLogger(__name__)
_warned_readable = False  # the state directory can be read by others: said once per process


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

    @property
    def tpu_programs(self) -> Path:
        """The TPU compiler's reports kept by `--compile` (`workers.tpu_target.keep_report`), which the
        controller's cost policy reads as priors (`orchestrator.control.priors`)."""
        return self.root / "tpu-programs"

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
    global _warned_readable
    if st.st_mode & 0o077 and not _warned_readable:
        _warned_readable = True
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
                           "at the next start), or if you trust everyone who could read it: "
                           f"chmod 600 {home.token_file}")


def node_mark(home: Home) -> str:
    """The mark in the environment of every node process `home`'s cluster starts (not a secret)."""
    ensure_token(home)
    return hmac.new(home.token_file.read_bytes().strip(), b"orchestrator node", hashlib.sha256).hexdigest()[:32]
