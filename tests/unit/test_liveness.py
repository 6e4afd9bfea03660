"""The liveness rule (`orchestrator.control.liveness`): a host is lost only when its beats stopped for the
window AND its node answers none of the probes; a slow host (late beats, a node that answers) never is."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from orchestrator.control.liveness import Hosts, Monitor, Rule, probe_node
from workers import beats

NODE = ("127.0.0.1", 1)
RULE = Rule()  # 1 s of silence, 2 probes of 0.4 s, 0.2 s apart


def hosts(n: int = 2) -> Hosts:
    return Hosts(RULE, {rank: NODE for rank in range(n)})


def beating(h: Hosts, until: float, period: float = 0.25) -> None:
    t = 0.0
    while t <= until:
        for rank in h.nodes:
            h.beat(rank, t)
        t += period


# -- the rule, on a manual clock -----------------------------------------------------------------------------


def test_hosts_that_beat_are_never_probed():
    h = hosts()
    beating(h, 10.0)
    assert h.due(10.0) == []
    assert h.due(10.9) == []  # 0.9 s after the last beat: inside the window


def test_a_silent_host_is_probed_once_its_window_passes_and_only_it():
    h = hosts()
    beating(h, 5.0)
    h.beat(1, 6.0)
    assert h.due(5.9) == []
    assert h.due(6.0) == [0]  # host 0's last beat was at 5.0
    assert h.due(6.5) == []  # being probed: not named twice


def test_silent_and_every_probe_failing_is_lost():
    h = hosts()
    beating(h, 5.0)
    assert h.due(6.0) == [0, 1]
    h.probed(1, [None, "refused"], 6.6)
    lost = h.probed(0, ["refused", "no answer within 0.4 s"], 6.6)
    assert lost is not None and lost.rank == 0 and lost.silent_s == pytest.approx(1.6)
    assert h.lost is lost and h.changed.is_set()
    assert "host 0 is gone: no beat for 1.6 s" in lost.reason(NODE) and "refused" in lost.reason(NODE)
    assert h.due(20.0) == []  # one verdict per launch


def test_a_host_found_gone_at_adoption_is_lost_at_once_with_why_and_is_the_only_verdict():
    h = hosts()
    lost = h.gone(1, "its worker answered no call at adoption", 3.0)
    assert h.lost is lost and h.changed.is_set() and lost.rank == 1 and lost.at == 3.0
    assert lost.reason(NODE) == "host 1 is gone: its worker answered no call at adoption"
    assert h.gone(0, "another", 4.0) is lost  # one verdict per launch
    beating(h, 5.0)
    assert h.due(20.0) == []


def test_a_slow_host_whose_node_answers_is_not_lost_and_is_probed_again_only_after_another_window():
    """The false-positive rule: late beats (a host under load) with a probe that answers are not a loss."""
    h = hosts(1)
    beating(h, 5.0)
    assert h.due(6.0) == [0]
    assert h.probed(0, ["no answer within 0.4 s", None], 6.6) is None  # one answer is enough
    assert h.lost is None and not h.changed.is_set()
    assert h.due(7.5) == []  # within a window of the answer
    assert h.due(7.6) == [0]
    assert h.probed(0, [None, None], 8.2) is None
    h.beat(0, 8.5)  # its beats come back
    assert h.due(9.4) == [] and h.lost is None


def test_a_beat_during_the_probe_cancels_its_verdict():
    h = hosts(1)
    beating(h, 5.0)
    assert h.due(6.0) == [0]
    h.beat(0, 6.3)  # late, but alive
    assert h.probed(0, ["refused", "refused"], 6.6) is None
    assert h.lost is None


def test_a_host_that_never_beat_is_not_judged():
    h = hosts(2)
    h.beat(0, 0.0)
    assert h.due(100.0) == [0]


def test_the_window_follows_the_period():
    assert Rule.for_period(0.25).silence_s == 1.0
    assert Rule.for_period(0.5).silence_s == 2.0


# -- the probe, against real sockets -------------------------------------------------------------------------


def test_a_closed_port_is_refused():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: refused
        assert probe_node(("127.0.0.1", port), 0.4) == "refused"


def test_a_process_that_answers_is_alive():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()

        def answer():
            conn, _ = server.accept()
            with conn:
                conn.recv(64)
                conn.sendall(b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")

        threading.Thread(target=answer, daemon=True).start()
        assert probe_node(server.getsockname(), 0.4) is None


def test_a_frozen_process_is_not_alive_though_its_kernel_accepts_the_connection():
    """A listening socket nobody serves: the handshake completes from the backlog, no answer ever comes."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        t0 = time.monotonic()
        assert probe_node(server.getsockname(), 0.3) == "no answer within 0.3 s"
        assert 0.25 < time.monotonic() - t0 < 2.0  # its own timeout, not an answer (none comes); slack for load


# -- beats ---------------------------------------------------------------------------------------------------


def test_a_beat_opens_only_with_its_key():
    key = b"k" * 32
    data = beats.encode(key, beats.Beat("job-1", 3, 2, 7))
    assert beats.decode(key, data) == beats.Beat("job-1", 3, 2, 7)
    assert beats.sender(data) == ("job-1", 3)
    assert beats.decode(b"x" * 32, data) is None
    forged = data[:-2] + b"9]"  # another sequence number, the old seal
    assert beats.decode(key, forged) is None


# -- the monitor, end to end on this machine's loopback (short windows: no sleep over a second) --------------


FAST = Rule(silence_s=0.3, probes=2, probe_timeout_s=0.1, probe_gap_s=0.05)


def monitored(probe) -> tuple[Monitor, Hosts, list[beats.Beater], bytes]:
    mon = Monitor("127.0.0.1", probe=probe)
    key = b"s" * 32
    h = mon.watch("job-1", 1, key, {0: NODE, 1: NODE}, FAST)
    beaters = [beats.Beater(mon.address, key, "job-1", 1, rank, period_s=0.05).start() for rank in (0, 1)]
    return mon, h, beaters, key


def test_a_host_whose_beats_stop_and_whose_node_is_gone_is_lost_within_the_window_and_the_probes():
    mon, h, beaters, _ = monitored(lambda node, timeout: "refused")
    try:
        time.sleep(0.3)
        assert h.lost is None  # both beat
        stopped = time.monotonic()
        beaters[1].stop()
        assert h.changed.wait(1.0)
        assert h.lost is not None and h.lost.rank == 1
        assert 0.3 <= h.lost.at - stopped < 0.8  # the window, a tick, two probes 0.05 s apart
    finally:
        for b in beaters:
            b.stop()
        mon.close()


def test_a_slow_host_whose_node_answers_is_not_lost_by_the_monitor():
    mon, h, beaters, key = monitored(lambda node, timeout: None)  # the node answers every probe
    try:
        beaters[1].stop()  # its beats late by far more than the window: a host under load
        time.sleep(1.0)
        assert h.lost is None
        late = beats.Beater(mon.address, key, "job-1", 1, 1, period_s=0.05).start()  # and back
        beaters.append(late)
        time.sleep(0.2)
        assert h.lost is None
    finally:
        for b in beaters:
            b.stop()
        mon.close()


def test_an_adopted_groups_host_that_never_beats_here_is_found():
    """Hosts judged from their adoption: one that went while no controller ran sends no beat at all."""
    mon = Monitor("127.0.0.1", probe=lambda node, timeout: "refused")
    key = b"a" * 32
    h = mon.watch("job-2", 4, key, {0: NODE, 1: NODE}, FAST, judged_from_now=True)
    beater = beats.Beater(mon.address, key, "job-2", 4, 0, period_s=0.05).start()
    try:
        assert h.changed.wait(1.0) and h.lost is not None and h.lost.rank == 1
    finally:
        beater.stop()
        mon.close()


def test_beats_sealed_with_another_key_do_not_keep_a_host_alive():
    mon, h, beaters, _ = monitored(lambda node, timeout: "refused")
    try:
        beaters[1].stop()
        forger = beats.Beater(mon.address, b"f" * 32, "job-1", 1, 1, period_s=0.05).start()
        beaters.append(forger)
        assert h.changed.wait(1.0) and h.lost is not None and h.lost.rank == 1
    finally:
        for b in beaters:
            b.stop()
        mon.close()
