"""A host's beat: a small signed UDP datagram to the controller's liveness monitor, every period.

Ray's node health check takes 15-65 s to call a silent host dead, and a multi-host runtime's
survivors wait on the vanished peer meanwhile (a powered-off VM sends no reset). So each worker
sends its own sign of life on a thread of its own, which keeps its period while the training
thread is blocked in a collective (gloo and XLA release the GIL there); the controller's side
decides what silence means (`orchestrator.control.liveness`).

A beat names the job, the generation and the rank, and is sealed with HMAC-SHA256 under the
launch's key (handed over Ray's authenticated channel, never logged), so no other process on
the network can keep a dead host looking alive or make a live one look dead by replaying.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import socket
import threading
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

PERIOD_S = 0.25  # the default; a job's `recovery.beat_period_s` changes it
MAC_BYTES = 32


@dataclass(frozen=True)
class Beat:
    job_id: str
    generation: int
    rank: int
    seq: int


def encode(key: bytes, beat: Beat) -> bytes:
    body = json.dumps([beat.job_id, beat.generation, beat.rank, beat.seq], separators=(",", ":")).encode()
    return hmac.new(key, body, hashlib.sha256).digest() + body


def sender(data: bytes) -> tuple[str, int] | None:
    """The job and generation a datagram claims to be from (unverified: it picks the key to verify with)."""
    try:
        job_id, generation, _, _ = json.loads(data[MAC_BYTES:])
        return str(job_id), int(generation)
    except (ValueError, TypeError):
        return None


def decode(key: bytes, data: bytes) -> Beat | None:
    """The beat `data` carries, or None if it is not one sealed with `key`."""
    mac, body = data[:MAC_BYTES], data[MAC_BYTES:]
    if not hmac.compare_digest(mac, hmac.new(key, body, hashlib.sha256).digest()):
        return None
    try:
        job_id, generation, rank, seq = json.loads(body)
        return Beat(str(job_id), int(generation), int(rank), int(seq))
    except (ValueError, TypeError):
        return None


class Beater:
    """Sends this host's beats to `address` every `period_s` until `stop` (or the process ends)."""

    def __init__(self, address: tuple[str, int], key: bytes, job_id: str, generation: int, rank: int,
                 period_s: float = PERIOD_S):
        self.address, self.period_s = address, period_s
        self._key, self._beat = key, Beat(job_id, generation, rank, 0)
        self._stopped = threading.Event()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._thread = threading.Thread(target=self._run, daemon=True, name="beats")

    def start(self) -> Beater:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        seq, next_at = 0, time.monotonic()
        while not self._stopped.is_set():
            try:
                self._sock.sendto(encode(self._key, Beat(self._beat.job_id, self._beat.generation,
                                                         self._beat.rank, seq)), self.address)
            except OSError as e:  # the controller's host unreachable for now: the next beat tries again
                log.debug("beat %d not sent: %s", seq, e)
            seq += 1
            next_at += self.period_s  # a fixed rate: a late beat does not push the later ones back
            self._stopped.wait(max(0.0, next_at - time.monotonic()))
        self._sock.close()
