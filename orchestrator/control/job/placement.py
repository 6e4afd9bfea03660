"""Where a job runs: the slices it holds, those its next launch goes on, and the request beside them.

`Placement` is the one writer of all three. The slices the next launch goes on (`ready`) come from
a provisioning (all READY, or none held), from a request READY beside the running slices (a move, a
grow, a regrow), or from the survivors of a lost slice. A teardown releases every held slice but
those; a slice released takes the copies in its hosts' memory with it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from orchestrator.control.job.requests import Followed, Requests
from orchestrator.control.launch import training_settings
from orchestrator.control.memory import drop_keepers
from orchestrator.control.waiting import Waiting, release
from orchestrator.domain.shape import Shape
from orchestrator.domain.spec import JobSpec
from orchestrator.providers.base import Slice, SliceProvider
from policies.model.sharding import MeshError

log = logging.getLogger(__name__)

REGROW_S = 30.0  # how long after a refused request a job short of slices asks again


@dataclass(frozen=True)
class Held:
    """What a launch goes on, as `Placement.hold_next` hands it over."""

    slices: tuple[Slice, ...]
    survived_from: int | None  # the survivors of this many slices (a lost slice), else None
    memory_step: int | None  # the survivors restore this step from their memory
    ready_at: float | None  # wall time the slices became READY beside the old ones (make-before-break)
    provision_s: float  # from their request to READY, for those made beside


class Placement:
    def __init__(self, requests: Requests, job_id: str):
        self.requests, self.job_id = requests, job_id
        self._held: list[Slice] = []  # in slice order: process ids are slice-major
        self._ready: list[Slice] = []  # what the next launch goes on, once the running workers stop
        self._ready_at: float | None = None
        self._ready_provision_s = 0.0
        self._lost: set[str] = set()  # held slices going or gone (a notice, a host lost, a reclaim)
        self._memory_step: int | None = None
        self._survived_from: int | None = None
        self._regrow_at = 0.0  # monotonic time a job short of slices may ask for one again

    # -- what it holds -------------------------------------------------------------------

    @property
    def provider(self) -> SliceProvider:
        return self.requests.chosen_provider

    def use(self, provider: SliceProvider) -> None:
        self.requests.use(provider)

    @property
    def slices(self) -> list[Slice]:
        return list(self._held)

    @property
    def ready(self) -> list[Slice]:
        return list(self._ready)

    @property
    def waiting(self) -> Waiting | None:
        return self.requests.waiting

    @property
    def lost(self) -> frozenset[str]:
        return frozenset(self._lost)

    def mark_lost(self, name: str) -> None:
        """A held slice is going or gone: a multi-slice job may go on without it (`keep_survivors`)."""
        self._lost.add(name)

    def adopt(self, provider: SliceProvider, slices: list[Slice]) -> None:
        """Hold the slices a restarted controller found its job's workers on."""
        self.use(provider)
        self._held = list(slices)

    # -- from one launch to the next -----------------------------------------------------

    def provision(self, spec: JobSpec, attempt: int, refusals: int, *, limit_s: float | None,
                  still_wanted: Callable[[JobSpec], bool]) -> None:
        """The next launch's slices, all READY (or none held: ProvisioningError)."""
        self._ready = self.requests.provision_all(spec, attempt, refusals, limit_s=limit_s,
                                                  still_wanted=still_wanted)
        self._ready_at = None

    def hold_next(self) -> Held:
        """The ready slices become the held ones: the next launch goes on them."""
        held = Held(tuple(self._ready), self._survived_from, self._memory_step, self._ready_at,
                    self._ready_provision_s)
        self._held, self._ready, self._lost = list(self._ready), [], set()
        self._survived_from = self._memory_step = self._ready_at = None
        return held

    def teardown(self) -> None:
        """Release every held slice (idempotent) but those the next launch goes on (the survivors of
        a lost slice, the running slices of a grow)."""
        kept = {s.name for s in self._ready}
        for s in self._held:
            if s.name not in kept:
                drop_keepers(s)  # the copies in its hosts' memory go with it
                self.provider.release(s.name)
        self._held = []

    def drop(self, why: str) -> None:
        """Release the request waiting beside the slices and any slices READY for a switch not made."""
        self.requests.drop(why)
        for s in self._ready:
            release(self.provider, s.name, why)
        self._ready = []

    def release_all(self, why: str) -> None:
        """The job is over: give back what it asked for and did not run on."""
        for s in self._ready:
            drop_keepers(s)
        if self.requests.provider is not None:
            self.drop(why)

    # -- beside the running slices -------------------------------------------------------

    def request_beside(self, spec: JobSpec, want: Shape, *, generation: int) -> bool:
        """Ask for `want` beside the running slices: all its slices, or for more of the running type and
        tier (a grow) only those to add. False when refused at once."""
        held = len(self._held)
        grow = want.count > held and (want.accelerator, want.tier) == (spec.accelerator, spec.tier.value)
        return self.requests.ask_beside(spec, want, generation=generation, adding=want.count - held if grow else None)

    def follow(self) -> Followed:
        """One look at the request beside the running slices; READY once the next launch's slices are."""
        if self._ready:
            return Followed.WAITING  # READY already, the policy kept the running slices for now
        followed, ready = self.requests.follow(len(self._held))
        if followed is Followed.READY:
            w = self.requests.waiting
            assert w is not None, "a READY request is kept until the switch"
            self._ready, self._ready_at = ready, time.time()
            self._ready_provision_s = time.monotonic() - w.since
        return followed

    def switch(self) -> tuple[Waiting, list[Slice]]:
        """Take the READY request for the next launch (a grow keeps the running slices beside it)."""
        w, new = self.requests.take(), list(self._ready)
        if w.grow:
            self._ready = [*self._ready, *self._held]
        return w, new

    def regrow(self, spec: JobSpec, *, generation: int) -> Slice | None:
        """A job short of slices: the slice READY beside the survivors (the next launch goes on it and
        them), or None after asking for one (at most every REGROW_S)."""
        if self._ready:
            new = self._ready[0]
            self.requests.take()
            self._ready = [new, *self._held]
            return new
        if self.requests.waiting is None and time.monotonic() >= self._regrow_at:
            self._regrow_at = time.monotonic() + REGROW_S  # a refused request is asked again after this
            self.requests.ask_one(spec, generation=generation)
        return None

    def keep_survivors(self, spec: JobSpec, held_step: Callable[[list[Slice]], tuple[int | None, str]]) -> bool:
        """A multi-slice launch that lost some of its slices: the next one goes on the others at once, from
        the newest step all their hosts hold in memory (`held_step`; from storage if none), at the same
        global batch. False when they cannot go on (none left, the batch or the mesh does not fit). Asked once an
        attempt, by `watch`, for a launched or an adopted group alike."""
        if len(self._held) < 2 or not self._lost:
            return False
        survivors = [s for s in self._held if s.name not in self._lost]
        if not survivors:
            return False
        try:  # the batch splits over the survivors and each one's share has a mesh (`plan_slices`)
            training_settings(spec, spec.tpu_type.chips, spec.tpu_type.hosts, slices=len(survivors))
        except MeshError as e:
            log.warning("job %s: cannot go on on %d slices (%s); restarting on new ones", self.job_id,
                        len(survivors), e)
            return False
        step, why = held_step(survivors)
        if step is None:
            log.warning("job %s: the surviving slices hold no common copy in memory (%s); they restore from storage",
                        self.job_id, why)
        self._ready, self._memory_step, self._survived_from = survivors, step, len(self._held)
        return True
