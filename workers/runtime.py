"""JAX runtime bring-up on one host: devices, collectives, the multi-host handshake, and the sealed bytes
hosts hand each other through the runtime's key-value store (the executables of `workers.programs`).

Must run before anything in the process touches a JAX backend. A host decides its
platform from what it is (`workers.accelerator.host_platform`): where its CPU stands in for
its TPU chips (a local or emulated host), its CPU devices do (`jax_num_cpu_devices`) and
processes talk over gloo; on a TPU host JAX may use the TPU only.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import logging
import os

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


def sharing() -> bool:
    """Whether this launch gave the process a key for the bytes hosts hand each other (`initialize`)."""
    return _share_key is not None


def publish(client, name: str, payload: bytes) -> None:
    """`payload` into the runtime's key-value store as `name`, sealed with this launch's key (none: nothing)."""
    if _share_key is not None:
        client.key_value_set_bytes(name, _seal(name, payload), allow_overwrite=True)


def receive(client, name: str, timeout_s: float) -> bytes | None:
    """The bytes process 0 published as `name` (waiting up to `timeout_s`), or None: none, or not authentic."""
    return open_sealed(name, client.blocking_key_value_get_bytes(name, int(timeout_s * 1000)))
