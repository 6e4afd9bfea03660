"""The TPU API client keeps its HTTP connections for reuse when many drivers call it at once
(`Polling.connections`): a connection the pool has no room for is closed once its call ends, and the next
call opens a new one (on the real API a TLS handshake)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from orchestrator.providers.gcp.api import RetryPolicy, TpuApi

CALLERS, CALLS_EACH = 16, 4


class _NotFoundTogether(BaseHTTPRequestHandler):
    """Answers every GET with the API's 404 once all of a burst's requests have arrived, so they hold their
    connections at once however slowly a loaded machine runs the callers; counts the connections it was given."""

    protocol_version = "HTTP/1.1"  # keep-alive, as the API speaks

    def setup(self) -> None:
        super().setup()
        with self.server.lock:  # type: ignore[attr-defined]
            self.server.connections += 1  # type: ignore[attr-defined]

    def do_GET(self) -> None:  # noqa: N802 -- http.server's name
        self.server.burst.wait()  # type: ignore[attr-defined]
        body = json.dumps({"error": {"code": 404, "message": "not found", "status": "NOT_FOUND"}}).encode()
        self.send_response(404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


class _Server(ThreadingHTTPServer):
    request_queue_size = 64  # a burst's connections wait in the backlog, not for a SYN sent again a second later


@pytest.fixture
def server():
    srv = _Server(("127.0.0.1", 0), _NotFoundTogether)
    srv.lock, srv.connections, srv.daemon_threads = threading.Lock(), 0, True
    srv.burst = threading.Barrier(CALLERS, timeout=30)  # a burst that never gathers fails, it does not hang
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()
    thread.join()


def _connections_for_overlapping_calls(server, connections: int) -> int:
    api = TpuApi("proj", endpoint=f"http://127.0.0.1:{server.server_address[1]}", credentials=None,
                 impersonate=None, retry=RetryPolicy(attempts=1), request_timeout_s=10, sleep=time.sleep,
                 connections=connections)
    together = threading.Barrier(CALLERS)  # bursts, as a mass reclaim makes them: all call, then none
    answers: list[object] = []

    def caller() -> None:
        for _ in range(CALLS_EACH):
            together.wait()
            answers.append(api.get("us-central2-b", "qr", "nothing-here"))

    threads = [threading.Thread(target=caller) for _ in range(CALLERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert answers == [None] * CALLERS * CALLS_EACH  # every call reached the server and read its 404
    return server.connections


def test_overlapping_calls_reuse_the_kept_connections(server):
    assert _connections_for_overlapping_calls(server, connections=CALLERS) <= CALLERS


def test_a_pool_smaller_than_the_callers_opens_new_connections_for_every_burst(server):
    """What the default pool of 10 did with more callers than that: once a burst ended, the connections a full
    pool could not keep were closed, and the next burst opened new ones."""
    assert _connections_for_overlapping_calls(server, connections=4) == CALLERS + (CALLERS - 4) * (CALLS_EACH - 1)
