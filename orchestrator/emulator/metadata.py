"""A local stand-in for the GCE metadata server's preemption endpoints.

Serves ``/computeMetadata/v1/instance/preempted`` and ``.../maintenance-event`` on
127.0.0.1, honouring ``?wait_for_change=true`` (the request blocks until the value
changes or a timeout passes) and requiring the ``Metadata-Flavor: Google`` header, as
the real server does. Like the TPU API emulator beside it, it lets the preemption path
(hosts long-polling ``recovery.metadata_url``) run off Google Cloud: tests and
benchmarks set ``instance/preempted`` to ``TRUE`` to send a notice.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

# What a notice announces (`orchestrator emulator notice --event`): the key GCE sets and its value, which hosts
# long-poll for (`workers.notices`).
NOTICE_EVENTS = {"preempted": ("instance/preempted", "TRUE"),
                 "maintenance": ("instance/maintenance-event", "TERMINATE_ON_HOST_MAINTENANCE")}


class FakeMetadataServer:
    """Serves on a free port from construction until `close()`; `url` is the ``metadata_url`` to give hosts."""

    def __init__(self):
        self.values = {"instance/preempted": "FALSE", "instance/maintenance-event": "NONE"}
        self.requests = 0
        self._changed = threading.Condition()
        server = self

        class MetadataHandler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                server.requests += 1
                url = urlparse(self.path)
                key = url.path.removeprefix("/computeMetadata/v1/")
                if self.headers.get("Metadata-Flavor") != "Google":
                    self.send_error(403, "Missing Metadata-Flavor header")
                    return
                if key not in server.values:
                    self.send_error(404)
                    return
                query = parse_qs(url.query)
                if query.get("wait_for_change") == ["true"]:
                    timeout = float(query.get("timeout_sec", ["30"])[0])
                    start = server.values[key]
                    with server._changed:
                        server._changed.wait_for(lambda: server.values[key] != start, timeout=min(timeout, 5))
                body = server.values[key].encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/text")
                self.send_header("Content-Length", str(len(body)))
                try:
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):  # the host went while it waited: as on GCE
                    pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), MetadataHandler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/computeMetadata/v1"

    def set(self, key: str, value: str) -> None:
        with self._changed:
            self.values[key] = value
            self._changed.notify_all()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)
