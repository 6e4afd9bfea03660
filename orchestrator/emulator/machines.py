"""The emulated lifecycles of a queued resource and of a TPU node, and their timings.

States carry the TPU API v2's own names (``QueuedResourceState.State`` and
``Node.State`` in ``google.cloud.tpu_v2``). Each lifecycle is one table of allowed
moves; the emulator checks every move against it, so a bug in the emulator raises
instead of showing the client a sequence the real API never produces.

The happy path of a queued resource, with the time each automatic step takes:

    CREATING --accept_s--> ACCEPTED --queue_s--> WAITING_FOR_RESOURCES
        --capacity_s (only while the zone has capacity)--> PROVISIONING
        --provision_s--> ACTIVE

A reclaim moves ACTIVE to SUSPENDING (initiator SERVICE) at once; the nodes stay up
for ``preempt_grace_s`` (a spot VM's ~30 s notice), then become PREEMPTED and the
queued resource SUSPENDED. A delete moves anything to DELETING; ``delete_s`` later the
resource is gone (GET answers 404).
"""

from __future__ import annotations

from dataclasses import dataclass


class EmulatorBug(AssertionError):
    """The emulator tried a move its own table forbids."""


# Queued resource states (QueuedResourceState.State).
CREATING = "CREATING"
ACCEPTED = "ACCEPTED"
WAITING_FOR_RESOURCES = "WAITING_FOR_RESOURCES"
PROVISIONING = "PROVISIONING"
ACTIVE = "ACTIVE"
SUSPENDING = "SUSPENDING"
SUSPENDED = "SUSPENDED"
FAILED = "FAILED"
DELETING = "DELETING"

QR_TRANSITIONS: dict[str, frozenset[str]] = {
    CREATING: frozenset({ACCEPTED, FAILED, DELETING}),
    ACCEPTED: frozenset({WAITING_FOR_RESOURCES, FAILED, DELETING}),
    WAITING_FOR_RESOURCES: frozenset({PROVISIONING, FAILED, DELETING}),
    PROVISIONING: frozenset({ACTIVE, FAILED, DELETING}),
    ACTIVE: frozenset({SUSPENDING, DELETING}),
    SUSPENDING: frozenset({SUSPENDED, DELETING}),
    SUSPENDED: frozenset({DELETING}),
    FAILED: frozenset({DELETING}),
    DELETING: frozenset(),
}

# States from which the real API refuses a delete without ``force=true`` while the
# queued resource still owns nodes.
QR_NEEDS_FORCE = frozenset({PROVISIONING, ACTIVE, SUSPENDING})

# Node states (Node.State) that the emulator uses.
N_CREATING = "CREATING"
N_READY = "READY"
N_PREEMPTED = "PREEMPTED"
N_TERMINATED = "TERMINATED"
N_REPAIRING = "REPAIRING"
N_DELETING = "DELETING"

NODE_TRANSITIONS: dict[str, frozenset[str]] = {
    N_CREATING: frozenset({N_READY, N_DELETING}),
    N_READY: frozenset({N_PREEMPTED, N_TERMINATED, N_REPAIRING, N_DELETING}),
    N_REPAIRING: frozenset({N_READY, N_TERMINATED, N_DELETING}),
    N_PREEMPTED: frozenset({N_DELETING}),
    N_TERMINATED: frozenset({N_DELETING}),
    N_DELETING: frozenset(),
}

# Node states in which the VMs are down: the hosts' Ray nodes must be gone.
NODE_DOWN = frozenset({N_PREEMPTED, N_TERMINATED, N_DELETING})


def check_qr(name: str, current: str, target: str) -> None:
    if target not in QR_TRANSITIONS[current]:
        raise EmulatorBug(f"queued resource {name}: {current} -> {target} is not a move of the real API")


def check_node(name: str, current: str, target: str) -> None:
    if target not in NODE_TRANSITIONS[current]:
        raise EmulatorBug(f"node {name}: {current} -> {target} is not a move of the real API")


MAX_TIME_SCALE = 100.0  # 100 times the real service's timings: a two-minute provisioning takes over 3 hours


@dataclass(frozen=True)
class MachineTimings:
    """How long each automatic step takes, in seconds of the real service, times `scale`.

    The defaults are rough figures for a multi-host slice on Cloud TPU; ``scale=0.01``
    turns a two-minute provisioning into 1.2 s, which is what tests want.
    """

    accept_s: float = 5.0
    queue_s: float = 5.0
    capacity_s: float = 15.0
    provision_s: float = 120.0
    preempt_grace_s: float = 30.0
    delete_s: float = 60.0
    scale: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.scale <= MAX_TIME_SCALE:  # NaN fails this too: every timing would be NaN, waits endless
            raise ValueError(f"MachineTimings.scale must be a number above 0 and at most {MAX_TIME_SCALE:g}, "
                             f"got {self.scale}")

    def of(self, step: str) -> float:
        """Seconds that `step` (a field name without ``_s``) takes at this scale."""
        return getattr(self, f"{step}_s") * self.scale
