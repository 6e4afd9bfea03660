"""A local Google Cloud Storage emulator, for tests and benchmarks: gs:// without a cloud.

    from orchestrator.emulator.storage import running_storage

    with running_storage(buckets=("ckpt",)) as gcs:     # a process serving on 127.0.0.1
        storage.configure(gcs.url)                       # workers.storage: point this process's clients at it
        ...                                              # or give the job `storage: {endpoint: <gcs.url>}`

It is the PyPI package `gcp-storage-emulator` (pure Python; the GCS JSON API: media,
multipart and resumable uploads, ranged downloads, listing with prefixes and delimiters,
deletes, copies, compose), run in a process of its own with four changes made here:

- **Generation preconditions** (`ifGenerationMatch`, `ifGenerationNotMatch`,
  `ifMetagenerationMatch`, `ifMetagenerationNotMatch`), which the package ignores: a write
  (any upload, copy, rewrite or compose), a delete or a read whose precondition fails is
  answered 412 as GCS does (a read with a matching ``ifGenerationNotMatch``: 304), checked
  and applied under one lock, so two writers racing on ``ifGenerationMatch`` cannot both
  win; ``ifGenerationMatch=0`` means "only if there is no such object". Downloads carry
  ``x-goog-generation`` and ``x-goog-metageneration`` as GCS's do. This is
  `_PreconditionStorage` and `_Handler` below.
- **Concurrent connections**: the package serves one connection at a time with a listen
  backlog of 5, which tensorstore's parallel requests overflow (a dropped connection
  waits out a TCP retransmit); here a threaded server accepts them and handles the requests
  one at a time under the lock (the package's storage is not thread-safe).
- **Empty objects**: the package fails a zero-byte media or XML upload (it reads the empty body as
  None and answers nothing); here it makes the empty object, as GCS does
  (`_empty_uploads_are_objects`).
- **No soft delete** by default (the package keeps a deleted object's bytes for 7 days, as
  a new GCS bucket does; a test that saves many checkpoints would hold them all), and no
  metadata file rewritten at each write (the store is in memory).

Each client finds it through the environment (`workers.storage.endpoint_env`, set in a
process by `workers.storage.configure(url)`):

====================================  ===================================================
client                                setting
====================================  ===================================================
gcsfs / fsspec (tokens, epath, orbax  ``STORAGE_EMULATOR_HOST=<url>``; anonymous
directory operations)                 credentials and ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false``
                                      (gcsfs otherwise asks the Storage Control gRPC API
                                      for the bucket's layout, which no emulator serves:
                                      a 60 s timeout per bucket)
google-cloud-storage (the fence)      ``STORAGE_EMULATOR_HOST=<url>`` (anonymous credentials)
tensorstore (orbax's array data)      ``TENSORSTORE_GCS_HTTP_URL=<url>`` and
                                      ``GOOGLE_AUTH_TOKEN_FOR_TESTING=<anything>``; both read
                                      when tensorstore first opens a gs:// store in the process
====================================  ===================================================

The emulator binds loopback addresses only and keeps everything in memory; `stop` (or the
end of the `with` block) ends its process, and the process also ends by itself when the
one that started it goes (it reads its stdin until EOF). `python -m
orchestrator.emulator.storage --port 8471 --bucket my-bucket` serves one from a shell.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse

log = logging.getLogger(__name__)

_READY = "storage emulator ready on "
# The object paths a GET or DELETE names (JSON API, its download path, and the path-style alias).
_OBJECT_PATH = re.compile(r"^(?:/download)?(?:/storage/v1)?/b/(?P<bucket>[-.\w]+)/o/(?P<object>.+)$")
_NOT_AN_OBJECT = ("/copyTo/", "/rewriteTo/", "/compose", "/acl", "/restore")


# -- the handle (the process that starts one) -----------------------------------------------


@dataclass
class StorageEmulator:
    """A running emulator process: `url` is the endpoint to give clients (``http://127.0.0.1:PORT``)."""

    url: str
    buckets: list[str]
    _proc: subprocess.Popen = field(repr=False)

    def env(self) -> dict[str, str]:
        """The environment that points every client at this emulator (for a subprocess)."""
        from workers.storage import endpoint_env

        return endpoint_env(self.url)

    def create_bucket(self, name: str) -> None:
        """Create bucket `name` (an existing one is fine)."""
        import requests

        r = requests.post(f"{self.url}/storage/v1/b", params={"project": "emulator"}, json={"name": name}, timeout=10)
        if r.status_code not in (200, 409):
            raise RuntimeError(f"creating bucket {name} on the storage emulator: HTTP {r.status_code} {r.text[:200]}")
        if name not in self.buckets:
            self.buckets.append(name)

    def running(self) -> bool:
        return self._proc.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        """End the emulator's process (idempotent); everything it held is gone."""
        proc = self._proc
        if proc.poll() is None:
            assert proc.stdin is not None, "started with stdin=PIPE"
            with contextlib.suppress(OSError):
                proc.stdin.close()  # EOF: it shuts down by itself
            try:
                proc.wait(timeout=timeout / 2)
            except subprocess.TimeoutExpired:
                proc.terminate()
                try:
                    proc.wait(timeout=timeout / 2)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        for stream in (proc.stdin, proc.stdout):
            with contextlib.suppress(OSError):
                if stream is not None:
                    stream.close()


def serve_storage(buckets: tuple[str, ...] | list[str] = ("test-bucket",), *, host: str = "127.0.0.1",
                  port: int | None = None, start_timeout_s: float = 60.0) -> StorageEmulator:
    """Start an emulator process on `host` (loopback only) and `port` (None: a free one) with `buckets`.

    Returns once it answers. Needs the `gcp-storage-emulator` package (the `test` extra).
    """
    _require_loopback(host)
    from orchestrator.cluster import free_port

    last = ""
    for _ in range(3):  # a free port can be taken by someone else before the emulator binds it
        chosen = port or free_port()
        # This file as a script (-P: without its folder on sys.path): the server needs nothing of the
        # project, and importing the package would cost its start a second or more.
        cmd = [sys.executable, "-P", os.path.abspath(__file__), "--host", host, "--port", str(chosen),
               "--exit-with-stdin", *[a for b in buckets for a in ("--bucket", b)]]
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        line = _read_line(proc, start_timeout_s)
        if line.startswith(_READY):
            return StorageEmulator(url=line[len(_READY):].strip(), buckets=list(buckets), _proc=proc)
        last = line or f"exit code {proc.poll()}"
        StorageEmulator("", [], proc).stop()
        if port is not None:
            break
    raise RuntimeError(f"the storage emulator did not start: {last}")


@contextlib.contextmanager
def running_storage(buckets: tuple[str, ...] | list[str] = ("test-bucket",), **kwargs) -> Iterator[StorageEmulator]:
    """`serve_storage(...)` for the duration of the block; its process is ended on exit."""
    emu = serve_storage(buckets, **kwargs)
    try:
        yield emu
    finally:
        emu.stop()


def _read_line(proc: subprocess.Popen, timeout_s: float) -> str:
    """The first line the emulator prints ("ready on URL" or why it could not start), or "" at a timeout."""
    out: list[str] = []
    stdout = proc.stdout
    assert stdout is not None, "started with stdout=PIPE"
    reader = threading.Thread(target=lambda: out.append(stdout.readline()), daemon=True,
                              name="storage-emulator-start")
    reader.start()
    reader.join(timeout_s)
    return out[0].strip() if out else ""


def _require_loopback(host: str) -> None:
    try:
        ok = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"the storage emulator binds loopback addresses only, got {host!r}")


# -- the server (the emulator's own process) ------------------------------------------------


class PreconditionFailed(Exception):
    """A write, delete or read whose generation precondition does not hold (HTTP 412)."""


_request = threading.local()  # the preconditions of the request this thread handles


def _conditions(query: dict[str, list[str]]) -> dict[str, int]:
    names = ("ifGenerationMatch", "ifGenerationNotMatch", "ifMetagenerationMatch", "ifMetagenerationNotMatch")
    out = {}
    for name in names:
        if name in query:
            try:
                out[name] = int(query[name][0])
            except ValueError:
                raise PreconditionFailed(f"{name} must be an integer, got {query[name][0]!r}") from None
    return out


def _violated(conditions: dict[str, int], obj: dict | None) -> str | None:
    """Which precondition `obj` (None: there is no live object) fails, if any."""
    generation = int(obj["generation"]) if obj else 0
    metageneration = int(obj["metageneration"]) if obj else None
    c = conditions
    if "ifGenerationMatch" in c and generation != c["ifGenerationMatch"]:
        return f"ifGenerationMatch={c['ifGenerationMatch']} (the object's generation is {generation})"
    if "ifGenerationNotMatch" in c and generation == c["ifGenerationNotMatch"]:
        return f"ifGenerationNotMatch={c['ifGenerationNotMatch']}"
    if "ifMetagenerationMatch" in c and metageneration != c["ifMetagenerationMatch"]:
        return f"ifMetagenerationMatch={c['ifMetagenerationMatch']} (it is {metageneration})"
    if "ifMetagenerationNotMatch" in c and metageneration == c["ifMetagenerationNotMatch"]:
        return f"ifMetagenerationNotMatch={c['ifMetagenerationNotMatch']}"
    return None


def _empty_uploads_are_objects() -> None:
    """The package reads an empty request body as None, and its media and XML uploads then fail on
    ``len(None)`` (no answer at all): a zero-byte object (gcsfs's folder markers, an empty file) is an
    empty body here, as on GCS. Patched in the emulator's own process only."""
    from gcp_storage_emulator import server

    read = server._read_data

    def read_data(handler, query):
        data = read(handler, query)
        if data is None and (query.get("uploadType") == ["media"] or handler.command == "PUT"):
            return b""
        return data

    server._read_data = read_data


def _make_server(host: str, port: int, buckets: list[str]) -> ThreadingHTTPServer:
    """The package's server over an in-memory storage that keeps GCS's preconditions, with `buckets` made."""
    from gcp_storage_emulator.handlers import buckets as bucket_api

    _empty_uploads_are_objects()
    storage = _precondition_storage()
    for name in buckets:
        bucket_api.create_bucket(name, storage)
    handler = _handler_class(storage)

    class _Server(ThreadingHTTPServer):
        daemon_threads = True
        request_queue_size = 128  # tensorstore opens many connections at once

        def __init__(self):
            self.lock = threading.Lock()
            super().__init__((host, port), lambda *a: handler(storage, *a))

        def handle_error(self, request, client_address):
            if isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
                return  # a client that stopped reading (tensorstore cancels reads it no longer needs)
            super().handle_error(request, client_address)

    return _Server()


def _precondition_storage() -> Any:
    """The package's in-memory storage, made to check GCS's preconditions at every object write."""
    from gcp_storage_emulator.storage import Storage

    class _PreconditionStorage(Storage):
        """The package's in-memory storage, checking the request's preconditions at every object write."""

        def create_file(self, bucket_name, file_name, content, file_obj, file_id=None):
            conditions = getattr(_request, "conditions", None)
            if conditions:
                why = _violated(conditions, self.objects.get(bucket_name, {}).get(file_name))
                if why:
                    raise PreconditionFailed(f"{bucket_name}/{file_name}: {why}")
            return super().create_file(bucket_name, file_name, content, file_obj, file_id)

        def _write_config_to_file(self):  # in memory: there is no file to keep the metadata in
            pass

        def _bucket_soft_delete_retention_seconds(self, bucket_name):
            policy = (self.buckets.get(bucket_name) or {}).get("softDeletePolicy") or {}
            return int(policy.get("retentionDurationSeconds") or 0)  # none unless a bucket asks for it

    return _PreconditionStorage(use_memory_fs=True)


def _handler_class(storage: Any) -> type:
    """The package's request handler, answering a request whose preconditions fail as GCS does (412, or 304)."""
    from gcp_storage_emulator.server import RequestHandler, Router

    class _Handler(RequestHandler):
        def _serve(self, method: str) -> None:
            self._extra_headers: dict[str, str] = {}
            with self.server.lock:
                try:
                    url = urlparse(self.path)
                    _request.conditions = _conditions(parse_qs(url.query))
                    if _object_checks(self, storage, method, url.path, _request.conditions):
                        Router(self).handle(method)
                except PreconditionFailed as e:
                    _answer(self, HTTPStatus.PRECONDITION_FAILED, str(e))
                finally:
                    _request.conditions = None

        def end_headers(self):
            for k, v in getattr(self, "_extra_headers", {}).items():
                self.send_header(k, v)
            super().end_headers()

        def do_GET(self):
            self._serve("GET")

        def do_POST(self):
            self._serve("POST")

        def do_PUT(self):
            self._serve("PUT")

        def do_DELETE(self):
            self._serve("DELETE")

        def do_PATCH(self):
            self._serve("PATCH")

    return _Handler


def _object_checks(handler: Any, storage: Any, method: str, path: str, conditions: dict[str, int]) -> bool:
    """A GET's or DELETE's preconditions and a download's generation headers; False once answered."""
    m = _OBJECT_PATH.match(path)
    if method not in ("GET", "DELETE") or not m or any(s in path for s in _NOT_AN_OBJECT):
        return True
    obj = storage.objects.get(m["bucket"], {}).get(unquote(m["object"]))
    if obj is None:
        return True  # the package answers 404
    handler._extra_headers = {"x-goog-generation": str(obj["generation"]),
                              "x-goog-metageneration": str(obj["metageneration"])}
    why = _violated(conditions, obj)
    if why is None:
        return True
    if method == "GET" and why.startswith(("ifGenerationNotMatch", "ifMetagenerationNotMatch")):
        _answer(handler, HTTPStatus.NOT_MODIFIED, "")  # a cached copy is still current
        return False
    raise PreconditionFailed(f"{m['bucket']}/{unquote(m['object'])}: {why}")


def _answer(handler: Any, status: HTTPStatus, message: str) -> None:
    """A failed precondition as GCS answers it: 412 with its JSON error, or 304 with no body."""
    body = b"" if status == HTTPStatus.NOT_MODIFIED else json.dumps(
        {"error": {"code": status.value, "message": message,
                   "errors": [{"domain": "global", "reason": "conditionNotMet", "message": message}]}}).encode()
    handler.send_response(status.value)
    if body:
        handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m orchestrator.emulator.storage",
                                description="Serve a local Google Cloud Storage emulator (in memory) "
                                            "until interrupted.")
    p.add_argument("--host", default="127.0.0.1", help="a loopback address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8471, help="default 8471")
    p.add_argument("--bucket", action="append", default=[], help="a bucket to create at start (repeatable)")
    p.add_argument("--exit-with-stdin", action="store_true", help="stop when standard input closes (for a parent)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("gcp_storage_emulator", "api.object", "api.bucket", "api.buckets"):
        logging.getLogger(noisy).setLevel(logging.CRITICAL)  # every 404 is an ERROR there; every text reply a WARNING
    try:
        _require_loopback(args.host)
        server = _make_server(args.host, args.port, args.bucket)
    except (ValueError, OSError, ImportError) as e:
        print(f"cannot start: {e}", flush=True)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    if args.exit_with_stdin:
        def stop_at_eof() -> None:
            sys.stdin.read()
            stop.set()

        threading.Thread(target=stop_at_eof, daemon=True).start()
    serving = threading.Thread(target=server.serve_forever, name="storage-emulator", daemon=True)
    serving.start()
    print(f"{_READY}http://{args.host}:{server.server_address[1]}", flush=True)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        server.shutdown()
        server.server_close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
