"""Ports handed to Ray processes: free, outside the kernel's ephemeral range, never twice in a row."""

from __future__ import annotations

import socket

import pytest

from orchestrator import cluster
from orchestrator.errors import ClusterError


def ephemeral_range() -> tuple[int, int]:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low, high = map(int, f.read().split())
    return low, high


def test_ports_are_free_outside_the_ephemeral_range_and_not_repeated():
    ports = [cluster.free_port() for _ in range(500)]
    assert len(set(ports)) == len(ports)  # a port not yet bound is never handed out again
    low, high = ephemeral_range()
    assert all(not low <= p <= high and p >= 20000 for p in ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))  # still free: nothing took it


def test_a_port_in_use_is_never_handed_out(monkeypatch):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        taken = busy.getsockname()[1]
        monkeypatch.setattr(cluster.nodes, "_PORT_RANGE", (taken, taken + 1))  # the only candidate is in use
        with pytest.raises(ClusterError, match=f"no free port on 127.0.0.1 in {taken}-{taken + 1}"):
            cluster.free_port()
