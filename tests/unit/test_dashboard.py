"""The dashboard's server over a synthetic store, through real HTTP on 127.0.0.1: who gets in, what it says.

The browser test (`tests/integration/test_dashboard.py`) loads it in Chromium while a job runs.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import math
from pathlib import Path

import pytest

from orchestrator.cluster import Home
from orchestrator.control.queue import queue_positions
from orchestrator.observe.dashboard import Auth, serve_dashboard
from orchestrator.state.states import JobState
from orchestrator.state.store import Store
from tests.unit.test_goodput import preempted_job

TOKEN = "a1" * 32
STATIC = Path(__file__).resolve().parents[2] / "orchestrator" / "observe" / "dashboard" / "static"
UPLOT_SHA256 = "19c8d4c6ad88929a79f4ae49d6f7161566dfd0ba3d15cc495e974f787eb78f1f"  # npm uplot 1.6.32, dist/


class Recorder:
    def __init__(self):
        self.calls = []

    def cancel(self, job_id):
        self.calls.append(("cancel", job_id))

    def resize(self, job_id, accelerator, reason="", tier=None):
        self.calls.append(("resize", job_id, accelerator, tier))

    def profile(self, job_id, steps, host=None, memory=False):
        self.calls.append(("profile", job_id, steps, host))
        return {"capture": "c1", "path": "/ckpt/profiles/c1", "hosts": [0, 1] if host is None else [host],
                "steps": steps}


@pytest.fixture
def served(tmp_path):
    home = Home(tmp_path / "home").ensure()
    store = Store(home.db)
    preempted_job(store, "lm-p1a2b3")
    store.create_job("run-0a0b0c", "run", {"name": "run", "accelerator": "v4-16", "tier": "spot",
                                          "workload": {"type": "lm", "steps": 100}})
    store.transition("run-0a0b0c", JobState.PROVISIONING, "x")
    store.transition("run-0a0b0c", JobState.STARTING, "x")
    store.transition("run-0a0b0c", JobState.RUNNING, "x")
    store.record_steps("run-0a0b0c", 1, [(0, 3.0, 10.0, 0.5), (1, float("inf"), 10.0, 0.5)])
    (home.job_dir("run-0a0b0c")).mkdir(parents=True)
    (home.job_dir("run-0a0b0c") / "job.log").write_text("[host-0] hello\n[host-1] world\n")
    actions = Recorder()
    server = serve_dashboard(store, home, actions=actions, token=TOKEN, queue_positions=queue_positions)
    yield server, actions, store
    server.stop()


def request(server, method, path, *, headers=None, body=None, host=None):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    h = {"Host": host or f"127.0.0.1:{server.port}", **(headers or {})}
    conn.request(method, path, body=body, headers=h)
    r = conn.getresponse()
    data = r.read()
    conn.close()
    return r.status, dict(r.getheaders()), data


def login(server) -> str:
    status, headers, _ = request(server, "GET", f"/job/lm-p1a2b3?token={TOKEN}")
    assert status == 303
    assert headers["Location"] == "/job/lm-p1a2b3"  # the token is dropped from the address
    cookie = headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and TOKEN not in cookie
    return cookie.split(";")[0]


def csrf_of(server, cookie) -> str:
    _, _, page = request(server, "GET", "/", headers={"Cookie": cookie})
    text = page.decode()
    start = text.index('name="csrf-token" content="') + len('name="csrf-token" content="')
    return text[start:text.index('"', start)]


ALL_GETS = ["/", "/job/lm-p1a2b3", "/static/app.js", "/static/uPlot.iife.min.js", "/static/style.css",
            "/api/overview", "/api/jobs/lm-p1a2b3", "/api/jobs/run-0a0b0c/logs", "/nope"]


@pytest.mark.parametrize("path", ALL_GETS)
def test_nothing_is_served_without_the_token(served, path):
    server, _, _ = served
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Cookie": "orchestrator_x=forged"},
                    {"Authorization": f"Bearer {TOKEN[:-1]}"}):
        status, _, body = request(server, "GET", path, headers=headers)
        assert status == 401, (path, headers)
        assert b"lm-p1a2b3" not in body and b"hello" not in body
    assert request(server, "GET", "/?token=wrong")[0] == 401


def test_posts_without_the_token_are_refused_and_do_nothing(served):
    server, actions, _ = served
    status, _, _ = request(server, "POST", "/api/jobs/run-0a0b0c/cancel", body=b"{}",
                           headers={"Content-Type": "application/json", "Origin": f"http://127.0.0.1:{server.port}"})
    assert status == 401 and actions.calls == []


def test_login_sets_a_session_that_opens_every_page(served):
    server, _, _ = served
    cookie = login(server)
    for path in ALL_GETS[:-1]:
        status, headers, _ = request(server, "GET", path, headers={"Cookie": cookie})
        assert status == 200, path
        assert headers["Cache-Control"] == "no-store" and headers["X-Frame-Options"] == "DENY"
        assert "script-src 'self'" in headers["Content-Security-Policy"]
    assert request(server, "GET", "/nope", headers={"Cookie": cookie})[0] == 404
    status, headers, _ = request(server, "GET", "/job/run", headers={"Cookie": cookie})  # a name or prefix
    assert status == 303 and headers["Location"] == "/job/run-0a0b0c"
    assert request(server, "GET", "/job/nope-1", headers={"Cookie": cookie})[0] == 404


def test_a_cookie_signed_with_another_token_is_refused(served, tmp_path):
    server, _, _ = served
    other = Auth("b2" * 32)
    forged = f"{Auth(TOKEN).cookie_name}={other.new_session()}"
    assert request(server, "GET", "/api/overview", headers={"Cookie": forged})[0] == 401
    expired = Auth(TOKEN).new_session(now=1.0)
    assert request(server, "GET", "/api/overview", headers={"Cookie": f"{Auth(TOKEN).cookie_name}={expired}"})[0] == 401


def test_a_foreign_host_header_is_refused(served):
    server, _, _ = served
    status, _, _ = request(server, "GET", "/api/overview", headers={"Authorization": f"Bearer {TOKEN}"},
                           host="evil.example:80")
    assert status == 421


def test_actions_need_the_csrf_token_and_this_origin(served):
    server, actions, _ = served
    cookie = login(server)
    csrf = csrf_of(server, cookie)
    own = f"http://127.0.0.1:{server.port}"
    url = "/api/jobs/run-0a0b0c/cancel"
    form = {"Cookie": cookie, "Content-Type": "application/x-www-form-urlencoded"}
    # a cross-site form post: another origin (127.0.0.1 on another port is the same *site*), no CSRF token
    assert request(server, "POST", url, headers={**form, "Origin": "http://127.0.0.1:1"}, body=b"x=1")[0] == 403
    # another origin even with the right token; no Origin and no Referer; a wrong token
    assert request(server, "POST", url, headers={**form, "Origin": "http://127.0.0.1:1"},
                   body=f"csrf={csrf}".encode())[0] == 403
    assert request(server, "POST", url, headers=form, body=f"csrf={csrf}".encode())[0] == 403
    assert request(server, "POST", url, headers={**form, "Origin": own}, body=b"csrf=00")[0] == 403
    assert actions.calls == []
    # the page's own request: this origin and the session's token
    status, _, body = request(server, "POST", url, headers={"Cookie": cookie, "Origin": own, "X-CSRF-Token": csrf,
                                                            "Content-Type": "application/json"}, body=b"{}")
    assert status == 200 and json.loads(body)["ok"]
    status, _, _ = request(server, "POST", "/api/jobs/run/resize", headers={
        "Cookie": cookie, "Referer": own + "/job/run-0a0b0c", "X-CSRF-Token": csrf,
        "Content-Type": "application/json"}, body=json.dumps({"accelerator": "v4-32", "tier": "on-demand"}).encode())
    assert status == 200
    assert actions.calls == [("cancel", "run-0a0b0c"), ("resize", "run-0a0b0c", "v4-32", "on-demand")]


def test_a_script_with_the_bearer_token_needs_no_csrf(served):
    server, actions, _ = served
    status, _, _ = request(server, "POST", "/api/jobs/run-0a0b0c/cancel",
                           headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}, body=b"{}")
    assert status == 200 and actions.calls == [("cancel", "run-0a0b0c")]


def test_profile_from_the_dashboard(served):
    server, actions, _ = served
    bearer = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    status, _, body = request(server, "POST", "/api/jobs/run-0a0b0c/profile", headers=bearer, body=b'{"steps": 3}')
    assert status == 200 and json.loads(body)["message"] == ("profiling 3 steps of run-0a0b0c: the traces go to "
                                                             "/ckpt/profiles/c1 (see the job's events)")
    status, _, _ = request(server, "POST", "/api/jobs/run-0a0b0c/profile", headers=bearer,
                           body=b'{"steps": "2", "host": "1"}')
    assert status == 200
    status, _, body = request(server, "POST", "/api/jobs/run-0a0b0c/profile", headers=bearer, body=b'{"steps": "x"}')
    assert status == 400 and json.loads(body)["error"] == "steps must be a number, host a number or all"
    assert actions.calls == [("profile", "run-0a0b0c", 3, None), ("profile", "run-0a0b0c", 2, 1)]


def test_overview_has_every_column_the_jobs_page_shows(served):
    server, _, _ = served
    status, _, body = request(server, "GET", "/api/overview", headers={"Authorization": f"Bearer {TOKEN}"})
    assert status == 200
    data = json.loads(body)  # strict JSON: the infinite loss is null
    rows = {r["id"]: r for r in data["jobs"]}
    assert [r["id"] for r in data["jobs"]] == ["run-0a0b0c", "lm-p1a2b3"]  # newest first
    done = rows["lm-p1a2b3"]
    assert done["state"] == "SUCCEEDED" and done["step"] == 20 and done["wall_s"] == pytest.approx(110.0)
    assert done["usd"] > 0 and done["usd_expected"] == done["usd"]
    assert 0 < done["goodput"] < 1
    running = rows["run-0a0b0c"]
    assert running["loss"] is None and running["step"] == 2 and running["total_steps"] == 100
    for key in ("queue_position", "tokens_per_s", "moving", "accelerator", "tier"):
        assert key in running


def test_job_page_data_has_curves_markers_events_goodput_slices_and_logs(served):
    server, _, _ = served
    auth = {"Authorization": f"Bearer {TOKEN}"}
    j = json.loads(request(server, "GET", "/api/jobs/lm-p1a2b3", headers=auth)[2])
    assert j["curves"]["step"][0] == 1 and len(j["curves"]["loss"]) == 20
    kinds = {m["kind"] for m in j["markers"]}
    assert {"preemption", "restore", "checkpoint"} <= kinds
    assert all(m["label"] for m in j["markers"])
    assert {s["tier"] for s in j["chips"]["series"]} == {"spot", "on-demand"}
    assert j["cost"]["usd"][-1] == pytest.approx(j["usd"])
    assert math.isclose(sum(g["share"] for g in j["goodput_breakdown"]), 1.0)
    assert any(e["category"] == "preemption" for e in j["events"])
    logs = json.loads(request(server, "GET", "/api/jobs/run/logs", headers=auth)[2])  # a name works as an id
    assert logs["lines"] == ["[host-0] hello", "[host-1] world"]
    assert request(server, "GET", "/api/jobs/nope-123", headers=auth)[0] == 404
    assert request(server, "GET", "/api/jobs/..%2Fetc", headers=auth)[0] == 404


def test_the_vendored_chart_library_is_uplot_as_published():
    assert hashlib.sha256((STATIC / "uPlot.iife.min.js").read_bytes()).hexdigest() == UPLOT_SHA256
    assert "MIT License" in (STATIC / "uPlot.LICENSE").read_text()
