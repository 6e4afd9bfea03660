"""A job's slice requests: asked for (all of a multi-slice job's at once, all or none), named, waited
on, followed beside the running slices, given back. `Requests` is the one writer of the request
waiting beside the slices (`waiting`) and of the count that names requests.

Names say where a request comes from: `JOB-N` (and `JOB-Ns1`, ... for a multi-slice job's other
slices; `JOB-Nq2` after two refusals) for generation N's provisioning, `JOB-Nm3` for the third
request made beside running slices (a move, a grow), `JOB-Ng4` for a slice asked to regrow.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace

import tenacity

from orchestrator.control.waiting import Look, Waiting, look, release, request
from orchestrator.domain.shape import Shape
from orchestrator.domain.spec import JobSpec
from orchestrator.errors import ProvisioningError
from orchestrator.providers.base import CapacityError, Slice, SliceProvider
from orchestrator.state.events import Autoscaled, StateChange
from orchestrator.state.states import JobState, SliceState
from orchestrator.state.store import Store

log = logging.getLogger(__name__)

Transition = Callable[..., None]  # JobDriver.transition(target, reason, *, data=None)


class Followed(str, enum.Enum):
    WAITING = "waiting"  # for capacity, or for its hosts
    READY = "ready"  # all of it, or for a grow the part that came
    REFUSED = "refused"  # released: ask the policy again


class Requests:
    def __init__(self, store: Store, job_id: str, cancel: threading.Event, transition: Transition):
        self.store, self.job_id, self.cancel, self.transition = store, job_id, cancel, transition
        self.provider: SliceProvider | None = None  # chosen before the first request
        self.waiting: Waiting | None = None  # the request not READY yet, or READY for a switch not made
        self._made = 0  # requests made beside running slices, for unique names

    def use(self, provider: SliceProvider) -> None:
        """Every request from now on goes to `provider` (the spec's)."""
        self.provider = provider

    @property
    def chosen_provider(self) -> SliceProvider:
        if self.provider is None:
            raise RuntimeError("no provider chosen yet: this job has requested no slice")
        return self.provider

    def drop(self, why: str) -> None:
        """Release the request, every slice of it (idempotent; never filled: never billed)."""
        if self.waiting is not None:
            for name in self.waiting.names:
                release(self.chosen_provider, name, why)
        self.waiting = None

    def take(self) -> Waiting:
        """The READY request the next launch goes on; no request waits after it."""
        w = self.waiting
        assert w is not None, "taken only once READY (the caller checks)"
        self.waiting = None
        return w

    def _created_at(self) -> float:
        return self.store.job(self.job_id).created_at

    # -- the attempt's slices ------------------------------------------------------------

    def provision_all(self, spec: JobSpec, attempt: int, refusals: int, *, limit_s: float | None,
                      still_wanted: Callable[[JobSpec], bool]) -> list[Slice]:
        """The attempt's slices, all READY, or none held (ProvisioningError).

        A multi-slice job asks for all its slices at once, then waits for each: on GCP each is a
        queued resource that waits for capacity and boots on its own. A request the policy kept
        waiting (the same slices) is waited on rather than asked for again. An autoscaled job's spot
        request takes part of its slices (`policies.cost.moves.takes_part`): once the first is READY,
        those still waiting for capacity are let go (a refusal) and the job starts on the others; the
        policy adds slices back when capacity comes."""
        provider = self.chosen_provider
        stem = f"{self.job_id}-{attempt}" + (f"q{refusals}" if refusals else "")
        if self.waiting is not None and self.waiting.key != Shape(spec.accelerator, spec.tier.value, spec.slices).key:
            self.drop("the policy asks for other slices")
        if spec.slices > 1 and self.waiting is None:
            first = request(provider, self.job_id, stem, spec, spec.accelerator, spec.tier.value,
                            created_at=self._created_at(), limit_s=limit_s)
            self.waiting = replace(first, count=spec.slices)
            parts: list[str] = []
            try:
                for part in range(1, spec.slices):
                    parts.append(request(provider, self.job_id, f"{stem}s{part}", spec, spec.accelerator,
                                         spec.tier.value, created_at=self._created_at(), limit_s=limit_s).name)
            except ProvisioningError:  # all of them or none
                for name in (first.name, *parts):
                    release(provider, name, "the job's other slices could not all be asked for")
                self.waiting = None
                raise
            self.waiting = replace(self.waiting, parts=tuple(parts))
        others = [replace(self.waiting, name=name, parts=()) for name in self.waiting.parts] if self.waiting else []
        if self.waiting is not None:
            self.waiting = replace(self.waiting, parts=())  # `_provision` waits for the first
        takes_part = spec.autoscaling is not None and spec.tier.value == "spot"
        got: list[Slice] = []
        try:
            got.append(self._provision(spec, stem, limit_s=limit_s, still_wanted=still_wanted))
            for i, w in enumerate(others):
                if takes_part and self._waits_for_capacity(w):
                    for rest in others[i:]:
                        release(provider, rest.name, "the slices that came are taken; the rest wait for capacity")
                    self.store.add_event(self.job_id, Autoscaled(spec.accelerator, spec.tier.value, None, None, None,
                                                                 len(got)),
                                         f"{len(got)} of {spec.slices} slices could be had now; starting on them "
                                         "(the others were let go; the policy adds slices when capacity comes)")
                    break
                got.append(self.wait_for(w, spec, still_wanted))
        except ProvisioningError:
            for name in {s.name for s in got} | {w.name for w in others}:
                release(provider, name, "the job's other slices could not all be had")
            raise
        return got

    def _provision(self, spec: JobSpec, stem: str, *, limit_s: float | None,
                   still_wanted: Callable[[JobSpec], bool]) -> Slice:
        """A ready slice, asking again (with backoff and jitter) while the failure is transient.

        A refusal for capacity is not retried here: the queue (and for autoscaled jobs the policy)
        decides what to ask for next. A request still waiting from a move that the policy wants
        again is waited on rather than asked for anew."""
        asked = self.waiting.name if self.waiting is not None else None
        names = iter(n for n in (f"{stem}{suffix}" for suffix in ["", "b", "c", "d"]) if n != asked)
        key = Shape(spec.accelerator, spec.tier.value, spec.slices).key

        def once() -> Slice:
            if self.waiting is not None and self.waiting.key != key:
                self.drop("the policy asks for another slice")
            if self.waiting is None:
                self.waiting = dataclasses.replace(
                    request(self.chosen_provider, self.job_id, next(names), spec, spec.accelerator, spec.tier.value,
                            created_at=self._created_at(), limit_s=limit_s), count=spec.slices)
            try:
                return self.wait_for(self.waiting, spec, still_wanted)
            finally:
                self.waiting = None  # ready (the attempt's slice now), or released

        retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(3), wait=tenacity.wait_exponential_jitter(initial=1, max=20),
            retry=tenacity.retry_if_exception(
                lambda e: isinstance(e, ProvisioningError) and e.transient and not isinstance(e, CapacityError)),
            reraise=True)
        return retrying(once)

    def wait_for(self, w: Waiting, spec: JobSpec, still_wanted: Callable[[JobSpec], bool]) -> Slice:
        """Poll the request until READY; the job is QUEUED while it waits for capacity, and says so.

        Raises CapacityError when it is refused or expires (released, unbilled), and
        ProvisioningError when its hosts do not all start within `start_timeout_s`."""
        provider, poll = self.chosen_provider, spec.provider_facts.poll_interval_s
        started = time.monotonic()
        while True:
            if self.cancel.is_set() or self.store.job(self.job_id).cancel_requested:
                release(provider, w.name, "cancelled")
                raise CapacityError("cancelled while waiting for the slice", slice_name=w.name)
            kind, s, why = look(provider, w)
            if kind is Look.REFUSED:
                raise CapacityError(why, slice_name=w.name)
            assert s is not None, "a request not refused has its slice"
            if kind is Look.READY:
                if self.store.job(self.job_id).state is JobState.QUEUED:  # capacity came, hosts joined between looks
                    self.transition(JobState.PROVISIONING, f"capacity came for slice {w.name}; its hosts joined")
                return s
            if not still_wanted(spec):
                release(provider, w.name, "the policy no longer wants it")
                raise CapacityError(f"the policy no longer wants {w.accelerator} {w.tier}", slice_name=w.name)
            job = self.store.job(self.job_id)
            if s.state in (SliceState.REQUESTED, SliceState.WAITING):
                started = time.monotonic()  # the start timeout counts from when capacity came
                if s.state is SliceState.WAITING and job.state is JobState.PROVISIONING:
                    limit = "while the policy wants it" if w.limit_s is None else f"up to {w.limit_s:.0f} s"
                    self.transition(JobState.QUEUED, f"waiting for capacity: {w.accelerator} {w.tier} ({limit})",
                                    data=StateChange(outcome="no_capacity", slice=w.name))
            elif job.state is JobState.QUEUED:
                self.transition(JobState.PROVISIONING, f"capacity came for slice {w.name}; starting its hosts")
            if time.monotonic() - started > spec.recovery.start_timeout_s:
                release(provider, w.name, "its hosts did not join in time")
                raise ProvisioningError(f"slice {w.name}: its hosts did not all join the cluster within "
                                        f"{spec.recovery.start_timeout_s:.0f} s", slice_name=w.name, transient=True)
            self.cancel.wait(poll)

    def _waits_for_capacity(self, w: Waiting) -> bool:
        """Whether the request still waits for capacity (nothing started for it yet)."""
        kind, s, _ = look(self.chosen_provider, w)
        return kind is Look.WAITING and s is not None and s.state in (SliceState.REQUESTED, SliceState.WAITING)

    # -- beside the running slices -------------------------------------------------------

    def ask_beside(self, spec: JobSpec, want: Shape, *, generation: int, adding: int | None) -> bool:
        """Ask for `want`'s slices beside the running ones without waiting (`adding`: for a grow, only
        that many, the rest being the running ones); False when refused at once (nothing asked)."""
        self._made += 1
        stem = f"{self.job_id}-{generation + 1}m{self._made}"
        made: list[Waiting] = []
        try:
            for part in range(adding if adding is not None else want.count):
                made.append(request(self.chosen_provider, self.job_id, stem + (f"s{part}" if part else ""), spec,
                                    want.accelerator, want.tier, created_at=self._created_at(), limit_s=None))
        except ProvisioningError as e:  # refused at once (CapacityError): a capacity fact, asked again later
            (log.info if isinstance(e, CapacityError) else log.warning)(
                "job %s: request for %s refused: %s", self.job_id, want.label, e)
            for w in made:
                release(self.chosen_provider, w.name, "the rest of the request was refused")
            return False
        self.waiting = replace(made[0], count=want.count, parts=tuple(w.name for w in made[1:]),
                               grow=adding is not None)
        return True

    def ask_one(self, spec: JobSpec, *, generation: int) -> None:
        """Ask for one slice of the spec's type and tier beside the running ones (a regrow)."""
        self._made += 1
        name = f"{self.job_id}-{generation + 1}g{self._made}"
        try:
            self.waiting = request(self.chosen_provider, self.job_id, name, spec, spec.accelerator, spec.tier.value,
                                   created_at=self._created_at(), limit_s=None)
        except ProvisioningError as e:  # refused at once: asked again later
            log.info("job %s: no slice to add back now (%s)", self.job_id, e)

    def follow(self, held: int) -> tuple[Followed, list[Slice]]:
        """One look at the request beside the `held` running slices: READY with its slices (all of
        them, or for a grow those that could be had once the others wait for capacity: those are let
        go), REFUSED (released), or still WAITING."""
        w = self.waiting
        assert w is not None, "followed only while a request waits (the caller checks)"
        if w.grow and w.count != held + len(w.names):  # the running slices changed (a shrink)
            w = self.waiting = replace(w, count=held + len(w.names))
        ready: list[Slice] = []
        pending: list[str] = []  # still waiting for capacity
        refused: list[str] = []
        starting = False
        for name in w.names:
            kind, s, why = look(self.chosen_provider, replace(w, name=name))
            if kind is Look.READY:
                assert s is not None, "a READY look has its slice"
                ready.append(s)
            elif kind is Look.REFUSED:
                refused.append(name)
                log.info("job %s: slice %s (%s %s) refused: %s", self.job_id, name, w.accelerator, w.tier, why)
            elif s is not None and s.state in (SliceState.REQUESTED, SliceState.WAITING):
                pending.append(name)
            else:
                starting = True
        left = [n for n in w.names if n not in refused]
        if refused and (not w.grow or not left):  # all of it or nothing, or nothing left to add
            self.drop("a slice of the request was refused")
            return Followed.REFUSED, []
        if refused:  # a grow goes on asking for those left
            w = self.waiting = replace(w, name=left[0], parts=tuple(left[1:]), count=held + len(left))
        if starting or (pending and not (w.grow and ready)):
            return Followed.WAITING, []
        for name in pending:  # a grow takes the slices it got; those still waiting for capacity are let go
            release(self.chosen_provider, name, "the slices that came are taken; this one waits for capacity")
        taken = held + len(ready) if w.grow else len(ready)
        self.waiting = replace(w, name=ready[0].name, parts=tuple(s.name for s in ready[1:]), count=taken)
        return Followed.READY, ready
