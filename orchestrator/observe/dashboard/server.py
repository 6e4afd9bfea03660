"""The dashboard's HTTP server: pages, JSON and actions, on 127.0.0.1, behind the cluster's token.

Served by the controller from a thread (stdlib `http.server`, as the metrics are): no web
framework, no process of its own. `orchestrator dashboard` prints the one link that logs
in, ``http://127.0.0.1:PORT/?token=TOKEN``.

Who may see what:

- **Every path** (pages, scripts, JSON, logs) needs either the session cookie or an
  ``Authorization: Bearer TOKEN`` header; anything else gets 401 and nothing of the jobs.
  Tokens are compared in constant time.
- **Logging in**: a request carrying ``?token=TOKEN`` gets the session cookie
  (HttpOnly, SameSite=Strict, path /) and is redirected to the same path without the
  token, so the token does not stay in the address bar. The cookie holds no token: it is
  a random nonce and its issue time, signed with a key derived from the token (HMAC), and
  lasts 7 days; a new token (a new cluster's) voids every cookie.
- **Actions** (cancel, resize) are POSTs. With the cookie they also need the session's
  CSRF token (a second HMAC of the nonce; the page reads it from its own meta tag) and an
  ``Origin`` (or, without one, a ``Referer``) that is this dashboard's own origin. Other
  sites on 127.0.0.1 are the same *site* to a browser whatever their port, so SameSite
  alone would not keep them out. A request with the bearer header needs neither: no page
  can make a browser send that header cross-site.
- The ``Host`` header must name this server (127.0.0.1, localhost or [::1] with its port),
  which keeps out DNS-rebinding pages; every answer forbids framing, caching and sniffing,
  and the pages run only their own scripts (Content-Security-Policy).

Routes: ``/`` (all jobs), ``/job/ID`` (one job), ``/static/NAME``, ``/api/overview`` (``?page=N``),
``/api/jobs/ID``, ``/api/jobs/ID/logs``, POST ``/api/jobs/ID/cancel``,
``/api/jobs/ID/resize`` (JSON or form body: ``accelerator``, ``tier``, ``reason``) and
``/api/jobs/ID/profile`` (``steps``, ``host``: a number or ``all``; `orchestrator profile`).
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import re
import threading
import urllib.parse
from http import HTTPStatus
from http.cookies import CookieError, SimpleCookie
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Protocol

from orchestrator.cluster import Home
from orchestrator.errors import JobNotFoundError, OrchestratorError
from orchestrator.observe.dashboard.auth import SESSION_S, Auth
from orchestrator.observe.dashboard.data import DashboardData, QueuePositions
from orchestrator.observe.metrics import RemoteMetricsRefused, _is_loopback
from orchestrator.state.store import Store

log = logging.getLogger(__name__)

_JOB_ID = re.compile(r"^[a-z0-9][a-z0-9-]{0,80}$")
_STATIC = {  # name -> content type: only these files are served
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
    "uPlot.iife.min.js": "text/javascript; charset=utf-8",
    "uPlot.min.css": "text/css; charset=utf-8",
}
_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
        "form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
_MAX_BODY = 16 * 1024


class Actions(Protocol):
    """What the dashboard's buttons ask of the controller."""

    def cancel(self, job_id: str) -> None: ...

    def resize(self, job_id: str, accelerator: str, reason: str = ..., tier: str | None = None) -> None: ...

    def profile(self, job_id: str, steps: int, host: int | None = None, memory: bool = False) -> dict: ...


class DashboardServer:
    """A running dashboard; `stop()` shuts it down."""

    def __init__(self, httpd: ThreadingHTTPServer, thread: threading.Thread):
        self._httpd, self._thread = httpd, thread
        host, self.port = httpd.server_address[:2]
        assert isinstance(host, str), "an internet server's host (typeshed allows bytes for any family)"
        self.host = host

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    def login_url(self, token: str) -> str:
        return f"{self.url}?token={urllib.parse.quote(token)}"

    @property
    def serving(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout_s: float = 5.0) -> None:
        if self._thread.is_alive():
            self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout_s)


def serve_dashboard(store: Store, home: Home, *, actions: Actions | None = None, token: str | None = None,
                    host: str = "127.0.0.1", port: int = 0, allow_remote: bool = False,
                    queue_positions: QueuePositions | None = None) -> DashboardServer:
    """Serve the dashboard of `store`'s jobs on a daemon thread; returns the running server.

    `token` defaults to the cluster's (`home.token_file`); `actions` (the controller) carries
    out cancel and resize, and without it those answer 503. `port=0` picks a free port; a
    port that is taken falls back to a free one.
    """
    if not allow_remote and not _is_loopback(host):
        raise RemoteMetricsRefused(host)
    auth = Auth(token if token is not None else home.token_file.read_text().strip())
    data = (DashboardData(store, home) if queue_positions is None
            else DashboardData(store, home, queue_positions=queue_positions))

    class BoundHandler(_Handler):
        pass

    BoundHandler.auth, BoundHandler.data, BoundHandler.actions = auth, data, actions
    try:
        httpd = _Server((host, port), BoundHandler)
    except OSError:
        if port == 0:
            raise
        httpd = _Server((host, 0), BoundHandler)
    thread = threading.Thread(target=httpd.serve_forever, name="dashboard", daemon=True)
    thread.start()
    server = DashboardServer(httpd, thread)
    log.info("serving the dashboard at %s", server.url)
    return server


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


def _page(name: str) -> str:
    return resources.files("orchestrator.observe.dashboard").joinpath("static", name).read_text("utf-8")


class _Handler(BaseHTTPRequestHandler):
    auth: Auth
    data: DashboardData
    actions: Actions | None
    server_version = "orchestrator-dashboard"
    sys_version = ""

    def log_message(self, fmt: str, *args) -> None:  # never the query string: it may hold the token
        log.debug("dashboard %s %s", self.command, urllib.parse.urlsplit(self.path).path)

    # -- dispatch ---------------------------------------------------------------------

    def do_GET(self) -> None:
        self._dispatch(post=False)

    def do_HEAD(self) -> None:
        self._dispatch(post=False)

    def do_POST(self) -> None:
        self._dispatch(post=True)

    def _dispatch(self, *, post: bool) -> None:
        try:
            if not self._host_ok():
                return self._error(HTTPStatus.MISDIRECTED_REQUEST, "wrong Host header")
            url = urllib.parse.urlsplit(self.path)
            query = urllib.parse.parse_qs(url.query)
            if not post and "token" in query:
                return self._login(url, query)
            who = self._who()
            if who is None:
                return self._error(HTTPStatus.UNAUTHORIZED, "log in with the link `orchestrator dashboard` prints",
                                   page=not url.path.startswith("/api/"))
            if post:
                return self._post(url.path, who)
            return self._get(url.path, query, who)
        except JobNotFoundError as e:
            self._error(HTTPStatus.NOT_FOUND, str(e))
        except OrchestratorError as e:
            self._error(HTTPStatus.CONFLICT, str(e))
        except BrokenPipeError:
            pass
        except Exception as e:  # a bug of ours: say so, keep serving
            log.exception("dashboard: %s %s failed", self.command, urllib.parse.urlsplit(self.path).path)
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(e).__name__}: {e}")

    def _host_ok(self) -> bool:
        host = self.headers.get("Host", "")
        port = self.server.server_address[1]  # type: ignore[index]  # typeshed's any server; this one has (host, port)
        return host in {f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}"}

    def _origin(self) -> str:
        return f"http://{self.headers.get('Host')}"

    # -- authentication -----------------------------------------------------------------

    def _login(self, url, query) -> None:
        if not self.auth.token_ok(query["token"][0]):
            return self._error(HTTPStatus.UNAUTHORIZED, "that token is not this cluster's", page=True)
        rest = urllib.parse.urlencode({k: v for k, v in query.items() if k != "token"}, doseq=True)
        target = url.path + (f"?{rest}" if rest else "")
        cookie = (f"{self.auth.cookie_name}={self.auth.new_session()}; HttpOnly; SameSite=Strict; Path=/; "
                  f"Max-Age={SESSION_S}")
        self._send(HTTPStatus.SEE_OTHER, b"", "text/plain", extra={"Location": target, "Set-Cookie": cookie})

    def _who(self) -> str | None:
        """"bearer" (the token in the Authorization header), the session's nonce, or None."""
        header = self.headers.get("Authorization", "")
        if header.startswith("Bearer "):
            return "bearer" if self.auth.token_ok(header[len("Bearer "):].strip()) else None
        jar = SimpleCookie()
        try:
            jar.load(self.headers.get("Cookie", ""))
        except CookieError:  # a header that is no cookie list: no session
            return None
        morsel = jar.get(self.auth.cookie_name)
        return self.auth.session_nonce(morsel.value if morsel else None)

    def _cross_site(self, who: str, form: dict) -> str | None:
        """Why a state-changing request from a cookie session is refused, or None if it may go on."""
        if who == "bearer":
            return None
        origin = self.headers.get("Origin")
        if origin is not None:
            if origin != self._origin():
                return f"cross-site request refused (Origin {origin})"
        else:
            referer = self.headers.get("Referer")
            if referer is None or not (referer == self._origin() or referer.startswith(self._origin() + "/")):
                return "cross-site request refused (no Origin, and no Referer of this dashboard)"
        given = self.headers.get("X-CSRF-Token") or form.get("csrf")
        if not given or not hmac.compare_digest(str(given), self.auth.csrf(who)):
            return "cross-site request refused (missing or wrong CSRF token)"
        return None

    # -- GET --------------------------------------------------------------------------------

    def _get(self, path: str, query: dict, who: str) -> None:
        csrf = self.auth.csrf(who) if who != "bearer" else ""
        if path == "/":
            return self._html(_page("jobs.html").replace("{{csrf}}", csrf))
        if path.startswith("/job/"):
            given = self._job_id(path[len("/job/"):])
            job_id = self.data.store.find_job(given).id  # 404 if unknown; a prefix or a name goes to its job
            if job_id != given:
                return self._send(HTTPStatus.SEE_OTHER, b"", "text/plain", extra={"Location": f"/job/{job_id}"})
            return self._html(_page("job.html").replace("{{csrf}}", csrf).replace("{{job}}", job_id))
        if path.startswith("/static/"):
            name = path[len("/static/"):]
            if name not in _STATIC:
                return self._error(HTTPStatus.NOT_FOUND, "no such file")
            body = resources.files("orchestrator.observe.dashboard").joinpath("static", name).read_bytes()
            return self._send(HTTPStatus.OK, body, _STATIC[name])
        if path == "/api/overview":  # ?page=N: the jobs are shown a page at a time
            page = query.get("page", ["1"])[0]
            return self._json(self.data.overview(page=int(page) if page.isdigit() else 1))
        m = re.fullmatch(r"/api/jobs/([^/]+)(/logs)?", path)
        if m:
            job_id = self._job_id(m.group(1))
            job_id = self.data.store.find_job(job_id).id
            return self._json(self.data.logs(job_id) if m.group(2) else self.data.job(job_id))
        return self._error(HTTPStatus.NOT_FOUND, "no such page")

    # -- POST -------------------------------------------------------------------------------

    def _post(self, path: str, who: str) -> None:
        form = self._body()
        if form is None:
            return self._error(HTTPStatus.BAD_REQUEST, "the body must be JSON or a form, at most 16 KiB")
        refused = self._cross_site(who, form)
        if refused:
            log.warning("dashboard: %s %s: %s", self.command, path, refused)
            return self._error(HTTPStatus.FORBIDDEN, refused)
        m = re.fullmatch(r"/api/jobs/([^/]+)/(cancel|resize|profile)", path)
        if not m:
            return self._error(HTTPStatus.NOT_FOUND, "no such action")
        if self.actions is None:
            return self._error(HTTPStatus.SERVICE_UNAVAILABLE, "this dashboard serves no actions")
        job = self.data.store.find_job(self._job_id(m.group(1)))
        if m.group(2) == "cancel":
            self.actions.cancel(job.id)
            log.info("dashboard: cancel of %s requested", job.id)
            return self._json({"ok": True, "message": f"cancel requested for {job.id}"})
        if m.group(2) == "profile":
            return self._profile(self.actions, job.id, form)
        accelerator = str(form.get("accelerator") or "")
        tier = form.get("tier") or None
        reason = str(form.get("reason") or "requested from the dashboard")[:200]
        self.actions.resize(job.id, accelerator, reason, tier)
        log.info("dashboard: resize of %s to %s %s requested", job.id, accelerator, tier or "")
        return self._json({"ok": True, "message": f"resizing {job.id} to {accelerator}"
                                                  + (f" {tier}" if tier else "")})

    def _profile(self, actions: Actions, job_id: str, form: dict) -> None:
        """Trace a few steps of a running job on its hosts; the capture's event says when and where."""
        steps, host = str(form.get("steps") or "3"), str(form.get("host") or "all")
        if not steps.isdigit() or not (host == "all" or host.isdigit()):
            return self._error(HTTPStatus.BAD_REQUEST, "steps must be a number, host a number or all")
        asked = actions.profile(job_id, int(steps), None if host == "all" else int(host), False)
        log.info("dashboard: capture %s of %s asked for", asked["capture"], job_id)
        return self._json({"ok": True, **asked, "message": f"profiling {asked['steps']} steps of {job_id}: the traces "
                           f"go to {asked['path']} (see the job's events)"})

    def _body(self) -> dict | None:
        try:
            n = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            return None
        if n > _MAX_BODY or n < 0:
            return None
        raw = self.rfile.read(n) if n else b""
        kind = self.headers.get("Content-Type", "").split(";")[0].strip()
        try:
            if kind == "application/json":
                body = json.loads(raw or b"{}")
                return body if isinstance(body, dict) else None
            return {k: v[0] for k, v in urllib.parse.parse_qs(raw.decode()).items()}
        except (ValueError, UnicodeDecodeError):
            return None

    # -- answers ----------------------------------------------------------------------------

    def _job_id(self, raw: str) -> str:
        job_id = urllib.parse.unquote(raw)
        if not _JOB_ID.match(job_id):
            raise JobNotFoundError(job_id)
        return job_id

    def _html(self, text: str) -> None:
        self._send(HTTPStatus.OK, text.encode("utf-8"), "text/html; charset=utf-8")

    def _json(self, obj) -> None:
        self._send(HTTPStatus.OK, json.dumps(_finite(obj), allow_nan=False).encode(), "application/json")

    def _error(self, status: HTTPStatus, message: str, *, page: bool = False) -> None:
        if page:
            body = (f"<!doctype html><meta charset=utf-8><title>{status.value} {status.phrase}</title>"
                    f"<h1>{status.value} {status.phrase}</h1><p>{_escape(message)}</p>").encode()
            self._send(status, body, "text/html; charset=utf-8")
        else:
            self._send(status, json.dumps({"error": message}).encode(), "application/json")

    def _send(self, status: HTTPStatus, body: bytes, content_type: str, *, extra: dict | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("X-Frame-Options", "DENY")
        self.send_header("Referrer-Policy", "same-origin")  # "no-referrer" would make our own POSTs' Origin "null"
        self.send_header("Content-Security-Policy", _CSP)
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)


def _escape(s: str) -> str:
    import html

    return html.escape(s)


def _finite(x):
    """`x` with every NaN or infinity as None (JSON has neither; a diverged loss is not a crash of the page)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x
