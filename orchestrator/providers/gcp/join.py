"""When a slice's hosts count as joined: the Ray nodes that carry its TPU labels and resources."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from orchestrator.providers.base import Host, Slice, host_resource

# Given a slice whose node is READY, the hosts that have joined the Ray cluster.
JoinCheck = Callable[[Slice], Sequence[Host]]


def ray_join_check(s: Slice) -> list[Host]:
    """Hosts of `s` alive in the Ray cluster this process is connected to (call ray.init first)."""
    import ray  # here, not at the top: listing or collecting slices needs no Ray

    hosts = []
    for n in ray.nodes():
        labels = n.get("Labels") or {}
        if not n.get("Alive") or labels.get("ray.io/tpu-slice-name") != s.name:
            continue
        w = int(labels.get("ray.io/tpu-worker-id", -1))
        if 0 <= w < s.tpu_type.hosts and host_resource(s.name, w) in (n.get("Resources") or {}):
            hosts.append(Host(w, host_resource(s.name, w), node_id=n["NodeID"], address=n.get("NodeManagerAddress")))
    return sorted(hosts, key=lambda h: h.worker_id)
