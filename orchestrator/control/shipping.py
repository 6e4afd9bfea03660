"""The code a job's hosts run goes with the job: the project's worker packages and the user's folder.

A TPU VM has what its startup script installed (Ray, JAX, orbax, ... at the versions
pinned in `orchestrator.providers.startup.worker_requirements`) and nothing of the
machine that submitted the job. So every launch hands its workers a Ray runtime
environment, the mechanism Ray users already know:

- ``py_modules``: `workers`, `kernels` and `policies` exactly as the controller runs them,
  each a content-addressed package in Ray's GCS store, unpacked once per node;
- ``working_dir``: an entrypoint job's folder, packed when the job is submitted (the folder
  may be gone by the time a slice is ready, or hours later at a preemption), kept in the
  job's state directory and uploaded again whenever Ray has dropped it (Ray frees a package
  no actor references, and a restarted cluster starts with an empty store).

- ``pip``: the packages an entrypoint job's folder names in its ``requirements.txt``
  (`orchestrator.domain.requirements`), installed on every host on top of the hosts' own, with
  every package of the hosts' closure pinned at its version here (`worker_env.pins`), so a user's
  package cannot move jax, ray or orbax: pip refuses the job's environment instead. The file
  travels inside the packed folder, so each launch finds it where it finds the folder.

A job's folder is shipped the same way on every provider. The project's packages are shipped to
hosts that do not share this machine's installation (gcp); the local provider's hosts are
processes of this machine and import the installed project.
"""

from __future__ import annotations

import functools
import logging
import os
import tempfile
import zipfile
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path

from orchestrator.domain import requirements
from orchestrator.errors import SpecError

log = logging.getLogger(__name__)

PROJECT_PACKAGES = ("workers", "kernels", "policies")  # what hosts import; `workers` imports no `orchestrator`
# policies/evaluation/traces: the simulator's data, not the hosts'
PROJECT_EXCLUDES = ["__pycache__", "*.pyc", "traces/"]

# Never part of a job's code: version control, environments, caches, data and checkpoints
# (which belong in object storage). A .gitignore or .rayignore in the folder is honoured too.
FOLDER_EXCLUDES = [".git", ".hg", ".svn", "__pycache__", "*.pyc", ".venv*", "venv", "env", ".tox", ".nox",
                   ".mypy_cache", ".pytest_cache", ".ruff_cache", "node_modules", "data", "checkpoints",
                   "*.orbax-checkpoint-tmp*", "wandb", "*.safetensors", "*.ckpt", "*.npz"]
MAX_FOLDER_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class Package:
    """A packed folder: Ray's content-addressed URI (``gcs://_ray_pkg_<sha1>.zip``) and the zip itself."""

    uri: str
    data: bytes
    files: int


def pack_folder(folder: str | Path, *, source: str = "<spec>", limit: int = MAX_FOLDER_BYTES) -> Package:
    """Pack a job's folder for its hosts; `SpecError` naming the folder if it is missing or too big.

    The size is checked before anything is zipped, on the files that would be shipped.
    """
    from ray._private.runtime_env.packaging import _dir_travel, _get_excludes, create_package, get_uri_for_package

    folder = Path(folder).resolve()
    if not folder.is_dir():
        raise SpecError(source, [("workdir", f"the job's folder {folder} is not a directory")])
    if problems := requirement_problems(folder):
        raise SpecError(source, problems)
    sizes: list[int] = []
    _dir_travel(folder, [_get_excludes(folder, FOLDER_EXCLUDES)],
                lambda p: sizes.append(p.stat().st_size) if p.is_file() else None, include_gitignore=True,
                logger=log)
    total = sum(sizes)
    if total > limit:
        raise SpecError(source, [("workdir", f"the job's folder {folder} holds {_mib(total)} to ship to every host "
                                             f"(limit {_mib(limit)}): keep data and checkpoints in object storage, "
                                             f"or list large files in a .gitignore or .rayignore there")])
    with tempfile.TemporaryDirectory(prefix="tpu-orchestrator-pack-") as tmp:
        target = Path(tmp) / "code.zip"
        create_package(str(folder), target, include_gitignore=True, excludes=FOLDER_EXCLUDES, logger=log)
        return Package(uri=get_uri_for_package(target), data=target.read_bytes(), files=len(sizes))


def requirement_problems(folder: Path) -> list[tuple[str, str]]:
    """What is wrong with the folder's ``requirements.txt``: lines that are no package by name, and
    packages of the hosts' own whose pinned version a line excludes (pip would refuse it on every host)."""
    from orchestrator.providers.worker_env import host_closure, normalized

    reqs, problems = requirements.read(folder)
    hosts = host_closure()
    for req in reqs:
        dist = hosts.get(normalized(req.name))
        if dist is not None and req.specifier and not req.specifier.contains(dist.version, prereleases=True):
            problems.append((requirements.FIELD, f"{req} excludes {dist.metadata['Name']} {dist.version}, the "
                                                 f"version every host has (the project's constraints.txt); leave "
                                                 f"it out, or allow that version"))
    return problems


def job_requirements(package: Package) -> list[str]:
    """The requirement lines of a packed folder's ``requirements.txt`` (checked when it was packed)."""
    with zipfile.ZipFile(BytesIO(package.data)) as z:
        try:
            text = z.read(requirements.FILE).decode()
        except KeyError:
            return []
    return [str(r) for r in requirements.parse(text)[0]]


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


# -- kept by the controller --------------------------------------------------------------

def keep(package: Package, job_dir: Path) -> None:
    """Store a job's packed folder in its state directory (written whole, then renamed)."""
    job_dir.mkdir(parents=True, exist_ok=True)
    tmp = job_dir / f".code.zip.tmp-{os.getpid()}"
    tmp.write_bytes(package.data)
    tmp.replace(job_dir / "code.zip")
    (job_dir / "code.uri").write_text(package.uri)


def kept(job_dir: Path) -> Package | None:
    """The job's packed folder, if it has one."""
    uri_file, zip_file = job_dir / "code.uri", job_dir / "code.zip"
    if not (uri_file.exists() and zip_file.exists()):
        return None
    return Package(uri=uri_file.read_text().strip(), data=zip_file.read_bytes(), files=-1)


# -- at each launch -----------------------------------------------------------------------

def runtime_env(job_code: Package | None, *, ship_project: bool = True) -> dict | None:
    """The runtime environment of a job's workers: the project's packages (`ship_project`: hosts that do
    not share this machine's installation), and the job's folder if it has one; None if neither.

    Each package is uploaded to Ray's store if it is not there (any more). A host of the local
    provider is a process of this machine with the project installed; shipping it there would only
    cost each new worker the runtime environment's set-up (and Ray's prestarted worker). For the same
    reason a job's own packages go to a local host through pip only if this machine lacks one of them
    (Ray's pip copies the whole environment first).
    """
    from ray._private.runtime_env.packaging import package_exists, pin_runtime_env_uri, upload_package_to_gcs

    env: dict = {"py_modules": [_project_package(name) for name in PROJECT_PACKAGES]} if ship_project else {}
    if job_code is not None and (wanted := job_requirements(job_code)):
        if ship_project or not satisfied_here(wanted):
            env["pip"] = pip_env(wanted)
        else:  # a local host imports what this machine has installed; Ray would copy the whole environment
            log.info("the job's packages %s are installed here, where its hosts run", ", ".join(wanted))
    if job_code is not None:
        pin_runtime_env_uri(job_code.uri)
        if not package_exists(job_code.uri):
            upload_package_to_gcs(job_code.uri, job_code.data)
            log.info("uploaded the job's folder %s (%d bytes) to the cluster", job_code.uri, len(job_code.data))
        env["working_dir"] = job_code.uri
    return env or None


def pip_env(wanted: list[str]) -> dict:
    """Ray's ``pip`` runtime environment for a job's own packages: installed in a copy of the host's
    environment (Ray clones it), with every package the host already has pinned at its version."""
    from orchestrator.providers.worker_env import pins

    return {"packages": [*wanted, *pins()], "pip_check": False,
            "pip_install_options": ["--disable-pip-version-check", "--no-cache-dir", "--no-input"]}


def satisfied_here(wanted: list[str]) -> bool:
    """Whether this machine's environment already has every requirement of `wanted`, at a version it allows."""
    from importlib import metadata

    from packaging.requirements import Requirement

    for line in wanted:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate():
            continue
        try:
            version = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            return False
        if not req.specifier.contains(version, prereleases=True):
            return False
    return True


def _project_package(name: str) -> str:
    from ray._private.runtime_env.packaging import upload_package_if_needed

    path, uri = project_source(name)
    with tempfile.TemporaryDirectory(prefix="tpu-orchestrator-pack-") as scratch:
        upload_package_if_needed(uri, scratch, str(path), include_gitignore=False, include_parent_dir=True,
                                 excludes=PROJECT_EXCLUDES, logger=log)
    return uri


@functools.cache
def project_source(name: str) -> tuple[Path, str]:
    """Where this process imports package `name` from, and the URI of its contents (the code cannot
    change under a running controller)."""
    import importlib

    from ray._private.runtime_env.packaging import get_uri_for_directory

    source = importlib.import_module(name).__file__
    assert source is not None, f"{name} is a regular package (with its __init__.py), not a namespace one"
    path = Path(source).parent
    return path, get_uri_for_directory(str(path), include_gitignore=False, excludes=PROJECT_EXCLUDES)
