"""A job's slice requests: asked for (all of a multi-slice job's at once, all or none), named, waited
on (all of them together: they fill in any order, `attempt_slices`), followed beside the running slices,
given back.
`Requests` is the one writer of the request waiting beside the slices (`waiting`) and of the count
that names requests.

Names say where a request comes from: `JOB-N` (and `JOB-Ns1`, ... for a multi-slice job's other
slices; `JOB-Nq2` after two refusals) for generation N's provisioning, `JOB-Nm3` for the third
request made beside running slices (a move, a grow), `JOB-Ng4` for a slice asked to regrow; a
slice of a provisioning asked for again after its hosts did not start adds `b`, then `c`
(`JOB-Ns1b`). A name is never asked for twice: the store records every slice a job asked for, an earlier
controller's too, and a name it holds is passed over (a released slice's lifecycle has no way back).
"""

from __future__ import annotations

import enum
import itertools
import logging
import threading
from collections.abc import Callable, Collection, Iterator
from dataclasses import replace

import tenacity

from orchestrator.control.job.attempt_slices import AttemptSlices
from orchestrator.control.waiting import Look, Waiting, look, release, request
from orchestrator.domain.shape import Shape
from orchestrator.domain.spec import JobSpec
from orchestrator.errors import ProvisioningError
from orchestrator.providers.base import CapacityError, Slice, SliceProvider
from orchestrator.state.events import Autoscaled
from orchestrator.state.protocol import JobStore
from orchestrator.state.states import SliceState

log = logging.getLogger(__name__)

Transition = Callable[..., None]  # JobDriver.transition(target, reason, *, data=None)


class Followed(str, enum.Enum):
    WAITING = "waiting"  # for capacity, or for its hosts
    READY = "ready"  # all of it, or for a grow the part that came
    REFUSED = "refused"  # released: ask the policy again


def _names(base: str, taken: Collection[str]) -> Iterator[str]:
    """The names a slice of the attempt is asked for under, in turn (`base`, then again after a failed start:
    `b`, `c`, `d`, then `r5`, `r6`, ...), none of them `taken`."""
    suffixes = itertools.chain(["", "b", "c", "d"], (f"r{k}" for k in itertools.count(5)))
    return (n for n in (f"{base}{suffix}" for suffix in suffixes) if n not in taken)


class Requests:
    def __init__(self, store: JobStore, job_id: str, cancel: threading.Event, transition: Transition):
        self.store, self.job_id, self.cancel, self.transition = store, job_id, cancel, transition
        self.provider: SliceProvider | None = None  # chosen before the first request
        self.waiting: Waiting | None = None  # the request not READY yet, or READY for a switch not made
        self._made = 0  # requests made beside running slices, for unique names (`_fresh`)

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

    def _taken(self) -> set[str]:
        """Every slice name the job has asked for, by this controller or an earlier one."""
        return {r.name for r in self.store.slices(job_id=self.job_id)}

    def _fresh(self, prefix: str) -> str:
        """The next `prefix` + count that names no slice the job asked for, alone or with a part's suffix (`s1`).
        The count starts again at 0 under a restarted controller: the store says which names are used."""
        taken = self._taken()
        while True:
            self._made += 1
            stem = f"{prefix}{self._made}"
            if not any(n == stem or n.startswith(f"{stem}s") for n in taken):
                return stem

    def _created_at(self) -> float:
        return self.store.job(self.job_id).created_at

    # -- the attempt's slices ------------------------------------------------------------

    def provision_all(self, spec: JobSpec, attempt: int, refusals: int, *, limit_s: float | None,
                      still_wanted: Callable[[JobSpec], bool]) -> list[Slice]:
        """The attempt's slices, READY and in slice order (the launch's), or none held (ProvisioningError).

        A multi-slice job asks for all its slices at once, then waits on all of them together: on GCP each
        is a queued resource that waits for capacity and boots on its own, so they fill in any order. A
        request the policy kept waiting (the same slices) is waited on rather than asked for again. A slice
        whose hosts do not start in time is asked for again (with backoff and jitter) while the others are
        kept; a refusal for capacity is not retried here: the queue (and for autoscaled jobs the policy)
        decides what to ask for next. An autoscaled job's spot request takes part of its slices
        (`policies.cost.moves.takes_part`): once one is READY, those still waiting for capacity are let go
        (a refusal), those whose hosts are starting are waited for, and the job starts on the READY ones;
        the policy adds slices back when capacity comes."""
        stem = f"{self.job_id}-{attempt}" + (f"q{refusals}" if refusals else "")
        if self.waiting is not None and self.waiting.key != Shape(spec.accelerator, spec.tier.value, spec.slices).key:
            self.drop("the policy asks for other slices")
        kept_waiting = self.waiting
        kept = kept_waiting.names if kept_waiting is not None else ()
        asked: dict[int, Waiting | None] = {  # by slice position; None: to be asked for
            i: replace(kept_waiting, name=kept[i], parts=(), grow=False) if kept_waiting and i < len(kept) else None
            for i in range(spec.slices)}
        taken = self._taken() | set(kept)
        names = {i: _names(f"{stem}s{i}" if i else stem, taken) for i in asked}
        together = AttemptSlices(spec, asked, self.chosen_provider, self.store, self.job_id, cancel=self.cancel,
                                 transition=self.transition, on_asked=self._waiting_on)

        def once() -> list[Slice]:
            for i in [i for i, w in asked.items() if w is None]:
                asked[i] = request(self.chosen_provider, self.job_id, next(names[i]), spec, spec.accelerator,
                                   spec.tier.value, created_at=self._created_at(), limit_s=limit_s)
                self._waiting_on(asked, spec.slices)
            return together.wait(takes_part=spec.autoscaling is not None and spec.tier.value == "spot",
                                 still_wanted=still_wanted)

        retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(3), wait=tenacity.wait_exponential_jitter(initial=1, max=20),
            retry=tenacity.retry_if_exception(
                lambda e: isinstance(e, ProvisioningError) and e.transient and not isinstance(e, CapacityError)),
            reraise=True)
        try:
            got = retrying(once)
        except ProvisioningError as e:  # all of them or none
            self.drop(f"the job's slices could not all be had: {e}")
            raise
        self.waiting = None  # READY: the attempt's slices now
        if len(got) < spec.slices:
            self.store.add_event(self.job_id, Autoscaled(spec.accelerator, spec.tier.value, None, None, None, len(got)),
                                 f"{len(got)} of {spec.slices} slices could be had now; starting on them "
                                 "(the others were let go; the policy adds slices when capacity comes)")
        return got

    def _waiting_on(self, asked: dict[int, Waiting | None], count: int) -> None:
        """`waiting` names every request of the attempt made now, so that `drop` gives them all back."""
        made = [w for w in asked.values() if w is not None]
        self.waiting = replace(made[0], count=count, parts=tuple(w.name for w in made[1:])) if made else None

    # -- beside the running slices -------------------------------------------------------

    def ask_beside(self, spec: JobSpec, want: Shape, *, generation: int, adding: int | None) -> bool:
        """Ask for `want`'s slices beside the running ones without waiting (`adding`: for a grow, only
        that many, the rest being the running ones); False when refused at once (nothing asked)."""
        stem = self._fresh(f"{self.job_id}-{generation + 1}m")
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
        name = self._fresh(f"{self.job_id}-{generation + 1}g")
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
            elif kind in (Look.REFUSED, Look.FAILED):  # asked for again later, either way
                refused.append(name)
                log.info("job %s: slice %s (%s %s) %s: %s", self.job_id, name, w.accelerator, w.tier,
                         "refused" if kind is Look.REFUSED else "failed", why)
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
