"""Executables compiled off the hosts, kept in the job's storage, and selected by the hosts of their shape.

While a job trains, the controller's machine compiles the train step for the shapes the job
is likely to need next (`orchestrator.control.compile_ahead`): for a TPU slice with XLA's TPU
compiler and a topology (`workers.tpu_target`), for CPU stand-in hosts with a rehearsal of
their runtime (`workers.ahead.rehearse`). Each program goes to the job's storage (its
checkpoint folder: a local folder, or the bucket on gcp) as one object:

    <checkpoint dir>/programs/<stored id>/<target slug>.sealed

- *stored id* (`stored_id`): what the program is, known on any machine without tracing it:
  its name and config (`workers.train.program_config`), the code that builds it, and the
  compiler flags in the environment. `programs.program_id` adds the runtime's own devices and
  JAX flags, which only a host has; here the target and the versions in the header stand for them.
- *target* (`target_name`): the shape the program was compiled for, ``v4:2x2x2/2h/1s`` (a TPU
  topology, hosts a slice, slices) or ``cpu:4/2h/1s`` (CPU devices a host stands in with).
- the object is a header (JSON: target, versions) and the executable as `programs.keep_program`
  keeps it, sealed with an HMAC under the job's program key over its place and bytes. The key
  is the controller's, one per job, handed to each launch over Ray's authenticated channel as
  the launch's key is (`runtime.initialize`): a blob that does not open was not written by the
  controller (or was moved or altered), and is refused, since loading one unpickles it.

A host selects the object of its own stored id and target (`select`), checks that it was made
by its JAX, jaxlib and libtpu, and keeps it in its executable cache under its own program id
(`take`), where `programs.compile_keyed` finds it as any kept program: process 0 decides for
the runtime, so every process loads the same executable or all compile. Anything else (none
stored for its shape, another version, a bad seal, an executable its runtime does not load:
`loaded`) leaves it to compile, and `Lookup` says why.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import logging
import os
from importlib import metadata

from workers import storage
from workers.order import StoredPrograms

log = logging.getLogger(__name__)

FOLDER = "programs"
_SUFFIX = ".sealed"
_MAC_BYTES = 32
_COMPILER_ENV = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")  # and the KERNELS_* switches of kernels.dispatch


def target_name(chip: str, layout: str, hosts: int, slices: int) -> str:
    """The shape a program is compiled for: ``v4:2x2x2/2h/1s`` (`chip` a TPU generation, `layout` its
    topology) or ``cpu:4/2h/1s`` (`layout`: the CPU devices each host stands in with)."""
    return f"{chip}:{layout}/{hosts}h/{slices}s"


def _slug(target: str) -> str:
    return target.replace(":", "-").replace("/", "-")


@dataclasses.dataclass(frozen=True)
class Versions:
    """The builds an executable is bound to: a host loads only what its own made."""

    jax: str
    jaxlib: str
    libtpu: str  # "none" where it is not installed

    @classmethod
    def here(cls) -> Versions:
        import jax
        import jaxlib

        try:
            libtpu = metadata.version("libtpu")
        except metadata.PackageNotFoundError:
            libtpu = "none"
        return cls(jax.__version__, jaxlib.__version__, libtpu)

    def differs(self, other: Versions, *, tpu: bool) -> str | None:
        """What of `other` (the maker's) is not this (the host's), or None; libtpu counts only for a TPU."""
        names = ("jax", "jaxlib", "libtpu") if tpu else ("jax", "jaxlib")
        diff = [f"{n} {getattr(other, n)} (this host: {getattr(self, n)})" for n in names
                if getattr(self, n) != getattr(other, n)]
        return ", ".join(diff) or None


def stored_id(name: str, config: dict) -> str:
    """What program `name` of `config` is, the same on the controller's machine and on every host."""
    from workers import programs as executables

    env = sorted((k, v) for k, v in os.environ.items() if k in _COMPILER_ENV or k.startswith("KERNELS_"))
    h = hashlib.sha256(json.dumps([name, config], sort_keys=True, default=repr).encode())
    h.update(repr((executables._code_digest(), env)).encode())
    return h.hexdigest()


def path_of(directory: str, sid: str, target: str) -> str:
    return storage.join(directory, FOLDER, sid, _slug(target) + _SUFFIX)


def _mac(key: bytes, place: str, payload: bytes) -> bytes:
    return hmac.new(key, place.encode() + b"\0" + payload, hashlib.sha256).digest()


def seal(key: bytes, sid: str, target: str, payload: bytes) -> bytes:
    """`payload` sealed for its place (stored id and target): moved to another, it no longer opens."""
    return _mac(key, f"{sid}/{_slug(target)}", payload) + payload


def open_seal(key: bytes, sid: str, target: str, sealed: bytes) -> bytes | None:
    mac, payload = sealed[:_MAC_BYTES], sealed[_MAC_BYTES:]
    ok = len(mac) == _MAC_BYTES and hmac.compare_digest(mac, _mac(key, f"{sid}/{_slug(target)}", payload))
    return payload if ok else None


def write(directory: str, sid: str, target: str, kept: bytes, key: bytes, *, versions: Versions | None = None,
          endpoint: str | None = None) -> str:
    """Store `kept` (an executable as `programs.keep_program` keeps it) for `target`, sealed; its path."""
    header = {"target": target, "versions": dataclasses.asdict(versions or Versions.here())}
    path = path_of(directory, sid, target)
    storage.write_bytes(path, seal(key, sid, target, json.dumps(header).encode() + b"\n" + kept), endpoint=endpoint)
    return path


@dataclasses.dataclass(frozen=True)
class Lookup:
    """What a host found in the job's storage for its program and shape: the executable it keeps
    (`kept`), or None and why it compiles."""

    target: str
    kept: bytes | None
    reason: str
    stamp: tuple[int, int] | None = None  # (inode, mtime) of the file `take` kept it in: `loaded` tells if it stayed

    @property
    def used(self) -> bool:
        return self.kept is not None


def select(directory: str, sid: str, target: str, key: bytes, *, endpoint: str | None = None) -> Lookup:
    """The program `sid` for `target` from the job's storage, if this host can use it."""
    path = path_of(directory, sid, target)
    try:
        sealed = storage.read_bytes(path, endpoint=endpoint)
    except FileNotFoundError:
        return Lookup(target, None, _none_for(directory, sid, target, endpoint))
    payload = open_seal(key, sid, target, sealed)
    if payload is None:
        log.warning("refused the program stored at %s: its seal does not match the job's key (altered, or not "
                    "written by the controller); compiling", path)
        return Lookup(target, None, "refused: its seal does not match the job's key")
    head, _, kept = payload.partition(b"\n")
    try:
        header = json.loads(head)
        made = Versions(**header["versions"])
    except (ValueError, KeyError, TypeError) as e:
        return Lookup(target, None, f"unreadable header ({type(e).__name__})")
    if header.get("target") != target:
        return Lookup(target, None, f"compiled for {header.get('target')}, not this host's {target}")
    if (diff := Versions.here().differs(made, tpu=not target.startswith("cpu:"))) is not None:
        return Lookup(target, None, f"compiled by {diff}")
    return Lookup(target, kept, f"stored ahead for {target} ({len(kept) / 2**20:.1f} MiB)")


def _none_for(directory: str, sid: str, target: str, endpoint: str | None) -> str:
    try:
        others = sorted(n[:-len(_SUFFIX)] for n in storage.listdir(storage.join(directory, FOLDER, sid),
                                                                   endpoint=endpoint) if n.endswith(_SUFFIX))
    except (FileNotFoundError, OSError):
        others = []
    if others:
        return f"stored only for other shapes ({', '.join(others)}), not this host's {_slug(target)}"
    return f"none stored for this program on {target}"


def take(programs: StoredPrograms | None, *, endpoint: str | None, platform: str | None, name: str, config: dict,
         program_id: str) -> Lookup | None:
    """Look for this host's program in the job's storage and keep what it can use in its executable cache
    under `program_id` (where `programs.compile_keyed` loads it); None where the launch names no storage.

    `programs` and `endpoint`: the launch order's (`workers.order.LaunchOrder`).

    `platform`: the host's ("cpu" for a stand-in, else "tpu"); the launch names a target for each.
    Never raises for what it finds: a failed read is a reason to compile.
    """
    from workers import programs as executables

    if programs is None:
        return None
    target = programs.targets.get(platform or "tpu")
    if target is None:
        return None
    try:
        found = select(programs.directory, stored_id(name, config), target, programs.key, endpoint=endpoint)
    except Exception as e:  # noqa: BLE001 -- the job's storage failed, however: compile as before
        return Lookup(target, None, f"the job's storage could not be read ({type(e).__name__}: {e})")
    if found.kept is not None:
        if (path := executables.kept_program_path(program_id)) is None:
            return Lookup(target, None, "this host keeps no executables (no cache directory)")
        executables.keep_program(program_id, found.kept)
        return dataclasses.replace(found, stamp=_stamp(path))
    return found


def _stamp(path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


def loaded(found: Lookup, program_id: str) -> Lookup:
    """`found` once the trainer compiled: a stored executable its runtime could not load is a compile.

    `programs.compile_keyed` drops a kept program that does not load (another device
    assignment, a truncated file), traces, and keeps what it compiled in its place: the file
    `take` wrote is then gone. Process 0 decides for every process.
    """
    from workers import programs as executables

    path = executables.kept_program_path(program_id)
    if found.used and (path is None or found.stamp is None or _stamp(path) != found.stamp):
        return Lookup(found.target, None, "the stored executable did not load here (this host's log says why)")
    return found

