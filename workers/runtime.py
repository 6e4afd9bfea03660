"""JAX runtime bring-up on one host: devices, collectives, the multi-host handshake.

Must run before anything in the process touches a JAX backend. A host decides its
platform from what it is (`workers.accelerator.host_platform`): where its CPU stands in for
its TPU chips (a local or emulated host), its CPU devices do (`jax_num_cpu_devices`) and
processes talk over gloo; on a TPU host JAX may use the TPU only.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import logging
import os
import pickle
import secrets
from collections.abc import Callable
from pathlib import Path

import jax

log = logging.getLogger(__name__)


def configure(*, platform: str | None, devices_per_host: int, compile_cache_dir: str | None = None) -> None:
    """`platform`: "cpu" (`devices_per_host` CPU devices stand in for the chips), "tpu" (the TPU
    only: a host without one fails when the backend starts, never falls back to its CPU), or None
    (whatever JAX finds)."""
    if platform == "cpu":
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", devices_per_host)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    elif platform == "tpu":
        jax.config.update("jax_platforms", "tpu")
    if compile_cache_dir:
        # A restart after a preemption compiles the same step again: reuse it from disk.
        jax.config.update("jax_compilation_cache_dir", compile_cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def initialize(*, coordinator_address: str | None, num_processes: int, process_id: int,
               host_address: str | None = None, share_key: bytes | None = None, timeout_s: int = 120,
               slice_id: int = 0, num_slices: int = 1, platform: str | None = None) -> dict[str, str]:
    """Join the multi-host runtime; a single host needs no handshake.

    `platform`: as given to `configure`. The multislice settings (`multislice_env`) go into
    the environment unless it is "cpu": TPU slices talk over DCN through them, and CPU
    devices have no slice.

    Nothing listens beyond the cluster's own address: process 0 serves the runtime's
    coordinator (an unauthenticated gRPC key-value store) on `coordinator_address` itself,
    not on every interface as JAX does by default, and the CPU collectives (gloo) listen on
    `host_address` (this host's address in the cluster; default: the coordinator's host,
    right when every process runs on one machine). `share_key` authenticates the bytes
    hosts hand each other through that store (`_seal`); without it none are accepted.
    """
    global _share_key
    for key in [k for k in os.environ if k.startswith("MEGASCALE_")]:
        del os.environ[key]  # stale values from an earlier slice make initialize() hang
    multislice = multislice_env(coordinator_address, slice_id, num_slices)
    if platform != "cpu":
        os.environ.update(multislice)
    _share_key = share_key
    if num_processes == 1:
        return multislice
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id, initialization_timeout=timeout_s,
                               coordinator_bind_address=coordinator_address)
    from workers.notices import chain_sigterm

    if chained := chain_sigterm():  # XLA's preemption notifier took SIGTERM over: ours first again, then it
        log.info(chained)
    # JAX's Config declares its options at run time (its type stub does not name them).
    if jax.config.jax_cpu_collectives_implementation == "gloo":  # type: ignore[attr-defined]
        if not host_address:
            assert coordinator_address is not None, "several processes are given their coordinator (launch does)"
            host_address = coordinator_address.rsplit(":", 1)[0]
        _pin_gloo(host_address)
        _no_shared_jax_cache()
    return multislice


def _no_shared_jax_cache() -> None:
    """JAX's persistent cache off for the programs of a multi-process CPU runtime (a user's own, say).

    On CPU hosts its key differs between the processes of one runtime: process 0 can load a
    program from the cache while the others compile theirs afresh, and the processes'
    collectives then need not agree. Under load, generations that started with their step in
    the shared cache aborted in gloo ("op.preamble.length <= op.nbytes ... Is there a
    distributed collective mismatch"), and none that compiled fresh did. This module's own
    programs are kept by a key every process shares (`compile_cached`, `compile_keyed`).
    """
    from jax.experimental.compilation_cache import compilation_cache

    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()


MEGASCALE_PORT = 8080


def multislice_env(coordinator_address: str | None, slice_id: int, num_slices: int) -> dict[str, str]:
    """The multislice runtime's settings for this launch (TPU reads them from the environment), worked
    out afresh each time: slice 0's first host coordinates. Empty for a single slice."""
    if num_slices <= 1 or coordinator_address is None:
        return {}
    return {"MEGASCALE_COORDINATOR_ADDRESS": f"{coordinator_address.rsplit(':', 1)[0]}:{MEGASCALE_PORT}",
            "MEGASCALE_NUM_SLICES": str(num_slices), "MEGASCALE_SLICE_ID": str(slice_id),
            "MEGASCALE_PORT": str(MEGASCALE_PORT)}


def _pin_gloo(host: str) -> None:
    """CPU collectives over gloo that listen on `host` only.

    Left to JAX, gloo listens on whatever address the machine's hostname resolves to,
    which can be a public interface. JAX makes the CPU backend with collectives passed
    in when given them, so the backend is registered again, before its first use, with
    collectives of our own.
    """
    from jax._src import distributed, xla_bridge
    from jax._src.lib import _jax

    collectives = _jax.make_gloo_tcp_collectives(distributed_client=distributed.global_state.client,
                                                 hostname=host.strip("[]"))
    xla_bridge.register_backend_factory("cpu", functools.partial(xla_bridge.make_cpu_client, collectives=collectives),
                                        priority=0, fail_quietly=False)


# -- Bytes between hosts -----------------------------------------------------------------
#
# Executables go from process 0 to the others through the coordinator's key-value store,
# and loading one unpickles it: whoever can write to that store could run code on every
# host. So every blob is sealed with an HMAC over its name and bytes, under a key the
# controller hands each launch over Ray's authenticated channel, and a blob that does not
# open is refused (the host compiles for itself). A process with no key takes no bytes.

_share_key: bytes | None = None
_MAC_BYTES = 32


def _seal(name: str, payload: bytes) -> bytes:
    return _mac(name, payload) + payload


def _mac(name: str, payload: bytes) -> bytes:
    assert _share_key is not None
    return hmac.new(_share_key, name.encode() + b"\0" + payload, hashlib.sha256).digest()


def open_sealed(name: str, sealed: bytes) -> bytes | None:
    """The payload of `sealed`, or None (with a warning) when its seal is not ours."""
    mac, payload = sealed[:_MAC_BYTES], sealed[_MAC_BYTES:]
    if _share_key is None or len(mac) != _MAC_BYTES or not hmac.compare_digest(mac, _mac(name, payload)):
        log.warning("refused %s from the coordination store: its seal does not match this launch's key", name)
        return None
    return payload


def publish(client, name: str, payload: bytes) -> None:
    """`payload` into the runtime's key-value store as `name`, sealed with this launch's key (none: nothing)."""
    if _share_key is not None:
        client.key_value_set_bytes(name, _seal(name, payload), allow_overwrite=True)


def _receive(client, name: str, timeout_s: float) -> bytes | None:
    """The bytes process 0 published as `name` (waiting up to `timeout_s`), or None: none, or not authentic."""
    return open_sealed(name, client.blocking_key_value_get_bytes(name, int(timeout_s * 1000)))


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
        if _share_key is None:  # nothing from the store is trusted without a key: compile here
            return lowered.compile(), None
        try:
            payload = _receive(client, f"executable/{key}", share_timeout_s)
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
        publish(client, f"executable/{key}", payload or b"")
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
                publish(client, f"program-bytes/{key}", blob)
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
    if _share_key is None:  # it could not tell process 0's bytes from forged ones: make its own
        client.key_value_set(need, "no", allow_overwrite=True)
        return lower().compile()
    client.key_value_set(need, "yes", allow_overwrite=True)
    sent = _receive(client, f"program-bytes/{key}", share_timeout_s)
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
