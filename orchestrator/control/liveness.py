"""A lost host seen in about two seconds, not after Ray's health check (15-65 s).

Every host of a running launch sends a signed UDP beat every `period_s` (`workers.beats`) to
this process's `Monitor`, bound to the controller's own address. A host that powers off with no
notice sends no reset either: its peers' collectives wait on it, and Ray calls its node dead only
when its health check gives up. The monitor sees the beats stop instead.

The false-positive rule (`Rule`): a host is declared lost only when BOTH
  1. no beat of it arrived for `silence_s` (1 s, or 4 periods if longer), and
  2. `probes` (2) probes of its Ray node, started `probe_gap_s` (0.2 s) apart, each fail: the
     connection refused, reset, or no answer within `probe_timeout_s` (0.4 s).
A probe connects to the host's raylet and sends an HTTP/2 client preface; any answer (bytes, or
the peer closing) counts as alive. A bare connect is not enough: a host whose processes are frozen
(or whose kernel still runs while everything above it is stuck) completes the TCP handshake from
its listen backlog, but nothing answers. A host that is merely slow (its beats late under load,
its raylet answering) is not lost: it is probed again only after another `silence_s` without a
beat. A beat that arrives while a probe runs cancels that probe's verdict. A host is judged only
once it has sent a first beat (before that, Ray's own errors and the launch's timeouts cover it); an
adopted group's hosts are judged from their adoption (a host that went while no controller ran is found).
So at the defaults a silent host is declared lost 1.0-2.0 s after its last beat, plus a check's tick.

The verdict goes to the worker group (`orchestrator.control.group.RayWorkerGroup.silent_host`),
which reports the slice lost through the provider's path (`Placement.mark_lost`) and ends the
survivors' stuck workers; their keepers, which hold the in-memory copy, are left alone.
"""

from __future__ import annotations

import logging
import math
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from workers import beats

log = logging.getLogger(__name__)

TICK_S = 0.05  # how often the monitor looks for silent hosts
# An HTTP/2 client preface and an empty SETTINGS frame: a raylet's gRPC server answers with its own SETTINGS.
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"

Address = tuple[str, int]
Probe = Callable[[Address, float], str | None]  # None: it answered; else why not


@dataclass(frozen=True)
class Rule:
    """When silence makes a host lost (see the module's docstring)."""

    silence_s: float = 1.0
    probes: int = 2
    probe_timeout_s: float = 0.4
    probe_gap_s: float = 0.2

    @classmethod
    def for_period(cls, period_s: float) -> Rule:
        return cls(silence_s=max(1.0, 4 * period_s))


@dataclass(frozen=True)
class Lost:
    """A host declared lost: its rank, when (monotonic), how long it was silent, and what the probes met."""

    rank: int
    at: float
    silent_s: float
    probes: tuple[str, ...]
    why: str | None = None  # found otherwise than by its beats (`Hosts.gone`)

    def reason(self, node: Address | None) -> str:
        if self.why is not None:
            return f"host {self.rank} is gone: {self.why}"
        where = f"{node[0]}:{node[1]}" if node else "its node"
        return (f"host {self.rank} is gone: no beat for {self.silent_s:.1f} s, and its Ray node {where} answered "
                f"none of {len(self.probes)} probes ({'; '.join(self.probes)})")


@dataclass
class _Host:
    node: Address | None  # its raylet, for the probes
    last_beat: float | None = None
    probing_since: float | None = None
    answered_at: float | None = None  # when a probe last found it alive


@dataclass
class Hosts:
    """One launch's hosts as the monitor sees them: their beats, their probes, the first one lost.

    Pure state on a clock the caller passes (`now`), so the rule is tested without threads or sockets."""

    rule: Rule
    nodes: dict[int, Address | None]
    lost: Lost | None = None
    changed: threading.Event = field(default_factory=threading.Event)  # set once a host is lost

    def __post_init__(self) -> None:
        self._hosts = {rank: _Host(node) for rank, node in self.nodes.items()}

    def beat(self, rank: int, now: float) -> None:
        if (h := self._hosts.get(rank)) is not None:
            h.last_beat = now

    def gone(self, rank: int, why: str, now: float) -> Lost:
        """A host found gone otherwise (an adopted group's worker that answered no call): lost now, unprobed."""
        if self.lost is None:
            self.lost = Lost(rank, now, 0.0, (), why)
            self.changed.set()
        return self.lost

    def due(self, now: float) -> list[int]:
        """The hosts silent for the rule's window and not already probed in it: each is now being probed."""
        if self.lost is not None:
            return []
        out = []
        for rank, h in self._hosts.items():
            if h.last_beat is None or h.probing_since is not None:
                continue
            quiet_since = max(h.last_beat, h.answered_at or -math.inf)
            if now - quiet_since >= self.rule.silence_s:
                h.probing_since = now
                out.append(rank)
        return out

    def probed(self, rank: int, failures: list[str | None], now: float) -> Lost | None:
        """What the probes of `rank` (started when `due` named it) met: None where one answered."""
        h = self._hosts[rank]
        started, h.probing_since = h.probing_since, None
        assert started is not None and h.last_beat is not None, "only a host `due` named is probed"
        if h.last_beat >= started:  # it beat meanwhile: slow, not gone
            return None
        if any(f is None for f in failures) or not failures:
            h.answered_at = now
            return None
        if self.lost is None:
            self.lost = Lost(rank, now, now - h.last_beat, tuple(f for f in failures if f is not None))
            self.changed.set()
        return self.lost


def probe_node(address: Address, timeout_s: float) -> str | None:
    """Whether the process behind `address` answers an HTTP/2 preface within `timeout_s`: None, else why not."""
    deadline = time.monotonic() + timeout_s
    try:
        with socket.create_connection(address, timeout=timeout_s) as s:
            s.settimeout(max(0.001, deadline - time.monotonic()))
            s.sendall(H2_PREFACE)
            s.recv(1)  # bytes, or the peer closing: something there acted
            return None
    except ConnectionRefusedError:
        return "refused"
    except TimeoutError:
        return f"no answer within {timeout_s:.1f} s"
    except OSError as e:
        return type(e).__name__


class Monitor:
    """Receives every launch's beats on one UDP socket and probes the silent hosts, on two threads."""

    def __init__(self, host: str = "127.0.0.1", *, probe: Probe = probe_node,
                 clock: Callable[[], float] = time.monotonic):
        self._probe, self._clock = probe, clock
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind((host, 0))  # the controller's address only, never all interfaces
        self._sock.settimeout(0.2)
        self.address: Address = self._sock.getsockname()
        self._lock = threading.Lock()
        self._watched: dict[tuple[str, int], tuple[bytes, Hosts]] = {}
        self._closed = threading.Event()
        threading.Thread(target=self._receive, daemon=True, name="liveness-beats").start()
        threading.Thread(target=self._check, daemon=True, name="liveness-check").start()

    def watch(self, job_id: str, generation: int, key: bytes, nodes: dict[int, Address | None],
              rule: Rule, *, judged_from_now: bool = False, changed: threading.Event | None = None) -> Hosts:
        """Watch a launch's hosts; `judged_from_now`: each as if it beat now (an adopted group's hosts, which beat
        to another controller's monitor until told this one's, and one of which may have gone meanwhile).
        `changed`: set when a host is found lost (the job's driver wakes on it rather than at its next poll)."""
        hosts = Hosts(rule, nodes) if changed is None else Hosts(rule, nodes, changed=changed)
        if judged_from_now:
            now = self._clock()
            for rank in nodes:
                hosts.beat(rank, now)
        with self._lock:
            self._watched[(job_id, generation)] = (key, hosts)
        return hosts

    def forget(self, job_id: str, generation: int) -> None:
        with self._lock:
            self._watched.pop((job_id, generation), None)

    def close(self) -> None:
        self._closed.set()

    def _receive(self) -> None:
        while not self._closed.is_set():
            try:
                data, _ = self._sock.recvfrom(512)
            except TimeoutError:
                continue
            except OSError as e:  # the socket closed under us
                log.debug("liveness monitor: %s", e)
                return
            self._take(data)
        self._sock.close()

    def _take(self, data: bytes) -> None:
        claimed = beats.sender(data)
        with self._lock:
            entry = self._watched.get(claimed) if claimed is not None else None
        if entry is None:
            return  # a launch no longer watched, or not a beat
        key, hosts = entry
        if (beat := beats.decode(key, data)) is not None:
            hosts.beat(beat.rank, self._clock())

    def _check(self) -> None:
        while not self._closed.wait(TICK_S):
            with self._lock:
                watched = [hosts for _, hosts in self._watched.values()]
            for hosts in watched:
                for rank in hosts.due(self._clock()):
                    threading.Thread(target=self._probe_host, args=(hosts, rank), daemon=True,
                                     name=f"liveness-probe-{rank}").start()

    def _probe_host(self, hosts: Hosts, rank: int) -> None:
        node, rule = hosts.nodes.get(rank), hosts.rule
        if node is None:  # no address to ask: never lost on silence alone
            hosts.probed(rank, [None], self._clock())
            return
        failures: list[str | None] = [None] * rule.probes
        threads = []
        for i in range(rule.probes):  # started `probe_gap_s` apart, so one slow answer does not decide alone
            def one(i: int = i) -> None:
                failures[i] = self._probe(node, rule.probe_timeout_s)
            threads.append(threading.Thread(target=one, daemon=True))
            threads[-1].start()
            if i + 1 < rule.probes:
                time.sleep(rule.probe_gap_s)
        for t in threads:
            t.join()
        lost = hosts.probed(rank, failures, self._clock())
        if lost is not None:
            log.warning("liveness: %s", lost.reason(node))


_monitor: Monitor | None = None
_monitor_lock = threading.Lock()


def monitor(host: str) -> Monitor:
    """This process's monitor (the controller's), bound to `host` (its address on the cluster) on first use."""
    global _monitor
    with _monitor_lock:
        if _monitor is None:
            _monitor = Monitor(host)
        return _monitor
