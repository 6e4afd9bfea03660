"""One provisioning attempt's slices, waited on together until every one is READY.

On GCP each slice of a multi-slice job is a queued resource that waits for capacity and boots on
its own, so they fill in any order. `AttemptSlices` looks at every request of the attempt each
poll: it says whether the job is QUEUED (one waits in the cloud's queue) or PROVISIONING, lets go
of the rest once a job that takes part of its slices has one (`takes_part`), and ends the wait on a
refusal (CapacityError), a failed or late start (ProvisioningError, transient: that slice is asked
for again by `Requests`, under its next name), a cancel, or a policy that no longer wants them.

It owns the attempt's requests by slice position (`asked`; None: to be asked for again) and when
each one's hosts were first seen starting. The request that waits beside the job is `Requests`'s
alone to write: every change to `asked` is passed to it (`on_asked`).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

from orchestrator.control.waiting import Look, Waiting, look, release
from orchestrator.domain.spec import JobSpec
from orchestrator.errors import ProvisioningError
from orchestrator.providers.base import CapacityError, Slice, SliceProvider
from orchestrator.state.events import StateChange
from orchestrator.state.protocol import JobStore
from orchestrator.state.states import JobState, SliceState

Asked = dict[int, Waiting | None]  # by slice position; None: to be asked for (again)


@dataclasses.dataclass(frozen=True)
class _Seen:
    """One look at each request of an attempt, by slice position."""

    ready: dict[int, Slice]
    pending: list[int]  # still waiting for capacity: nothing started for them yet
    queued: list[int]  # of those, the ones in the cloud's queue for lack of capacity (WAITING, not just REQUESTED)
    booting: list[int]  # capacity came; their hosts are starting
    refused: dict[str, str]  # name -> why (released)
    failed: dict[int, str] = dataclasses.field(default_factory=dict)  # its hosts could not start -> why (released)


class AttemptSlices:
    def __init__(self, spec: JobSpec, asked: Asked, provider: SliceProvider, store: JobStore, job_id: str, *,
                 cancel: threading.Event, transition: Callable[..., None], on_asked: Callable[[Asked, int], None]):
        self.spec, self.asked, self.provider, self.store, self.job_id = spec, asked, provider, store, job_id
        self.cancel, self.transition, self.on_asked = cancel, transition, on_asked
        self.booting: dict[str, float] = {}  # a slice's name -> when its hosts were first seen starting

    def wait(self, *, takes_part: bool, still_wanted: Callable[[JobSpec], bool]) -> list[Slice]:
        """Look at every request of the attempt each poll until all are READY, in slice order (`takes_part`: once
        one is, those still waiting for capacity are let go); the job is QUEUED while one waits for capacity,
        and says so.

        Raises CapacityError when one is refused or expires (released, unbilled), when the policy no longer
        wants them or the job is cancelled, and ProvisioningError when one's hosts could not start or did not
        all start within `start_timeout_s` (that one released, to be asked for again)."""
        spec = self.spec
        while True:
            if self.cancel.is_set() or self.store.job(self.job_id).cancel_requested:
                raise CapacityError("cancelled while waiting for the slices")
            seen = self._look_all()
            if takes_part and seen.ready:
                seen = self._let_go(seen)
            if seen.refused:
                name, why = next(iter(seen.refused.items()))
                raise CapacityError(why, slice_name=name)
            if seen.failed:  # a start that failed is a failure, as a start that timed out is: asked for again
                self._start_failed(seen.failed)
            self._tell(seen)
            if len(seen.ready) == len(self.asked):
                return [seen.ready[i] for i in sorted(seen.ready)]
            if not still_wanted(spec):
                raise CapacityError(f"the policy no longer wants {spec.accelerator} {spec.tier.value}")
            self._time_out(seen.booting)
            self.cancel.wait(spec.provider_facts.poll_interval_s)

    def _asked(self, i: int) -> Waiting:
        w = self.asked[i]
        assert w is not None, "every slice of the attempt is asked for before it is looked at"
        return w

    def _look_all(self) -> _Seen:
        seen = _Seen({}, [], [], [], {}, {})
        for i in self.asked:
            w = self._asked(i)
            kind, s, why = look(self.provider, w)
            if kind is Look.REFUSED:
                seen.refused[w.name] = why
            elif kind is Look.FAILED:
                seen.failed[i] = why
            elif kind is Look.READY:
                assert s is not None, "a READY look has its slice"
                seen.ready[i] = s
            elif s is not None and s.state in (SliceState.REQUESTED, SliceState.WAITING):
                seen.pending.append(i)
                if s.state is SliceState.WAITING:
                    seen.queued.append(i)
            else:
                seen.booting.append(i)
        return seen

    def _let_go(self, seen: _Seen) -> _Seen:
        """A job that takes part of its slices, one READY: those still waiting for capacity are let go, as are
        those refused or failed (released already); it waits only for those whose hosts are starting."""
        for i in seen.pending:
            release(self.provider, self._asked(i).name, "the slices that came are taken; the rest wait for capacity")
        for i in [i for i, w in self.asked.items()
                  if i in seen.pending or i in seen.failed or (w is not None and w.name in seen.refused)]:
            del self.asked[i]
        self.on_asked(self.asked, self.spec.slices)
        return _Seen(seen.ready, [], [], seen.booting, {})

    def _tell(self, seen: _Seen) -> None:
        """The job is QUEUED while one of its requests waits in the cloud's queue for capacity, PROVISIONING once
        all have it."""
        job = self.store.job(self.job_id)
        if seen.queued and job.state is JobState.PROVISIONING:
            w = self._asked(seen.queued[0])
            limit = "while the policy wants it" if w.limit_s is None else f"up to {w.limit_s:.0f} s"
            self.transition(JobState.QUEUED, f"waiting for capacity: {w.accelerator} {w.tier} ({limit})",
                            data=StateChange(outcome="no_capacity", slice=w.name))
        elif not seen.pending and job.state is JobState.QUEUED:
            names = [w.name for w in self.asked.values() if w is not None]
            which, its = (f"slice {names[0]}", "its") if len(names) == 1 else (f"slices {', '.join(names)}", "their")
            self.transition(JobState.PROVISIONING, f"capacity came for {which}; "
                            + (f"starting {its} hosts" if seen.booting else f"{its} hosts joined"))

    def _start_failed(self, failed: dict[int, str]) -> None:
        """ProvisioningError (transient) for slices whose hosts could not start (released already): asked for
        again, as a slice whose hosts did not join in time is. Not a refusal: capacity was there."""
        i, why = next(iter(failed.items()))
        w = self._asked(i)
        for j in failed:
            self.asked[j] = None
        self.on_asked(self.asked, self.spec.slices)
        raise ProvisioningError(f"slice {w.name}: {why}", slice_name=w.name, transient=True)

    def _time_out(self, starting: list[int]) -> None:
        """ProvisioningError (transient) for a slice whose hosts have not all joined `start_timeout_s` after
        capacity came: released, to be asked for again."""
        now, limit = time.monotonic(), self.spec.recovery.start_timeout_s
        for i in starting:
            w = self._asked(i)
            if now - self.booting.setdefault(w.name, now) > limit:
                release(self.provider, w.name, "its hosts did not join in time")
                self.asked[i] = None
                self.on_asked(self.asked, self.spec.slices)
                raise ProvisioningError(f"slice {w.name}: its hosts did not all join the cluster within "
                                        f"{limit:.0f} s", slice_name=w.name, transient=True)
