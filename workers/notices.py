"""Preemption notices a host can receive, all funnelled into one `threading.Event`.

- The GCE metadata server: ``instance/preempted`` turns TRUE, or
  ``instance/maintenance-event`` leaves NONE; both long-polled with
  ``?wait_for_change=true``. The URL is configurable so tests run a local fake.
- SIGTERM to the worker process (what a VM's shutdown, or Kubernetes, sends first). On a
  multi-host slice `jax.distributed.initialize` starts XLA's preemption notifier, which
  takes SIGTERM over in C and so silenced ours; `chain_sigterm` (run after it) gives the
  signal back to ours, which calls XLA's in turn: both hear every SIGTERM.
- The controller (`HostWorker.request_stop`), when the provider reports a reclaim.
"""

from __future__ import annotations

import ctypes
import logging
import os
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
        base_url = base_url.rstrip("/")
        if base_url == GCE_METADATA_URL and os.environ.get("GCE_METADATA_HOST"):
            # Where this VM's metadata server is, as Google's own libraries read it.
            base_url = f"http://{os.environ['GCE_METADATA_HOST']}/computeMetadata/v1"
        self.base_url, self.notice, self.on_notice, self.timeout_s = base_url, notice, on_notice, timeout_s
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
    global _ours

    def handler(signum, frame) -> None:
        on_notice("SIGTERM")
        _call_chained(signum)

    try:
        signal.signal(signal.SIGTERM, handler)
    except ValueError:
        return False
    _ours = _action()
    return True


# -- SIGTERM beside XLA's preemption notifier -------------------------------------------------
#
# Python's handlers run on the main thread, called from Python's own C-level handler. A C
# library that calls sigaction() itself replaces that one, and Python still believes its
# handler is set (signal.getsignal says so). XLA's preemption notifier does that when
# `jax.distributed.initialize` starts it: its handler marks the notice for JAX's preemption
# sync manager (`multihost_utils.reached_preemption_sync_point`, orbax's save on preemption).


class _Sigaction(ctypes.Structure):  # struct sigaction, Linux (glibc and musl): handler, mask, flags, restorer
    _fields_ = [("handler", ctypes.c_void_p), ("mask", ctypes.c_ulong * 16), ("flags", ctypes.c_int),
                ("restorer", ctypes.c_void_p)]


_SA_SIGINFO = 4
_ours: _Sigaction | None = None  # Python's C-level SIGTERM handler, as `install_sigterm` left it
_chained = None  # (the C handler that had taken SIGTERM over, called after ours; whether it takes siginfo)


def _libc():
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def _action() -> _Sigaction | None:
    libc, act = _libc(), _Sigaction()
    if libc is None or libc.sigaction(signal.SIGTERM, None, ctypes.byref(act)) != 0:
        return None
    return act


def chain_sigterm() -> str | None:
    """Give SIGTERM back to the handler `install_sigterm` set, if C code took it over since,
    and have ours call the one that took it (XLA's preemption notifier): both hear every
    SIGTERM. Returns what it did, for the log; None when nothing had taken the signal."""
    global _chained
    now = _action()
    if _ours is None or now is None or now.handler == _ours.handler:
        return None
    if now.handler not in (None, 0, 1):  # SIG_DFL, SIG_IGN: nothing to call
        siginfo = bool(now.flags & _SA_SIGINFO)
        kind = (ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p) if siginfo
                else ctypes.CFUNCTYPE(None, ctypes.c_int))
        _chained = (kind(now.handler), siginfo)
    if _libc().sigaction(signal.SIGTERM, ctypes.byref(_ours), None) != 0:
        return None
    return f"SIGTERM: the project's notice first, then the handler at {now.handler:#x} (JAX's preemption notifier)"


def _call_chained(signum: int) -> None:
    if _chained is None:
        return
    fn, siginfo = _chained
    try:
        fn(signum, None, None) if siginfo else fn(signum)
    except Exception as e:  # never let the chained handler cost us the notice
        log.warning("the chained SIGTERM handler failed: %s", e, exc_info=True)
