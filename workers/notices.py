"""Preemption notices a host can receive, all funnelled into one `threading.Event`.

- The GCE metadata server: ``instance/preempted`` turns TRUE, or
  ``instance/maintenance-event`` leaves NONE; both long-polled with
  ``?wait_for_change=true``. The URL is configurable so tests run a local fake.
- SIGTERM to the worker process (what a VM's shutdown, or Kubernetes, sends first).
- The controller (`HostWorker.request_stop`), when the provider reports a reclaim.
"""

from __future__ import annotations

import logging
import signal
import threading
import urllib.error
import urllib.request

log = logging.getLogger(__name__)

GCE_METADATA_URL = "http://metadata.google.internal/computeMetadata/v1"


class MetadataWatcher:
    """Long-polls the metadata server on a daemon thread; sets `notice` when preemption is announced."""

    KEYS = {"instance/preempted": lambda v: v.strip().upper() == "TRUE",
            "instance/maintenance-event": lambda v: v.strip().upper() not in ("", "NONE")}

    def __init__(self, base_url: str, notice: threading.Event, on_notice, *, timeout_s: int = 30):
        self.base_url, self.notice, self.on_notice, self.timeout_s = base_url.rstrip("/"), notice, on_notice, timeout_s
        self._closed = threading.Event()
        self._threads = [threading.Thread(target=self._watch, args=(key,), daemon=True, name=f"metadata-{key}")
                         for key in self.KEYS]
        for t in self._threads:
            t.start()

    def _get(self, key: str, wait: bool) -> str:
        url = f"{self.base_url}/{key}"
        if wait:
            url += f"?wait_for_change=true&timeout_sec={self.timeout_s}"
        req = urllib.request.Request(url, headers={"Metadata-Flavor": "Google"})
        with urllib.request.urlopen(req, timeout=self.timeout_s + 5) as resp:
            return resp.read().decode()

    def _watch(self, key: str) -> None:
        announced = self.KEYS[key]
        wait = False
        while not self._closed.is_set() and not self.notice.is_set():
            try:
                value = self._get(key, wait)
            except (urllib.error.URLError, OSError, TimeoutError) as e:
                log.debug("metadata %s: %s", key, e)
                self._closed.wait(2.0)
                continue
            if announced(value):
                self.on_notice(f"metadata server: {key} = {value.strip()}")
                return
            wait = True

    def close(self) -> None:
        self._closed.set()


def install_sigterm(on_notice) -> bool:
    """Turn SIGTERM into a notice; False where signals cannot be set (not the main thread)."""
    try:
        signal.signal(signal.SIGTERM, lambda signum, frame: on_notice("SIGTERM"))
        return True
    except ValueError:
        return False
