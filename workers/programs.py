"""Executables compiled once per multi-process runtime, handed between its hosts, and kept for the next.

A restart after a preemption runs the same train step again. Process 0 compiles it (or loads
the executable a host's cache directory kept), and the other processes load its bytes from the
runtime's key-value store, sealed with the launch's key (`workers.runtime`), rather than each
compiling its own (`compile_cached`). A program the orchestrator builds itself is named before
it is traced (`program_id`), so a kept one is loaded without even tracing it (`compile_keyed`),
and can be compiled ahead, off the training path, for a runtime to come (`compile_ahead`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import pickle
import secrets
from collections.abc import Callable
from pathlib import Path

import jax

from workers import runtime

log = logging.getLogger(__name__)


def program_key(lowered: "jax.stages.Lowered") -> str:
    """One key for `lowered` on this runtime: the program, the runtime's devices and the JAX build."""
    import jaxlib

    h = hashlib.sha256(lowered.as_text().encode())
    for part in (jax.__version__, jaxlib.__version__, jax.process_count(),
                 [(d.id, d.platform, d.device_kind, d.process_index) for d in jax.devices()]):
        h.update(repr(part).encode())
    return h.hexdigest()


def executable_path(lowered: "jax.stages.Lowered", key: str | None = None) -> "Path | None":
    """Where `compile_cached` keeps the executable of `lowered` (None: no cache directory).

    `key`: `program_key(lowered)` when the caller has it already (it hashes the whole program).
    """
    # JAX's Config declares its options at run time (its type stub does not name them).
    root = jax.config.jax_compilation_cache_dir  # type: ignore[attr-defined]
    return Path(root) / "executables" / f"{key or program_key(lowered)}.bin" if root else None


@functools.cache
def _own_programs() -> None:
    """Programs compiled through this module are kept by it, not by JAX's persistent cache.

    An executable that JAX loaded from its own cache cannot be serialized again on CPU
    (jaxlib 0.10: running the copy fails with "NOT_FOUND: Function ... not found"), and
    this module hands executables on. So the first compile here switches JAX's cache off
    for the process; the few small helper programs of a worker are compiled afresh.
    """
    from jax.experimental.compilation_cache import compilation_cache

    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()


def compile_cached(lowered: "jax.stages.Lowered", *, share_timeout_s: float = 900.0) -> "jax.stages.Compiled":
    """`lowered.compile()`, done once per multi-process runtime and kept for the next one.

    JAX's own answers fall short on CPU hosts: its persistent cache serves only process
    0 (the others compute a different key there and never write theirs), and it cannot
    hand process 0's executable to the others. So after a restart every host but the
    first compiled the step again, and the first step waited for them (8-11 s of a
    2-host restart), and a local slice of 4 hosts compiled the same program 4 times on
    the same cores. Here process 0 compiles (or loads the executable a cache directory
    kept from an earlier run), writes it there, and publishes it through the runtime's
    key-value store; the others load it. Anything unreadable is compiled afresh.
    """
    return _compile_shared(lowered, share_timeout_s)[0]


def _compile_shared(lowered: "jax.stages.Lowered",
                    share_timeout_s: float) -> "tuple[jax.stages.Compiled, bytes | None]":
    """`compile_cached`, also returning the executable's bytes on process 0 when they are
    known good: read from the cache directory, or serialized from a fresh compile."""
    from jax._src import distributed
    from jax.experimental import serialize_executable

    _own_programs()
    client = distributed.global_state.client
    shared = jax.process_count() > 1 and client is not None
    key = program_key(lowered)
    path = executable_path(lowered, key)

    def load(payload: bytes, where: str):
        return _deserialize(payload, lowered.in_tree, lowered.out_tree, where)

    if shared and jax.process_index() != 0:
        if path is not None and path.exists() and (compiled := load(path.read_bytes(), path.name)) is not None:
            return compiled, None
        if not runtime.sharing():  # nothing from the store is trusted without a key: compile here
            return lowered.compile(), None
        try:
            payload = runtime.receive(client, f"executable/{key}", share_timeout_s)
        except jax.errors.JaxRuntimeError as e:  # process 0 never published it: compile here, not wait forever
            log.warning("no executable from process 0 (%s); compiling", type(e).__name__)
            return lowered.compile(), None
        return (load(payload, "process 0") if payload else None) or lowered.compile(), None
    payload = path.read_bytes() if path is not None and path.exists() else None
    compiled = load(payload, path.name) if payload and path is not None else None  # bytes come from a path
    if compiled is None:
        if payload and path is not None:
            path.unlink(missing_ok=True)
        compiled = lowered.compile()
        try:  # fresh from the compiler (never from JAX's cache, see _own_programs), so it serializes
            payload, _, _ = serialize_executable.serialize(compiled)
        except Exception as e:  # noqa: BLE001 -- whatever does not serialize costs a compile per process, no more
            log.warning("cannot share the executable (%s: %s)", type(e).__name__, e)
            payload = None
        if payload is not None and path is not None:
            _write_atomically(path, payload)
    if shared:  # loaded bytes are passed on as read: a deserialized executable cannot be serialized again
        runtime.publish(client, f"executable/{key}", payload or b"")
    return compiled, payload


def _deserialize(payload: bytes, in_tree, out_tree, where: str) -> "jax.stages.Compiled | None":
    """The executable in `payload`, or None (with a warning) when it is unusable."""
    from jax.experimental import serialize_executable

    try:
        return serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
    except Exception as e:  # noqa: BLE001 -- bytes from a file or a peer, truncated or of another build: compile
        log.warning("the executable from %s is unusable (%s: %s); compiling it", where, type(e).__name__, e)
        return None


def _write_atomically(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{secrets.token_hex(4)}")
    tmp.write_bytes(data)
    tmp.replace(path)


# -- Skipping the trace on a restart ----------------------------------------------------
#
# `compile_cached` still traces and lowers the program to find its key: 1-2 s of Python
# for the small model on these CPU hosts, and far more for a real one. A program the
# orchestrator builds itself (the lm workload) is fully determined by its config, the
# code that builds it, and the runtime, so it can be named before it is traced:
# `program_id`. `compile_keyed` keeps each such program's executable, with the shapes of
# its inputs and outputs, under that name and loads it without tracing next time.

_TRACE_PACKAGES = ("workers", "kernels", "policies")  # the code that turns a config into a program (sharding rules)
_TRACE_ENV = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")  # and the KERNELS_* switches of kernels.dispatch
_TRACE = "trace"  # process 0's word when no kept program can be used
# JAX flags about caches, logs and the transport between hosts: they differ between hosts
# and between moments of one run (`_own_programs`), and never change a program.
_NOT_PROGRAM_FLAGS = ("cache", "log", "dump", "traceback", "pprint", "timeout", "cross_host", "distributed_debug")


@functools.cache
def _code_digest() -> str:
    """Hash of every source file that can change the program (computed once per process)."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for package in _TRACE_PACKAGES:
        for f in sorted((root / package).rglob("*.py")):
            h.update(str(f.relative_to(root)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def program_id(name: str, config: dict) -> str:
    """A key for the program `name` built from `config`, known without tracing it.

    It covers everything else tracing depends on too: the source of the packages that
    build programs, the versions of JAX, jaxlib and optax, the JAX config values (but
    `_NOT_PROGRAM_FLAGS`), the compiler flags in the environment, and the runtime's
    processes and devices. Any change gives a new key (and a trace); a stale program is
    never loaded for a new one.
    """
    import jaxlib
    import optax

    env = sorted((k, v) for k, v in os.environ.items() if k in _TRACE_ENV or k.startswith("KERNELS_"))
    flags = sorted((k, v) for k, v in jax.config.values.items() if not any(w in k for w in _NOT_PROGRAM_FLAGS))
    h = hashlib.sha256(json.dumps([name, config], sort_keys=True, default=repr).encode())
    for part in (_code_digest(), jax.__version__, jaxlib.__version__, optax.__version__, env,
                 flags, jax.process_count(),
                 [(d.id, d.platform, d.device_kind, d.process_index) for d in jax.devices()]):
        h.update(repr(part).encode())
    return h.hexdigest()


def kept_program_path(key: str) -> Path | None:
    # JAX's Config declares its options at run time (its type stub does not name them).
    root = jax.config.jax_compilation_cache_dir  # type: ignore[attr-defined]
    return Path(root) / "executables" / f"program-{key}.pkl" if root else None


def _load_keyed(blob: bytes, where: str) -> "jax.stages.Compiled | None":
    try:
        payload, in_tree, out_tree = pickle.loads(blob)
    except Exception as e:  # noqa: BLE001 -- unpickling a truncated file may raise anything: trace it instead
        log.warning("the program from %s is unreadable (%s: %s); tracing it", where, type(e).__name__, e)
        return None
    return _deserialize(payload, in_tree, out_tree, where)


def _store_keyed(path: Path | None, lowered: "jax.stages.Lowered", payload: bytes | None) -> None:
    if path is not None and payload is not None and not path.exists():
        _write_atomically(path, pickle.dumps((payload, lowered.in_tree, lowered.out_tree)))


def keep_program(key: str, blob: bytes) -> None:
    """Keep program `key`'s bytes (as `compile_keyed` writes them) in this host's cache, unless it has them."""
    path = kept_program_path(key)
    if path is not None and not path.exists():
        _write_atomically(path, blob)


def compile_ahead(key: str, lower: Callable[[], "jax.stages.Lowered"]) -> bool:
    """Trace, compile and keep program `key` in this host's cache for a later runtime to load
    (`compile_keyed`); False if it was kept already. This process runs nothing of it."""
    from jax.experimental import serialize_executable

    _own_programs()
    path = kept_program_path(key)
    assert path is not None, "a compile ahead is asked for only where a cache directory is set"
    if path.exists():
        return False
    lowered = lower()
    payload, _, _ = serialize_executable.serialize(lowered.compile())
    _store_keyed(path, lowered, payload)
    return True


def _trace_and_compile(path: Path | None, lower, share_timeout_s: float) -> "jax.stages.Compiled":
    lowered = lower()
    compiled, payload = _compile_shared(lowered, share_timeout_s)
    _store_keyed(path, lowered, payload)
    return compiled


def compile_keyed(key: str, lower: Callable[[], "jax.stages.Lowered"], *,
                  share_timeout_s: float = 900.0) -> "jax.stages.Compiled":
    """`compile_cached(lower())`, without even tracing when the program `key` was kept before.

    `key` comes from `program_id`. On a multi-process runtime process 0 decides for all
    (the processes must agree on one executable): it loads the kept program and tells the
    others its digest, or tells them to trace and compile. A process that keeps the same
    bytes loads its own; process 0 sends its bytes through the key-value store only when
    some process says it lacks them (an executable of a real model is hundreds of MB).
    """
    from jax._src import distributed

    _own_programs()
    path, client = kept_program_path(key), distributed.global_state.client
    blob = path.read_bytes() if path is not None and path.exists() else None
    shared = jax.process_count() > 1 and client is not None
    if not shared or jax.process_index() == 0:
        compiled = _load_keyed(blob, path.name) if blob and path is not None else None  # bytes come from a path
        if compiled is None and blob and path is not None:
            path.unlink(missing_ok=True)
        if shared:
            assert client is not None, "shared: a runtime of several processes has its client"
            digest = hashlib.sha256(blob).hexdigest() if compiled is not None and blob else _TRACE
            client.key_value_set(f"program/{key}", digest, allow_overwrite=True)
            if compiled is not None and blob and _someone_lacks(client, key, share_timeout_s):
                runtime.publish(client, f"program-bytes/{key}", blob)
        return compiled or _trace_and_compile(path, lower, share_timeout_s)
    assert client is not None, "shared: a runtime of several processes has its client"
    need = f"program-need/{key}/{jax.process_index()}"
    try:
        digest = client.blocking_key_value_get(f"program/{key}", int(share_timeout_s * 1000))
    except jax.errors.JaxRuntimeError as e:  # process 0 never answered (DEADLINE_EXCEEDED): make our own
        log.warning("no word from process 0 on program %s (%s); compiling", key[:12], type(e).__name__)
        client.key_value_set(need, "no", allow_overwrite=True)
        return lower().compile()
    if digest == _TRACE:  # process 0 traces and compiles, and shares the executable as compile_cached does
        return compile_cached(lower(), share_timeout_s=share_timeout_s)
    if blob and path is not None and hashlib.sha256(blob).hexdigest() == digest and (
            compiled := _load_keyed(blob, path.name)):
        client.key_value_set(need, "no", allow_overwrite=True)
        return compiled  # this host keeps the same program: nothing to transfer
    if not runtime.sharing():  # it could not tell process 0's bytes from forged ones: make its own
        client.key_value_set(need, "no", allow_overwrite=True)
        return lower().compile()
    client.key_value_set(need, "yes", allow_overwrite=True)
    sent = runtime.receive(client, f"program-bytes/{key}", share_timeout_s)
    return (_load_keyed(sent, "process 0") if sent else None) or lower().compile()


def _someone_lacks(client, key: str, share_timeout_s: float) -> bool:
    """Whether some process other than 0 needs process 0's bytes of program `key` (or did not say)."""
    for i in range(1, jax.process_count()):
        try:
            if client.blocking_key_value_get(f"program-need/{key}/{i}", int(share_timeout_s * 1000)) != "no":
                return True
        except jax.errors.JaxRuntimeError as e:  # no answer: send them, a process that waits gets them
            log.warning("process %d did not say whether it keeps program %s (%s); sending it",
                        i, key[:12], type(e).__name__)
            return True
    return False
