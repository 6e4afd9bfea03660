"""A job's profile captures on the controller's side (`orchestrator profile`; the hosts' side: `workers.profiling`).

The job's driver hands every host of the running generation the same numbered
`CaptureRequest` (all hosts vote on when it begins, the chosen ones trace), then waits for
a `ProfileDone` from each chosen host, matched by the capture's id whatever the
generation. The capture ends as one `Profiled` event: where the traces are, the steps
traced, each host's device memory; or why there are none (training stopped first, the
attempt ended, no host began it in time). One capture at a time per job.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from orchestrator.errors import JobStateError, ProfileError
from orchestrator.state.events import Profiled
from workers import storage
from workers.profiling import CaptureRequest
from workers.protocol import ProfileDone

if TYPE_CHECKING:
    from orchestrator.control.attempt import Attempt
    from orchestrator.state.protocol import JobStore

log = logging.getLogger(__name__)

MAX_STEPS = 100  # a trace grows with every step; beyond this a viewer struggles to open it
ENDED_WAIT_S = 5.0  # after an attempt ends, how long a capture waits for hosts' last reports


@dataclass
class _Pending:
    request: CaptureRequest
    generation: int
    asked_at: float
    done: dict[int, ProfileDone] = field(default_factory=dict)
    finished: threading.Event = field(default_factory=threading.Event)


class Captures:
    """The profile captures of one job's driver."""

    def __init__(self, store: JobStore, job_id: str):
        self.store, self.job_id = store, job_id
        self._lock = threading.Lock()
        self._pending: _Pending | None = None
        self._number = 0

    def ask(self, att: "Attempt", checkpoint_dir: str, steps: int, host: int | None, memory: bool) -> dict:
        """Ask the running generation's hosts to trace `steps` steps on every host, or on `host` only.

        Returns at once with the capture's id and folder; its `Profiled` event comes once the hosts are done.
        """
        if not att.started or att.group is None:
            raise JobStateError(self.job_id, "starting", "profiled", ("RUNNING",))
        if att.notice is not None:
            raise ProfileError(f"job {self.job_id} is stopping ({att.notice}); profile it once it runs again")
        if not 1 <= steps <= MAX_STEPS:
            raise ProfileError(f"--steps must be 1 to {MAX_STEPS}, got {steps}")
        n = att.group.hosts
        if host is not None and not 0 <= host < n:
            raise ProfileError(f"--host {host}: job {self.job_id} runs on {n} host{'s' if n > 1 else ''} "
                               f"(0{f' to {n - 1}' if n > 1 else ''}), or use --host all")
        with self._lock:
            if self._pending is not None:
                raise ProfileError(f"capture {self._pending.request.capture_id} of job {self.job_id} is under way; "
                                   "ask again once it ends")
            # Numbers grow across controller restarts too: adopted hosts remember the last one they agreed on.
            self._number = max(self._number + 1, int(time.time()) - 1_700_000_000)
            capture_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
            hosts = tuple(range(n)) if host is None else (host,)
            req = CaptureRequest(self._number, capture_id, steps, hosts,
                                 storage.join(checkpoint_dir, "profiles", capture_id), memory)
            self._pending = _Pending(req, att.generation, time.time())
        att.group.request_profile(req)  # every host votes; only the chosen ones trace
        log.info("job %s: capture %s of %d steps on host(s) %s", self.job_id, capture_id, steps, list(hosts))
        return {"capture": capture_id, "path": req.destination, "hosts": list(hosts), "steps": steps}

    def done(self, rank: int, report: ProfileDone) -> None:
        """A host's part of a capture is done; the last chosen host's ends the capture."""
        with self._lock:
            p = self._pending
            if p is None or report.capture_id != p.request.capture_id or rank not in p.request.hosts:
                return
            p.done[rank] = report
            if set(p.done) != set(p.request.hosts):
                return
            self._pending = None
        self._record(p, None)

    def attempt_ended(self, generation: int, reason: str) -> None:
        """The attempt of `generation` ended: a capture asked of it ends too, with what its hosts reported."""
        with self._lock:
            p = self._pending
        if p is None or p.generation != generation:
            return
        if p.finished.wait(ENDED_WAIT_S):  # the last report may still be on its way
            return
        self._end(p.request.capture_id, f"the job's attempt ended before the capture did ({reason})")

    def abandon(self, capture_id: str, why: str) -> None:
        """End capture `capture_id` now (a client gave up waiting for it)."""
        self._end(capture_id, why)

    def _end(self, capture_id: str, why: str) -> None:
        with self._lock:
            p = self._pending
            if p is None or p.request.capture_id != capture_id:
                return
            self._pending = None
        self._record(p, why)

    def _record(self, p: _Pending, error: str | None) -> None:
        req = p.request
        ok = {h: r for h, r in sorted(p.done.items()) if r.error is None}
        errors = [error] if error else []
        errors += [f"host {h}: {r.error}" for h, r in sorted(p.done.items()) if r.error]
        first = min((r.first_step for r in ok.values() if r.first_step is not None), default=None)
        steps = min((r.steps for r in ok.values()), default=0)
        event = Profiled(capture=req.capture_id, path=req.destination if ok else None, hosts=list(req.hosts),
                         first_step=first, steps=steps, steps_asked=req.steps,
                         memory={str(h): memory_total(r.memory) for h, r in ok.items()},
                         error="; ".join(errors) or None)
        if ok:
            assert first is not None, "a host that traced without an error names its first step"
            where = ", ".join(map(str, ok))
            reason = (f"profiled steps {first}-{first + steps - 1} on host{'s' if len(ok) > 1 else ''} {where}: "
                      f"{req.destination}" + (f" ({event.error})" if event.error else ""))
        else:
            reason = f"profile capture {req.capture_id} failed: {event.error or 'no host reported it'}"
        self.store.add_event(self.job_id, event, reason)
        p.finished.set()


def memory_total(devices: tuple[dict, ...] | list[dict]) -> dict:
    """One host's device memory: the sums over its devices of what they report; `devices` always."""
    out: dict[str, int] = {"devices": len(devices)}
    for key in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit"):
        values = [d[key] for d in devices if key in d]
        if values:
            out[key] = sum(values)
    return out
