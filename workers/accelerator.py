"""What a host computes on: its TPU chips, or its CPU standing in for them.

A host decides from what it is, never from what the controller assumes. A machine whose
CPU stands in for TPU chips (a local provider's host, an emulated TPU VM) declares it in
the environment its Ray node starts with, ``ORCHESTRATOR_CPU_STAND_IN=1``
(`CPU_STAND_IN_ENV`), which the raylet and every worker process it starts inherit. It then
runs on `chips_per_host` CPU devices (`workers.runtime.configure`). A host that declares
nothing is a TPU host, as a real TPU VM is (its startup script sets nothing): JAX is
given ``jax_platforms="tpu"``, so it cannot fall back to the CPU, and `check_tpu` starts
the backend and checks that it has the chips the slice claims. A host that has not fails
the launch with a `PlatformError`, once: every launch on it would find the same.

No JAX import at module level: the control plane reads the constant.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

CPU_STAND_IN_ENV = "ORCHESTRATOR_CPU_STAND_IN"  # "1": this host's CPU stands in for its TPU chips
CPU, TPU = "cpu", "tpu"


def stand_in_env() -> dict[str, str]:
    """The declaration, for the environment of a stand-in host's Ray node."""
    return {CPU_STAND_IN_ENV: "1"}


def host_platform(environ: Mapping[str, str] = os.environ) -> str:
    """The JAX platform of this host: "cpu" where it declares its CPU a stand-in, else "tpu"."""
    return CPU if environ.get(CPU_STAND_IN_ENV) == "1" else TPU


@dataclass(frozen=True)
class HostClaim:
    """What the controller says a host is: host `host` of slice `slice_name`, of type `accelerator`,
    whose chips are of generation `chip` (as `kernels.hardware` names it: "v4", "v5e", ...)."""

    slice_name: str
    accelerator: str
    host: int
    chip: str

    def __str__(self) -> str:
        return f"host {self.host} of slice {self.slice_name} ({self.accelerator})"


class PlatformError(Exception):
    """A host is not what its slice claims: its TPU does not start, or it has other chips, or fewer."""


def check_tpu(claim: HostClaim | None, devices_per_host: int) -> str:
    """Start this host's TPU backend and check it has `devices_per_host` chips of the claimed generation;
    returns their device kind. Raises `PlatformError` with one line that says what is wrong.

    On a multi-host slice, call it after `jax.distributed.initialize` (`workers.runtime.initialize`):
    the TPU backend may start only once the processes have joined.
    """
    import jax

    from kernels.hardware import from_device_kind

    where = str(claim) if claim is not None else "this host"
    try:
        devices = jax.local_devices()
    except RuntimeError as e:  # how JAX says a backend did not start
        reason = " ".join(str(e).split())
        raise PlatformError(f"{where} found no TPU: {reason}; a host whose CPU stands in for TPU chips declares "
                            f"{CPU_STAND_IN_ENV}=1 in its Ray node's environment") from e
    tpus = [d for d in devices if d.platform == TPU]
    if len(tpus) != devices_per_host:
        raise PlatformError(f"{where} has {len(tpus)} TPU devices, not the {devices_per_host} per host of its "
                            "slice type")
    kind = tpus[0].device_kind
    chip = from_device_kind(kind)
    if claim is not None and (chip is None or chip.name != claim.chip):
        raise PlatformError(f"{where} has {kind} chips, not the {claim.chip} chips of its slice type")
    return kind
