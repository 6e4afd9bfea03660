"""The dashboard in a real browser: headless Chromium loads it from the controller while a job runs.

It logs in with the cluster's token, sees the job's row and its step advance on both the
jobs page and the job's page (the page refreshes itself), cancels the job with the page's
own button request; a request without the token is refused, and so is a cross-site form
post from another page on 127.0.0.1, though the browser holds the session cookie.

Chromium is Debian's `chromium` (`.ci/run` installs it); in CI a missing browser fails
this test, never skips it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import ray

from orchestrator import JobState
from tests.browser import Browser, require_chromium
from tests.conftest import REPO
from tests.integration.test_local_jobs import tiny_spec


def _step_of(text: str) -> int:
    return int(text.split("/")[0])


@pytest.fixture
def evil_site():
    """Another web page on 127.0.0.1 (another port: the same site to a browser, another origin)."""
    pages: dict[str, str] = {}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = pages.get(self.path, "").encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", pages
    httpd.shutdown()
    httpd.server_close()


def test_dashboard_in_a_browser_while_a_job_runs(client, tmp_path, evil_site):
    chromium = require_chromium()
    url = ray.get(client.controller().dashboard_url.remote(), timeout=60)
    assert url and url.startswith("http://127.0.0.1:")
    token = client.home.token_file.read_text().strip()
    # What `orchestrator dashboard` prints: the one link that logs in. The address is also beside the metrics'.
    printed = subprocess.run([sys.executable, "-m", "orchestrator.user.cli", "dashboard"], cwd=REPO, timeout=120,
                             capture_output=True, text=True,
                             env={**os.environ, "ORCHESTRATOR_HOME": str(client.home.root)})
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout.strip() == f"{url}?token={token}"
    assert json.loads((client.home.root / "metrics.json").read_text())["dashboard"] == url
    job = client.submit(tiny_spec("dash", "v4-8", tmp_path, steps=2000, interval=500))

    # Without the token nothing is served: not the page, not the data.
    for path in ("", "api/overview", f"api/jobs/{job.id}", "static/app.js"):
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(url + path, timeout=10)
        assert refused.value.code == 401

    shots = Path(os.environ.get("ORCHESTRATOR_SCREENSHOTS") or tmp_path)
    with Browser(width=1400, height=900, executable=chromium) as b:
        b.goto(f"{url}?token={token}")
        assert b.evaluate("location.href") == url  # logged in; the token is gone from the address
        row = f"document.querySelector('tr[data-job=\"{job.id}\"]')"
        b.wait_for(f"!!{row}", timeout_s=60)
        first = b.wait_for(f"(() => {{ const r = {row}; const t = r && r.querySelector('.step-count').textContent;"
                           f" return t && parseInt(t) > 0 ? t : null }})()", timeout_s=180)
        later = b.wait_for(f"(() => {{ const t = {row}.querySelector('.step-count').textContent;"
                           f" return parseInt(t) > {_step_of(first)} ? t : null }})()", timeout_s=120)
        assert _step_of(later) > _step_of(first)
        assert b.evaluate(f"{row}.querySelector('.state').textContent").startswith("RUNNING")
        # One page of jobs, and every job the store holds (this session's earlier tests' too) counted by state.
        pager = "document.querySelector('#page-of').textContent"
        deadline = time.monotonic() + 30
        while True:
            overview = json.loads(urllib.request.urlopen(urllib.request.Request(
                url + "api/overview", headers={"Authorization": f"Bearer {token}"}), timeout=10).read())
            n, by_state = overview["totals"]["jobs"], overview["totals"]["by_state"]
            expected = (f"page 1 of {overview['pages']} ({n} job{'' if n == 1 else 's'}: "
                        + ", ".join(f"{k} {state}" for state, k in by_state.items()) + ")")
            if b.evaluate(pager) == expected or time.monotonic() > deadline:
                break
            time.sleep(0.5)  # the page polls every 2 s; a job of an earlier test may have ended meanwhile
        assert b.evaluate(pager) == expected
        assert by_state.get("RUNNING", 0) >= 1 and n == sum(by_state.values()), overview["totals"]
        assert b.evaluate("document.querySelector('#next').disabled") == (overview["pages"] == 1)
        b.screenshot(shots / "dashboard-jobs.png", full_page=False)

        b.goto(f"{url}job/{job.id}")
        b.wait_for("!!document.querySelector('#chart-loss canvas')", timeout_s=30)
        tile = "document.querySelector('#tiles .tile .value').textContent"
        seen = _step_of(b.wait_for(tile, timeout_s=30))
        b.wait_for(f"parseInt({tile}) > {seen}", timeout_s=120)
        assert b.evaluate("document.querySelectorAll('#events tbody tr').length") > 3
        b.screenshot(shots / "dashboard-job.png")

        # A cross-site form post: the browser sends the session cookie along (same site), but it
        # carries neither this dashboard's origin nor the session's CSRF token.
        origin, pages = evil_site
        pages["/"] = (f'<form method="post" action="{url}api/jobs/{job.id}/cancel">'
                      '<input type="hidden" name="x" value="1"></form>'
                      "<script>document.forms[0].submit()</script>")
        b.goto(f"{origin}/")
        b.wait_for("location.href.includes('/cancel')", timeout_s=30)
        # The refusal on the page is the server's answer to the post: the request is handled, nothing of it is to come.
        assert "cross-site request refused" in b.wait_for("document.body && document.body.innerText", timeout_s=30)
        assert not job.record().cancel_requested and job.status().state is JobState.RUNNING

        # The page's own cancel (what its button sends) goes through.
        b.goto(f"{url}job/{job.id}")
        b.wait_for("!!document.querySelector('#chart-loss canvas')", timeout_s=30)
        answer = b.evaluate(f"post('/api/jobs/{job.id}/cancel')")
        assert answer == f"cancel requested for {job.id}"
    assert job.wait(timeout_s=120).state is JobState.CANCELLED
