"""The packages a job's hosts have: the closure of the worker requirements, at this machine's versions.

A TPU VM's startup script (`orchestrator.providers.startup`) installs `WORKER_DISTRIBUTIONS` and,
through pip, everything they require, recursively: the hosts' *closure*. It is pinned to the
versions installed here (the project's constraints.txt), so a host unpickles what the controller
sends and a user's package cannot move jax, ray or orbax (`pins` travel with a job's own
packages, `orchestrator.control.shipping`).

The closure is read from the installed distributions' metadata, with the extras each
requirement asks for and the markers evaluated for this interpreter; a distribution it names
that is not installed here (``libtpu`` without ``[tpu]``) is left out: what is not here cannot
be pinned.
"""

from __future__ import annotations

import functools
from importlib import metadata

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# What the hosts import from outside the project (`workers`, `kernels` and `policies` are
# shipped with every job, see `orchestrator.control.shipping`): the distributions, with the
# extras a TPU VM needs.
WORKER_DISTRIBUTIONS = {
    "ray": "ray[default]", "jax": "jax[tpu]", "jaxlib": "jaxlib", "orbax-checkpoint": "orbax-checkpoint",
    "absl-py": "absl-py", "optax": "optax", "numpy": "numpy", "etils": "etils[epath]", "fsspec": "fsspec",
    "gcsfs": "gcsfs",
    "google-cloud-storage": "google-cloud-storage", "safetensors": "safetensors", "pydantic": "pydantic",
}


def _requires(dist: metadata.Distribution, extras: frozenset[str]) -> list[Requirement]:
    """The requirements of `dist` that apply here with `extras` asked for."""
    out = []
    for line in dist.requires or []:
        req = Requirement(line)
        if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in (extras or {""})):
            out.append(req)
    return out


def closure(requirements: tuple[str, ...]) -> dict[str, metadata.Distribution]:
    """Every installed distribution `requirements` need, recursively, by canonical name."""
    found: dict[str, metadata.Distribution] = {}
    asked: dict[str, set[str]] = {}
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        extras = set(req.extras)
        if name in found and extras <= asked[name]:
            continue
        try:
            dist = found.get(name) or metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        found[name] = dist
        asked[name] = asked.get(name, set()) | extras
        todo.extend(_requires(dist, frozenset(asked[name])))
    return found


@functools.cache
def host_closure() -> dict[str, metadata.Distribution]:
    """The distributions a host of any slice has (what the startup script's pip install gives it)."""
    return closure(tuple(WORKER_DISTRIBUTIONS.values()))


def pins() -> tuple[str, ...]:
    """``name==version`` of every distribution of the hosts' closure, sorted by name."""
    return tuple(f"{name}=={dist.version}" for name, dist in sorted(host_closure().items()))


def normalized(name: str) -> str:
    """A distribution's or module's name as pip compares them (``Foo_Bar`` -> ``foo-bar``)."""
    return canonicalize_name(name)
