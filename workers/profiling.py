"""Profiling a running job from outside it: every chosen host traces the same steps.

How a capture goes:

- The controller hands every host of the running generation, chosen or not, a
  `CaptureRequest` (`HostWorker.request_profile`), numbered 1, 2, ... by the job's driver.
- Each host's `Profiler` votes the newest number it holds on the agreement that already
  stops all hosts after the same step (`Profiler.vote`): the stop flag and that number
  travel in the step's one all-gather, so a capture adds no collective. The smallest vote
  is the newest request that every host holds; the step after which it first goes past
  the last capture agreed is the same on every host.
- At that step boundary (`Profiler.boundary`, which the training API's loop calls between
  two steps) the chosen hosts wait for the previous step's device work, start
  `jax.profiler`, trace N steps (each marked with a `StepTraceAnnotation`), wait for the
  last traced step's device work, and stop collecting. A trace thus holds exactly the N
  steps' executions. If training stops or ends first, the capture ends there, with fewer steps.
- Only the collecting stops on the training loop (`stop_collecting`): writing the trace's
  files (the XSpace, the trace viewer's JSON, Perfetto's copy of it), which grows with the
  steps traced and took most of the stop (on a loaded machine, seconds of the step after a
  capture), runs on the publishing thread.
- `jax.profiler` writes to a local folder; `publish` copies it to
  ``<destination>/host-<rank>/`` (beside the job's checkpoints, on disk or in a bucket:
  `workers.storage`) on a thread, off the training loop, with ``capture.json`` (what was
  traced, each local device's memory) last. The host then reports `ProfileDone`; the
  loop's `close` waits for copies still running.

Nothing of this runs while no capture is asked for: the vote is one more int32 in the
step's all-gather (no collective at all on one host) and the loop reads one attribute a
step. A capture changes no value a step computes, only when the host waits for the
device at its two ends, so the losses are the same to the bit.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workers import storage
from workers.protocol import ProfileDone, Report

log = logging.getLogger(__name__)

CAPTURE_FILE = "capture.json"  # in each host's folder: what was traced, memory per device
MEMORY_PROFILE_FILE = "memory.prof"  # pprof, from jax.profiler.device_memory_profile (--memory)
PUBLISH_WAIT_S = 120.0  # how long the loop's close waits for a copy still running


@dataclass(frozen=True)
class CaptureRequest:
    """What the controller asks of every host: trace `steps` steps on the ranks `hosts`."""

    number: int  # increasing within a job; a host's vote is the newest it holds
    capture_id: str
    steps: int
    hosts: tuple[int, ...]  # the ranks that trace (the others only vote)
    destination: str  # <checkpoint dir>/profiles/<capture id>: a path or a URL
    memory_profile: bool = False

    def host_dir(self, rank: int) -> str:
        return storage.join(self.destination, f"host-{rank}")


def publish(local_dir: str, destination: str) -> None:
    """Copy the folder `local_dir` with everything below it to `destination`, a path or a URL (gs://...),
    ``capture.json`` last: a reader that finds it finds the trace whole."""
    storage.upload_folder(local_dir, destination, last=(CAPTURE_FILE,))


def _nothing() -> None:
    """No files left to write."""


def stop_collecting() -> Callable[[], None]:
    """Stop the running `jax.profiler` trace (nothing after this is traced) and return what writes its files.

    `jax.profiler.stop_trace` does both at once: it stops the session, exports its XSpace to
    ``plugins/profile/<run>/`` (``.xplane.pb``, ``.trace.json.gz``) and rewrites the trace JSON
    for Perfetto, all on the caller's thread. The files are the same when the export runs
    later, on another thread. That split goes through JAX's own profiler state (its public API
    has no split); where a JAX version lays it out otherwise, this stops and writes at once.
    """
    import jax
    from jax._src import profiler as jax_profiler

    state = getattr(jax_profiler, "_profile_state", None)
    session = getattr(state, "profile_session", None)
    if state is None or not all(hasattr(x, n) for x, n in ((session, "stop"), (session, "export"),
                                                          (jax_profiler, "_write_perfetto_trace_file"))):
        jax.profiler.stop_trace()  # raises as JAX does when no trace runs
        return _nothing
    with state.lock:
        session, log_dir, perfetto = state.profile_session, str(state.log_dir), state.create_perfetto_trace
        if session is None:
            raise RuntimeError("No profile started")
        xspace = session.stop()  # bytes: the trace as collected
        state.reset()
        jax_profiler.clear_metadata()

    def write() -> None:
        session.export(xspace, log_dir)
        if perfetto:
            jax_profiler._write_perfetto_trace_file(log_dir)

    return write


def memory_stats() -> tuple[dict, ...]:
    """Each local device's memory now: ``bytes_in_use``, ``peak_bytes_in_use``, ``bytes_limit``
    where the backend keeps them (TPU, GPU); only the device's name on CPU, which keeps none."""
    import jax

    out = []
    for d in jax.local_devices():
        try:
            stats = d.memory_stats() or {}
        except jax.errors.JaxRuntimeError:  # the backend's allocator could not say (one that keeps none says None)
            stats = {}
        entry: dict[str, Any] = {"device": f"{d.platform}:{d.id}"}
        entry.update({k: int(stats[k]) for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit") if k in stats})
        out.append(entry)
    return tuple(out)


@dataclass
class _Active:
    req: CaptureRequest
    first: int  # the first step traced
    end: int  # the step at which it stops (exclusive)
    local: str  # the local folder jax.profiler writes to
    started_at: float


class Profiler:
    """One host's side of profile captures (see the module doc)."""

    def __init__(self, rank: int, num_hosts: int, send: Callable[[Report], None]):
        self.rank, self.num_hosts, self._send = rank, num_hosts, send
        self._lock = threading.Lock()
        self._requests: dict[int, CaptureRequest] = {}
        self._held = 0  # the newest request number this host holds: its vote
        self._agreed = 0  # the newest number every host held at one step
        self._next: CaptureRequest | None = None  # agreed; this host starts it at the next step boundary
        self._active: _Active | None = None
        self._publishing: list[threading.Thread] = []
        self.busy = False  # something to do at a step boundary: the loop's one check a step

    # -- from the controller (any thread) -----------------------------------------------

    def request(self, req: CaptureRequest) -> None:
        with self._lock:
            self._requests[req.number] = req
            self._held = max(self._held, req.number)

    # -- on the training thread ------------------------------------------------------------

    def vote(self, stop: bool) -> bool:
        """Whether any host must stop after this step (all hosts call it once a step, together).

        The same all-gather carries each host's newest capture request: the smallest of them
        is one every host holds, so every host sees a new capture agreed after the same step.
        """
        held = self._held
        if self.num_hosts == 1:
            any_stop, agreed = bool(stop), held
        else:
            import numpy as np
            from jax.experimental import multihost_utils

            votes = np.asarray(multihost_utils.process_allgather(np.array([int(bool(stop)), held], np.int32)))
            votes = votes.reshape(self.num_hosts, 2)
            any_stop, agreed = bool(votes[:, 0].any()), int(votes[:, 1].min())
        if agreed > self._agreed:
            self._agreed = agreed
            with self._lock:
                req = self._requests.get(agreed)
            if req is not None and self.rank in req.hosts:
                if self._next is not None:  # agreed in the same step as a newer one: the newer wins
                    self._fail(self._next, f"capture {req.capture_id} was asked for before it began")
                self._next = req
                self.busy = True
        return any_stop

    def boundary(self, loop) -> bool:
        """Between two steps (`loop.step` is the next one): end a capture that traced its steps,
        begin an agreed one. Returns whether the next step is traced. Never raises."""
        try:
            if self._active is not None and loop.step >= self._active.end:
                self._finish(loop)
        except Exception as e:  # a profiler problem must never stop training
            log.exception("profiling failed")
            if self._active is not None:
                self._abandon(f"{type(e).__name__}: {e}")
        if self._next is not None and self._active is None:
            req, self._next = self._next, None
            try:
                self._begin(req, loop)
            except Exception as e:
                log.exception("profiling failed")
                if self._active is not None:
                    self._abandon(f"{type(e).__name__}: {e}")
                else:
                    self._fail(req, f"the capture could not begin: {type(e).__name__}: {e}")
        self.busy = self._active is not None or self._next is not None
        return self._active is not None

    def close(self, loop) -> None:
        """The loop ended: finish a capture under way with the steps it traced, say why an agreed
        one never began, and wait for copies still running."""
        try:
            if self._active is not None:
                self._finish(loop)
        except Exception as e:
            log.exception("profiling failed")
            if self._active is not None:
                self._abandon(f"{type(e).__name__}: {e}")
        if self._next is not None:
            req, self._next = self._next, None
            self._fail(req, f"training stopped after step {loop.step} before the capture could begin")
        self.busy = False
        for t in self._publishing:
            t.join(timeout=PUBLISH_WAIT_S)
        self._publishing = [t for t in self._publishing if t.is_alive()]

    # -- the capture ------------------------------------------------------------------------

    def _begin(self, req: CaptureRequest, loop) -> None:
        import jax

        if loop.stopped or loop.step >= loop.total:
            self._fail(req, f"training stopped after step {loop.step} before the capture could begin")
            return
        jax.block_until_ready(loop.state)  # the previous step's device work stays out of the trace
        local = tempfile.mkdtemp(prefix=f"profile-{req.capture_id}-host{self.rank}-")
        options = jax.profiler.ProfileOptions()
        options.python_tracer_level = 0  # tracing every Python call would slow a Python-heavy step
        try:
            jax.profiler.start_trace(local, create_perfetto_trace=True, profiler_options=options)
        except Exception as e:  # noqa: BLE001 -- e.g. the program runs a trace of its own: told to who asked
            shutil.rmtree(local, ignore_errors=True)
            self._fail(req, f"could not start jax.profiler: {type(e).__name__}: {e}")
            return
        self._active = _Active(req, loop.step, min(loop.step + req.steps, loop.total), local, time.time())
        log.info("profiling steps %d-%d (capture %s)", loop.step, self._active.end - 1, req.capture_id)

    def _finish(self, loop) -> None:
        import jax

        a = self._active
        assert a is not None, "finished only while a capture is under way (the callers check)"
        error: str | None = None
        memory: tuple[dict, ...] = ()
        write: Callable[[], None] = _nothing
        try:
            jax.block_until_ready(loop.state)  # the last traced step's device work is in the trace
            memory = memory_stats()
            if a.req.memory_profile:
                Path(a.local, MEMORY_PROFILE_FILE).write_bytes(jax.profiler.device_memory_profile())
        except Exception as e:  # noqa: BLE001 -- any failure here is the capture's, told to who asked for it
            error = f"reading device memory failed: {type(e).__name__}: {e}"
        finally:
            self._active = None
            try:
                write = stop_collecting()  # the files are written by the publishing thread, off the loop
            except Exception as e:  # noqa: BLE001 -- any failure here is the capture's, told to who asked for it
                error = f"stopping jax.profiler failed: {type(e).__name__}: {e}"
        steps = loop.step - a.first
        log.info("profiled %d steps from step %d (capture %s)", steps, a.first, a.req.capture_id)
        t = threading.Thread(target=self._publish, args=(a, steps, memory, error, write), daemon=True,
                             name=f"profile-{a.req.capture_id}")
        t.start()
        self._publishing.append(t)

    def _abandon(self, why: str) -> None:
        import jax

        a, self._active = self._active, None
        assert a is not None, "abandoned only while a capture is under way (the callers check)"
        try:
            jax.profiler.stop_trace()
        except RuntimeError:  # no trace running (JAX's own error is a RuntimeError too): the capture failed anyway
            log.debug("capture %s: stopping jax.profiler failed", a.req.capture_id, exc_info=True)
        shutil.rmtree(a.local, ignore_errors=True)
        self._fail(a.req, f"the capture failed: {why}")

    def _publish(self, a: _Active, steps: int, memory: tuple[dict, ...], error: str | None,
                 write: Callable[[], None]) -> None:
        dest = a.req.host_dir(self.rank)
        doing = "writing the trace"
        try:
            if error is None:
                write()  # the trace's files, from what the loop collected
                doing = f"copying the trace to {dest}"
                meta = {"capture_id": a.req.capture_id, "host": self.rank, "first_step": a.first, "steps": steps,
                        "steps_asked": a.req.steps, "started_at": a.started_at, "memory": list(memory),
                        "memory_profile": MEMORY_PROFILE_FILE if a.req.memory_profile else None}
                Path(a.local, CAPTURE_FILE).write_text(json.dumps(meta, indent=1))
                publish(a.local, dest)
        except Exception as e:  # noqa: BLE001 -- any failure here is the capture's, told to who asked for it
            error = f"{doing} failed: {type(e).__name__}: {e}"
        finally:
            shutil.rmtree(a.local, ignore_errors=True)
        self._send(ProfileDone(a.req.capture_id, dest if error is None else None, a.first, steps, memory, error))

    def _fail(self, req: CaptureRequest, why: str) -> None:
        log.warning("capture %s: %s", req.capture_id, why)
        self._send(ProfileDone(req.capture_id, None, None, 0, (), why))

