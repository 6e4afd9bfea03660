"""The hosts' environment, built from this machine's installation in a second: an emulated TPU VM's image,
and the clean environment preflight checks a program's imports in (`orchestrator.user.preflight`).

A real VM's startup script makes a venv and pip-installs the worker requirements into it
(`orchestrator.providers.startup`): it then has the hosts' closure (`worker_env.host_closure`),
what ``python -m venv`` seeds (pip), and nothing else of the machine that submitted the job.
Installing jax and ray for every test would take minutes; this builds the same set of
importable distributions from the ones installed here: a venv (no pip install) whose
site-packages holds symbolic links to exactly those distributions' files. A package outside
the closure then fails to import on an emulated VM as it would on GCP, and Ray's runtime-env
pip install works on top of it (Ray copies the venv, links and all, and pip installs into the copy
beside the pinned links without touching them).

Built once per machine and interpreter under ``$XDG_CACHE_HOME/tpu-orchestrator`` (default
``~/.cache``), keyed by the interpreter and every distribution's name, version and place; a
changed environment gets a new image. A VM mounts it read-only, and the folders its links point
into read-only too (`sources`), so nothing in a VM can write to this machine's installation.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path, PurePosixPath

from orchestrator.providers.worker_env import host_closure, normalized

FORMAT = 1  # bump when the layout below changes
SEEDED = ("pip",)  # what `python -m venv` puts in every venv, the startup script's included
PY = f"python{sys.version_info.major}.{sys.version_info.minor}"


@dataclass(frozen=True)
class Image:
    root: Path  # a venv: bin/python, lib/pythonX.Y/site-packages
    sources: tuple[Path, ...]  # the folders its links point into (this machine's site-packages)

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    @property
    def site_packages(self) -> Path:
        return self.root / "lib" / PY / "site-packages"


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tpu-orchestrator"


def _distributions() -> dict[str, metadata.Distribution]:
    dists = dict(host_closure())
    for name in SEEDED:
        try:
            dists.setdefault(normalized(name), metadata.distribution(name))
        except metadata.PackageNotFoundError:
            pass
    return dists


def _site(dist: metadata.Distribution) -> Path:
    return Path(str(dist.locate_file(""))).resolve()


def _files(dist: metadata.Distribution) -> list[PurePosixPath]:
    """The files of `dist` inside its site directory, relative to it (its scripts in bin/ are not)."""
    listed = [PurePosixPath(str(f)) for f in dist.files or []]
    info = PurePosixPath(Path(str(getattr(dist, "_path", ""))).name)
    inside = [f for f in listed if f.parts and f.parts[0] != ".."]
    return inside or [info]


@functools.cache
def worker_image() -> Image:
    """The image, built if this machine has none for this environment yet."""
    dists = _distributions()
    sites = sorted({_site(d) for d in dists.values()})
    key = hashlib.sha256("\n".join([
        str(FORMAT), os.path.realpath(sys._base_executable), sys.version,  # type: ignore[attr-defined]
        *sorted(f"{n}=={d.version}@{_site(d)}" for n, d in dists.items())]).encode()).hexdigest()[:16]
    root = _cache_dir() / f"worker-image-{key}"
    if (root / "complete").exists():
        return Image(root, tuple(sites))
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}-", dir=root.parent))
    try:
        shutil.rmtree(tmp)
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp)], check=True, capture_output=True)
        site_packages = tmp / "lib" / PY / "site-packages"
        for site in sites:
            chosen = [d for d in dists.values() if _site(d) == site]
            _link(site, chosen, site_packages)
        ray = tmp / "bin" / "ray"  # the console script pip would have written
        ray.write_text("#!/opt/tpu-orchestrator/venv/bin/python\nimport sys\nfrom ray.scripts.scripts import main\n"
                       "sys.exit(main())\n")
        ray.chmod(0o755)
        (tmp / "complete").write_text("\n".join(f"{n}=={d.version}" for n, d in sorted(dists.items())) + "\n")
        try:
            tmp.rename(root)
        except OSError:  # another process built it first
            if not (root / "complete").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return Image(root, tuple(sites))


def _link(site: Path, chosen: list[metadata.Distribution], target: Path) -> None:
    """Links in `target` to the files of `chosen`, all in `site`: a folder whose every file is theirs is one
    link; a folder they share with other distributions there (a namespace such as ``google``) is made, and
    only their own entries in it are linked."""
    chosen_names = {d.metadata["Name"] for d in chosen}
    foreign: set[tuple[str, ...]] = set()  # every path, and every folder above one, of another distribution
    for d in metadata.distributions(path=[str(site)]):
        if d.metadata["Name"] in chosen_names:
            continue
        for f in _files(d):
            foreign.update(f.parts[:i] for i in range(1, len(f.parts) + 1))
    tree: dict = {}
    for d in chosen:
        for f in _files(d):
            node = tree
            for part in f.parts:
                node = node.setdefault(part, {})

    def place(node: dict, rel: tuple[str, ...]) -> None:
        for name, below in node.items():
            path = rel + (name,)
            source = site.joinpath(*path)
            if not source.exists() or name == "__pycache__":
                continue
            if path not in foreign or not below or not source.is_dir():
                (target.joinpath(*path)).symlink_to(source)
            else:
                target.joinpath(*path).mkdir()
                place(below, path)

    place(tree, ())
