"""A multi-slice job's slices, for `JobDriver`: asked for together, survived one by one, added back.

- `_provision_all`: the attempt's slices, all requested at once, then waited for (on GCP each is a
  queued resource that waits for capacity and boots on its own).
- `_keep_survivors`: a lost slice (a host gone, a reclaim, a notice): the next launch goes on the
  others at once, restoring from their hosts' memory (`orchestrator.control.memory`).
- `_regrow`: a job short of slices asks for one beside the survivors and switches make-before-break.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from orchestrator.control.launch import training_settings
from orchestrator.control.waiting import Look, Waiting, look, release, request
from orchestrator.domain.spec import JobSpec
from orchestrator.errors import ProvisioningError
from orchestrator.state.events import Autoscaled, ResizeAsked
from orchestrator.state.states import SliceState
from policies.decisions.recovery import Outcome, OutcomeKind
from policies.model.sharding import MeshError

if TYPE_CHECKING:
    from orchestrator.control.attempt import Attempt
    from orchestrator.providers.base import Slice
    from orchestrator.state.store import Store

log = logging.getLogger(__name__)

REGROW_S = 30.0  # how long after a refused request a job short of slices asks again


class SlicesMixin:
    """Several slices for `JobDriver` (which holds `store`, `job_id`, `att`, `spec()`, `_provision`, ...)."""

    # What `JobDriver` holds, named here for the type checker.
    store: Store
    job_id: str
    att: Attempt
    spec: Callable[[], JobSpec]
    _provision: Callable[..., Slice]
    _wait_for: Callable[[Waiting, JobSpec], Slice]
    _queue_limit_s: Callable[[JobSpec], float | None]
    _drop_request: Callable[[str], None]

    def _keep_survivors(self, outcome: Outcome, spec: JobSpec) -> None:
        """A multi-slice attempt that lost some of its slices (a host gone, a reclaim, a notice): the
        next launch goes on the others at once, from the newest step all their hosts hold in memory
        (`orchestrator.control.memory`; from storage if none), at the same global batch. The lost
        slices are released with the attempt; the policy may add one back later."""
        att = self.att
        if len(att.slices) < 2 or not att.lost or outcome.kind not in (OutcomeKind.INFRA_LOST,
                                                                          OutcomeKind.PREEMPTED):
            return
        survivors = [s for s in att.slices if s.name not in att.lost]
        if not survivors:
            return
        batch = spec.workload.global_batch_size
        try:
            training_settings(spec, spec.tpu_type.chips, spec.tpu_type.hosts, slices=len(survivors))
        except MeshError as e:
            log.warning("job %s: cannot go on on %d slices (%s); restarting on new ones", self.job_id,
                        len(survivors), e)
            return
        if batch is not None and batch % len(survivors):
            log.warning("job %s: global_batch_size=%d does not split over %d slices; restarting on new ones",
                        self.job_id, batch, len(survivors))
            return
        step, why = att.held_group.held_step(survivors)
        if step is None:
            log.warning("job %s: the surviving slices hold no common copy in memory (%s); they restore from storage",
                        self.job_id, why)
        att.next_slice, att.next_others = survivors[0], survivors[1:]
        att.memory_step, att.shrunk_from = step, f"{len(att.slices)} slices"

    def _provision_all(self, spec: JobSpec, attempt: int, refusals: int) -> None:
        """The attempt's slices, all READY (`next_slice`, `next_others`), or none held (ProvisioningError).

        A multi-slice job asks for all its slices at once, then waits for each: on GCP each is a
        queued resource that waits for capacity and boots on its own. A request the policy kept
        waiting (`att.waiting`, the same slices) is waited on rather than asked for again. An
        autoscaled job's spot request takes part of its slices (`policies.cost.moves.takes_part`):
        once the first is READY, those still waiting for capacity are let go (a refusal) and the
        job starts on the others; the policy adds slices back when capacity comes."""
        att, provider = self.att, self.att.chosen_provider
        stem = f"{self.job_id}-{attempt}" + (f"q{refusals}" if refusals else "")
        key = (spec.accelerator, spec.tier.value, spec.slices)
        if att.waiting is not None and att.waiting.key != key:
            self._drop_request("the policy asks for other slices")
        if spec.slices > 1 and att.waiting is None:
            first = request(provider, self.job_id, stem, spec, spec.accelerator, spec.tier.value,
                            created_at=self.store.job(self.job_id).created_at, limit_s=self._queue_limit_s(spec))
            att.waiting = replace(first, count=spec.slices)
            parts: list[str] = []
            try:
                for part in range(1, spec.slices):
                    parts.append(request(provider, self.job_id, f"{stem}s{part}", spec, spec.accelerator,
                                         spec.tier.value, created_at=self.store.job(self.job_id).created_at,
                                         limit_s=self._queue_limit_s(spec)).name)
            except ProvisioningError:  # all of them or none
                for name in (first.name, *parts):
                    release(provider, name, "the job's other slices could not all be asked for")
                att.waiting = None
                raise
            att.waiting = replace(att.waiting, parts=tuple(parts))
        others = [replace(att.waiting, name=name, parts=()) for name in att.waiting.parts] if att.waiting else []
        if att.waiting is not None:
            att.waiting = replace(att.waiting, parts=())  # `_provision` waits for the first
        takes_part = spec.autoscaling is not None and spec.tier.value == "spot"
        try:
            att.next_slice = self._provision(spec, attempt, round_=refusals)
            for i, w in enumerate(others):
                if takes_part and self._waits_for_capacity(w):
                    for rest in others[i:]:
                        release(provider, rest.name, "the slices that came are taken; the rest wait for capacity")
                    had = 1 + len(att.next_others)
                    self.store.add_event(self.job_id, Autoscaled(spec.accelerator, spec.tier.value, None, None, None,
                                                                 had),
                                         f"{had} of {spec.slices} slices could be had now; starting on them (the "
                                         "others were let go; the policy adds slices when capacity comes)")
                    break
                att.next_others.append(self._wait_for(w, spec))
        except ProvisioningError:
            held = {s.name for s in [att.next_slice, *att.next_others] if s is not None}
            for name in held | {w.name for w in others}:
                release(provider, name, "the job's other slices could not all be had")
            att.next_slice, att.next_others = None, []
            raise

    def _waits_for_capacity(self, w: Waiting) -> bool:
        """Whether the request still waits for capacity (nothing started for it yet)."""
        kind, s, _ = look(self.att.chosen_provider, w)
        return kind is Look.WAITING and s is not None and s.state in (SliceState.REQUESTED, SliceState.WAITING)

    def _regrow(self) -> None:
        """A multi-slice job running on fewer slices than its spec's (it lost some): ask for one beside
        them, and once it is READY stop at a committed step and go on on all of them (make-before-break,
        restoring from storage: the new slice's hosts hold nothing in memory)."""
        att, spec = self.att, self.spec()
        if (spec.autoscaling is not None or not spec.recovery.regrow or not att.started or att.notice is not None
                or len(att.slices) >= spec.slices or att.last_step < 0):  # the survivors train again first
            return
        if att.next_slice is not None:  # READY beside the survivors (`_follow_waiting`): switch
            new, running = att.next_slice, att.slices
            att.waiting, att.next_others = None, list(running)
            att.resize_to, att.resize_tier = spec.accelerator, spec.tier.value
            reason = (f"slice {new.name} is ready beside the {len(running)} running; checkpointing, then going on "
                      f"on {len(running) + 1} slices")
            self.store.add_event(self.job_id, ResizeAsked(spec.accelerator, spec.accelerator, spec.tier.value, reason,
                                                          att.last_step + 1), reason)
            att.stop_requested(f"adding slice {new.name} back")
            return
        if att.waiting is None and time.monotonic() >= att.regrow_at:
            att.regrow_at = time.monotonic() + REGROW_S  # a refused request is asked again after this
            att.requests += 1
            name = f"{self.job_id}-{att.generation + 1}g{att.requests}"
            try:
                att.waiting = request(att.chosen_provider, self.job_id, name, spec, spec.accelerator, spec.tier.value,
                                      created_at=self.store.job(self.job_id).created_at, limit_s=None)
            except ProvisioningError as e:  # refused at once: asked again later
                log.info("job %s: no slice to add back now (%s)", self.job_id, e)
