"""JAX runtime bring-up on one host: devices, collectives, the multi-host handshake.

Must run before anything in the process touches a JAX backend. On the local provider
each host's CPU devices stand in for its TPU chips (`jax_num_cpu_devices`), and
processes talk over gloo; on real TPU hosts the platform is left to JAX.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import jax

log = logging.getLogger(__name__)


def configure(*, platform: str | None, devices_per_host: int, compile_cache_dir: str | None = None) -> None:
    if platform == "cpu":
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", devices_per_host)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if compile_cache_dir:
        # A restart after a preemption compiles the same step again: reuse it from disk.
        jax.config.update("jax_compilation_cache_dir", compile_cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def initialize(*, coordinator_address: str | None, num_processes: int, process_id: int,
               timeout_s: int = 120) -> None:
    """Join the multi-host runtime; a single host needs no handshake."""
    for key in [k for k in os.environ if k.startswith("MEGASCALE_")]:
        del os.environ[key]  # stale values from an earlier slice make initialize() hang
    if num_processes == 1:
        return
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id, initialization_timeout=timeout_s)


def program_key(lowered: "jax.stages.Lowered") -> str:
    """One key for `lowered` on this runtime: the program, the runtime's devices and the JAX build."""
    import hashlib

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
    root = jax.config.jax_compilation_cache_dir
    return Path(root) / "executables" / f"{key or program_key(lowered)}.bin" if root else None


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
    import secrets

    from jax._src import distributed
    from jax.experimental import serialize_executable

    client = distributed.global_state.client
    if jax.process_count() == 1 or client is None:  # one process: JAX's own persistent cache serves it
        return lowered.compile()
    key = program_key(lowered)
    path = executable_path(lowered, key)

    def load(payload: bytes, where: str):
        try:
            return serialize_executable.deserialize_and_load(payload, lowered.in_tree, lowered.out_tree)
        except Exception as e:  # truncated, or from another build
            log.warning("the executable from %s is unusable (%s: %s); compiling", where, type(e).__name__, e)
            return None

    if jax.process_index() != 0:
        if path is not None and path.exists() and (compiled := load(path.read_bytes(), path.name)) is not None:
            return compiled
        try:
            payload = client.blocking_key_value_get_bytes(f"executable/{key}", int(share_timeout_s * 1000))
        except Exception as e:  # process 0 never published it: compile here rather than wait forever
            log.warning("no executable from process 0 (%s); compiling", type(e).__name__)
            return lowered.compile()
        return (load(payload, "process 0") if payload else None) or lowered.compile()
    compiled = None
    if path is not None and path.exists():
        compiled = load(path.read_bytes(), path.name)
        if compiled is None:
            path.unlink(missing_ok=True)
    if compiled is None:
        compiled = lowered.compile()
    try:
        payload, _, _ = serialize_executable.serialize(compiled)
    except Exception as e:  # not serializable: every process compiles its own
        log.warning("cannot share the executable (%s: %s)", type(e).__name__, e)
        client.key_value_set_bytes(f"executable/{key}", b"", allow_overwrite=True)
        return compiled
    client.key_value_set_bytes(f"executable/{key}", payload, allow_overwrite=True)
    if path is not None and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp-{secrets.token_hex(4)}")
        tmp.write_bytes(payload)
        tmp.replace(path)
    return compiled
