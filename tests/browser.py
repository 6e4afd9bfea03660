"""A real browser for tests: headless Chromium (Debian's `chromium`) driven over the DevTools protocol.

`Browser()` starts it with an empty profile of its own and connects to its first page;
`goto`, `evaluate`, `wait_for` and `screenshot` are all the tests need. In CI (`CI` set) a
missing browser fails the test that asks for one (`require_chromium`); elsewhere it skips.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-default-apps", "--disable-extensions", "--mute-audio", "--hide-scrollbars",
         "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0"]


def chromium_path() -> str | None:
    return next((p for p in map(shutil.which, CHROMIUM_NAMES) if p), None)


def require_chromium() -> str:
    """The browser's path; without one, the test fails in CI (`.ci/run` installs it) and skips elsewhere."""
    path = chromium_path()
    if path is None:
        message = "headless Chromium is not installed (apt-get install chromium; .ci/run installs it)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    try:
        import websocket  # noqa: F401
    except ImportError:
        pytest.fail("the websocket-client package is missing: pip install -e '.[test]'")
    return path


class Browser:
    """One headless Chromium with one page; use as a context manager."""

    def __init__(self, *, width: int = 1400, height: int = 1000, executable: str | None = None):
        import websocket

        self._profile = tempfile.mkdtemp(prefix="chromium-profile-")
        self._proc = subprocess.Popen([executable or require_chromium(), *FLAGS, f"--user-data-dir={self._profile}",
                                       f"--window-size={width},{height}", "about:blank"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        port_file = Path(self._profile) / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            if time.monotonic() > deadline or self._proc.poll() is not None:
                self.close()
                raise RuntimeError("chromium did not open its DevTools port")
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        pages = []
        while not pages:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
                pages = [t for t in json.load(r) if t["type"] == "page"]
            if not pages:
                if time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError("chromium opened no page")
                time.sleep(0.1)
        self._ws = websocket.create_connection(pages[0]["webSocketDebuggerUrl"], timeout=60, suppress_origin=True)
        self._id = 0
        self.console: list[str] = []
        self.call("Page.enable")
        self.call("Runtime.enable")
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)

    def __enter__(self) -> "Browser":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        try:
            if getattr(self, "_ws", None) is not None:
                self._ws.close()
        finally:
            if self._proc.poll() is None:
                self._proc.terminate()
                try:
                    self._proc.wait(10)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait(10)
            shutil.rmtree(self._profile, ignore_errors=True)

    def call(self, method: str, **params):
        self._id += 1
        my_id = self._id
        self._ws.send(json.dumps({"id": my_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self._ws.recv())
            if msg.get("id") == my_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            if msg.get("method") == "Runtime.consoleAPICalled":
                self.console.append(" ".join(str(a.get("value", a.get("description", ""))) for a in
                                             msg["params"].get("args", [])))
            elif msg.get("method") == "Runtime.exceptionThrown":
                self.console.append("exception: " + json.dumps(msg["params"]["exceptionDetails"])[:2000])

    def goto(self, url: str, *, timeout_s: float = 30) -> None:
        self.call("Page.navigate", url=url)
        self.wait_for("document.readyState === 'complete' && location.href !== 'about:blank'", timeout_s=timeout_s)

    def evaluate(self, expression: str):
        r = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expression}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait_for(self, expression: str, *, timeout_s: float = 30, poll_s: float = 0.2):
        """The first truthy value of `expression`; TimeoutError after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                value = self.evaluate(expression)
            except RuntimeError as e:  # the page navigated while it was asked (a form posting, a refresh): not yet
                if "navigated or closed" not in str(e) and "Cannot find context" not in str(e):
                    raise
                value = None
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout_s} s for {expression!r}; console: {self.console[-5:]}")
            time.sleep(poll_s)

    def screenshot(self, path: Path, *, full_page: bool = True) -> Path:
        params = {"format": "png"}
        if full_page:
            metrics = self.call("Page.getLayoutMetrics")
            size = metrics.get("cssContentSize") or metrics["contentSize"]
            params |= {"captureBeyondViewport": True,
                       "clip": {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}}
        data = self.call("Page.captureScreenshot", **params)["data"]
        path.write_bytes(base64.b64decode(data))
        return path
