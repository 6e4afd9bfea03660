"""HTTP routing: the TPU API v2 REST paths the client calls, and the `/_emulator/` control API.

API paths (as ``google.cloud.tpu_v2``'s REST transport sends them):

    POST   /v2/projects/P/locations/Z/queuedResources?queuedResourceId=Q   body: QueuedResource
    GET    /v2/projects/P/locations/Z/queuedResources[/Q]
    DELETE /v2/projects/P/locations/Z/queuedResources/Q[?force=true]
    POST   /v2/projects/P/locations/Z/nodes?nodeId=N                       body: Node
    GET    /v2/projects/P/locations/Z/nodes[/N]
    DELETE /v2/projects/P/locations/Z/nodes/N
    GET    /v2/projects/P/locations/Z/operations/OP

Every API call answers only the fields an ``X-Goog-FieldMask`` header or a ``fields`` query parameter names
(`fieldmask`), as Google's APIs do.

Control paths (JSON in, JSON out; see ``ControlClient`` for the same over Python). Each
needs the emulator's control token, ``Authorization: Bearer <token>`` (else 401, and
nothing changes), and each POST a JSON body sent as ``application/json`` (else 415):
a browser page can send a text/plain POST to 127.0.0.1 without asking first, never an
application/json one. The API paths take no token (the real client calls them with
anonymous credentials), so a request there that carries an ``Origin`` header, which
browsers send and the TPU client never does, is refused with 403.

    GET  /_emulator/state             resources, operations and the fault plan
    GET  /_emulator/requests          every API request served: method, zone, status
    POST /_emulator/fail              {"method", "kind", "count"?, "zone"?}
    POST /_emulator/random-errors     {"rate", "codes"?, "seed"?, "methods"?}
    POST /_emulator/stockout          {"zone", "acceleratorType"?, "mode"?: "wait"|"fail"}
    POST /_emulator/clear-stockout    {"zone"?}
    POST /_emulator/clear-faults      {}
    POST /_emulator/reclaim           {"name"}   a queued resource or node, id or full name
    POST /_emulator/terminate         {"name"}   a node's host dies (node TERMINATED)
    POST /_emulator/poweroff          {"name", "host"?, "silent"?}  VMs off: all (node TERMINATED) or host N
                                      (needs VMs); silent: host N's processes frozen, peers see no reset
    POST /_emulator/notice            {"name", "host"?, "event"?: "preempted"|"maintenance"}  on VMs' metadata

Request headers are never logged or stored: a request's record keeps only whether
it carried an Authorization header.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler
from typing import Any, Protocol
from urllib.parse import parse_qs, urlsplit

from google.cloud import tpu_v2

from orchestrator.emulator import fieldmask
from orchestrator.emulator.errors import ApiError, invalid, not_found
from orchestrator.emulator.metadata import NOTICE_EVENTS
from orchestrator.emulator.world import World

log = logging.getLogger(__name__)

_API_RE = re.compile(
    r"^/v2/projects/(?P<project>[^/]+)/locations/(?P<zone>[^/]+)"
    r"/(?P<coll>nodes|queuedResources|operations)(?:/(?P<id>[^/:]+))?$"
)

# (HTTP verb, collection, whether the path names one resource) -> API method
_METHODS = {
    ("POST", "queuedResources", False): "queuedResources.create",
    ("GET", "queuedResources", False): "queuedResources.list",
    ("GET", "queuedResources", True): "queuedResources.get",
    ("DELETE", "queuedResources", True): "queuedResources.delete",
    ("POST", "nodes", False): "nodes.create",
    ("GET", "nodes", False): "nodes.list",
    ("GET", "nodes", True): "nodes.get",
    ("DELETE", "nodes", True): "nodes.delete",
    ("GET", "operations", True): "operations.get",
}
# API method -> the message its answer is (what a field mask is checked against); an operation's fields are not
# checked, only kept or dropped
_ANSWERS = {
    "queuedResources.list": tpu_v2.ListQueuedResourcesResponse.pb().DESCRIPTOR,
    "queuedResources.get": tpu_v2.QueuedResource.pb().DESCRIPTOR,
    "nodes.list": tpu_v2.ListNodesResponse.pb().DESCRIPTOR,
    "nodes.get": tpu_v2.Node.pb().DESCRIPTOR,
}


@dataclass(frozen=True)
class RequestRecord:
    method: str  # API method (e.g. "queuedResources.create"), or "control"
    verb: str
    path: str  # without the query string
    zone: str
    status: int
    authorized: bool  # an Authorization header came with it (its value is never kept)
    at: float


class EmulatorSurface(Protocol):
    """What a request reaches of the emulator (`orchestrator.emulator.server.Emulator` is one): the world the
    API's calls change, the control API's token and its operations, and where each request is recorded.
    Named here, beside its one user, so that the routes need not import the server that serves them."""

    world: World
    control_token: str

    def record_request(self, rec: RequestRecord) -> None: ...

    def state(self) -> dict[str, Any]: ...

    def requests(self, method: str | None = None, *, zone: str | None = None) -> list[RequestRecord]: ...

    def fail(self, method: str, kind: str, *, count: int = 1, zone: str | None = None) -> None: ...

    def random_errors(self, rate: float, *, codes: tuple[int, ...] = (503, 429), seed: int | None = None,
                      methods: tuple[str, ...] | None = None) -> None: ...

    def stockout(self, zone: str, *, accelerator_type: str | None = None, mode: str = "wait") -> None: ...

    def clear_stockout(self, zone: str | None = None) -> None: ...

    def clear_faults(self) -> None: ...

    def reclaim(self, name: str) -> str: ...

    def terminate(self, name: str) -> str: ...

    def power_off(self, name: str, *, host: int | None = None, silent: bool = False) -> str: ...

    def notice(self, name: str, *, host: int | None = None, event: str = "preempted") -> list[int]: ...


class ApiHandler(BaseHTTPRequestHandler):
    # HTTP/1.0 closes each connection after its response, so no handler thread
    # outlives the server waiting on an idle keep-alive connection.
    protocol_version = "HTTP/1.0"
    server_version = "tpu-emulator"

    @property
    def emulator(self) -> EmulatorSurface:
        return self.server.emulator  # type: ignore[attr-defined]

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def log_message(self, format: str, *args: Any) -> None:
        # The default writes every request line to stderr; keep it at debug level.
        log.debug("%s " + format, self.address_string(), *args)

    def _dispatch(self, verb: str) -> None:
        url = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length).decode() if length else ""
        method, zone = "control", ""
        try:
            if url.path.startswith("/_emulator/"):
                self._check_control_request(verb)
                status, payload = 200, self._control(verb, url.path.removeprefix("/_emulator/"), body)
            else:
                if self.headers.get("Origin") is not None:  # only browsers send it; the TPU client never does
                    raise ApiError(403, "PERMISSION_DENIED",
                                   "cross-origin requests to the emulated TPU API are refused")
                match = _API_RE.match(url.path)
                key = (verb, match["coll"], match["id"] is not None) if match else None
                if match is None or key not in _METHODS:
                    raise not_found(url.path)
                method, zone = _METHODS[key], match["zone"]
                int_enums = "enum-encoding=int" in query.get("$alt", "")
                answer = _ANSWERS.get(method)
                mask = self.headers.get("X-Goog-FieldMask") or query.get("fields") or ""
                fields = fieldmask.parse(mask)  # a bad mask is refused before anything changes
                if answer is not None:
                    fieldmask.check(fields, answer, mask)
                status, payload = 200, fieldmask.apply(
                    _render(self._api(method, match, query, body), coll=match["coll"], query=query,
                            int_enums=int_enums), fields, answer)
        except ApiError as e:
            status, payload = e.http, e.body()
        except (ValueError, KeyError, TypeError) as e:  # a malformed control request
            status, payload = 400, invalid(f"bad control request: {e!r}").body()
        except Exception:  # the boundary of one request: answer 500, keep serving
            log.exception("emulator failed on %s %s", verb, url.path)
            status, payload = 500, ApiError(500, "INTERNAL", "emulator error").body()
        authorized = "authorization" in {k.lower() for k in self.headers.keys()}
        self.emulator.record_request(RequestRecord(method, verb, url.path, zone, status, authorized, time.time()))
        data = json.dumps(payload).encode()
        self.send_response(status)
        if status == 401:
            self.send_header("WWW-Authenticate", 'Bearer realm="tpu-emulator control"')
        self.send_header("Content-Type", "application/json; charset=UTF-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    # -- the TPU API ----------------------------------------------------------------

    def _api(self, method: str, match: re.Match[str], query: dict[str, str], body: str) -> Any:
        world = self.emulator.world
        project, zone, rid = match["project"], match["zone"], match["id"]
        parent = f"projects/{project}/locations/{zone}"
        error = world.faults.before(method, zone, parent)
        if error is not None:
            raise error
        world.check_zone(zone, project)
        coll = match["coll"]
        name = f"{parent}/{coll}/{rid}"
        if method == "queuedResources.create":
            spec = _parse(tpu_v2.QueuedResource, body)
            return world.create_queued_resource(project, zone, query.get("queuedResourceId", ""), spec)
        if method == "nodes.create":
            return world.create_node(project, zone, query.get("nodeId", ""), _parse(tpu_v2.Node, body))
        if method.endswith(".get"):
            return world.get(coll, name)
        if method.endswith(".list"):
            return world.list(coll, parent)
        if method == "queuedResources.delete":
            return world.delete_queued_resource(project, zone, name, force=query.get("force") == "true")
        if method == "nodes.delete":
            return world.delete_node(project, zone, name)
        raise AssertionError(f"unrouted method {method}")

    # -- the control API ----------------------------------------------------------------

    def _check_control_request(self, verb: str) -> None:
        """Refuse a control request without the token, or a POST whose body is not JSON."""
        scheme, _, given = (self.headers.get("Authorization") or "").partition(" ")
        # Bytes, so that any header value compares (compare_digest refuses non-ASCII str);
        # headers arrive decoded as latin-1, which encodes back losslessly.
        expected = self.emulator.control_token.encode()
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode("latin-1", "replace"), expected):
            raise ApiError(401, "UNAUTHENTICATED",
                           "the control API needs the emulator's control token (Authorization: Bearer <token>); "
                           "`orchestrator emulator` prints it at start", "CONTROL_TOKEN_INVALID")
        sent = self.headers.get("Content-Type")
        if verb == "POST" and (sent is None or self.headers.get_content_type() != "application/json"):
            raise ApiError(415, "INVALID_ARGUMENT",
                           f"control requests send their JSON as application/json, not {sent or 'without a type'}",
                           "BAD_CONTENT_TYPE")

    def _control(self, verb: str, what: str, body: str) -> Any:
        emu = self.emulator
        if verb == "GET" and what == "state":
            return emu.state()
        if verb == "GET" and what == "requests":
            return {"requests": [asdict(r) for r in emu.requests()]}
        operation = _CONTROL_OPERATIONS.get(what) if verb == "POST" else None
        if operation is None:
            raise not_found(f"/_emulator/{what}")
        args = json.loads(body or "{}")
        if not isinstance(args, dict):
            raise ValueError("control requests take a JSON object")
        answer = operation(emu, args)
        return {} if answer is None else answer


# The control API's operations (POST /_emulator/<name>, a JSON object of arguments): what each asks of the
# emulator, and what it answers (None: an empty object).
_CONTROL_OPERATIONS: dict[str, Callable[[EmulatorSurface, dict[str, Any]], Any]] = {
    "fail": lambda emu, a: emu.fail(a["method"], a["kind"], count=a.get("count", 1), zone=a.get("zone")),
    "random-errors": lambda emu, a: emu.random_errors(
        a["rate"], codes=tuple(a.get("codes", (503, 429))), seed=a.get("seed"),
        methods=tuple(a["methods"]) if a.get("methods") else None),
    "stockout": lambda emu, a: emu.stockout(a["zone"], accelerator_type=a.get("acceleratorType"),
                                            mode=a.get("mode", "wait")),
    "clear-stockout": lambda emu, a: emu.clear_stockout(a.get("zone")),
    "clear-faults": lambda emu, a: emu.clear_faults(),
    "reclaim": lambda emu, a: {"name": emu.reclaim(a["name"])},
    "terminate": lambda emu, a: {"name": emu.terminate(a["name"])},
    "poweroff": lambda emu, a: {"name": emu.power_off(a["name"], host=_host(a), silent=_silent(a))},
    "notice": lambda emu, a: {"hosts": emu.notice(a["name"], host=_host(a), event=_event(a))},
}


def _host(args: dict[str, Any]) -> int | None:
    host = args.get("host")
    if host is not None and (isinstance(host, bool) or not isinstance(host, int)):
        raise invalid(f"host must be a host's number (0, 1, ...), got {host!r}")
    return host


def _silent(args: dict[str, Any]) -> bool:
    silent = args.get("silent", False)
    if not isinstance(silent, bool):
        raise invalid(f"silent must be true or false, got {silent!r}")
    return silent


def _event(args: dict[str, Any]) -> str:
    event = args.get("event", "preempted")
    if event not in NOTICE_EVENTS:
        raise invalid(f"event must be one of {', '.join(NOTICE_EVENTS)}, got {event!r}")
    return event


def _parse(cls: Any, body: str) -> Any:
    # Strict, as the real API: an unknown field is an error, not silently dropped.
    try:
        return cls.from_json(body or "{}", ignore_unknown_fields=False)
    # protobuf's ParseError (bad JSON, an unknown field, a value of the wrong type); protobuf is no declared
    # dependency of the product (it comes with google-cloud-tpu), so its class is not imported here to be named
    except Exception as e:  # noqa: BLE001 -- see above; answered as the API answers, 400 with the parser's reason
        raise invalid(f"Invalid JSON payload received. {e}") from None


def _render(result: Any, *, coll: str, query: dict[str, str], int_enums: bool) -> dict:
    if not isinstance(result, list):
        return result.render(int_enums)
    # A list call: one page of it, with a token for the next.
    start = int(query.get("pageToken") or 0)
    size = int(query.get("pageSize") or 0) or len(result) or 1
    out: dict[str, Any] = {coll: [r.render(int_enums) for r in result[start : start + size]]}
    if start + size < len(result):
        out["nextPageToken"] = str(start + size)
    return out
