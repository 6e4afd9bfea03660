"""JAX runtime bring-up on one host: devices, collectives, the multi-host handshake.

Must run before anything in the process touches a JAX backend. On the local provider
each host's CPU devices stand in for its TPU chips (`jax_num_cpu_devices`), and
processes talk over gloo; on real TPU hosts the platform is left to JAX.
"""

from __future__ import annotations

import os

import jax


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
