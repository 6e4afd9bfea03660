"""The driver's side of autoscaling: ask the policy, and do the move it names, make-before-break.

The policy (`orchestrator.control.autoscaler.decide`) answers with a `policies.cost.moves.Move`
for the job's slices: the running one and at most one request waiting beside it. The
driver does it:

- `request`: ask for that slice without waiting for it. Beside a running slice the job
  trains on while the request waits; nothing times out: a request waits while the policy
  wants it (a spot size the plan waits for stays requested, so capacity is caught the
  moment it returns).
- `switch`: the waiting request is READY and still the choice: the workers stop at a
  committed checkpoint, the old slice is released, the next launch restores resharded on
  the new one. The policy is asked the moment a request turns READY.
- `release_waiting`: give the request back (never filled: never billed). A request let go
  unfilled, or one the provider refused or expired, is a capacity fact in the store's
  slice events, never a failure.
- `release_held`: stop at a committed checkpoint and release the running slice; the next
  attempt asks the policy what to request (the spot size it waits for).

The policy is asked before each provisioning, every decision interval (on the job's
clock: trace time when it replays a capacity trace), and at once when a request is
refused or turns READY.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable

from orchestrator import catalog
from orchestrator.control.waiting import Look, look, release, request
from orchestrator.domain.spec import JobSpec
from orchestrator.errors import ProvisioningError
from orchestrator.providers.base import CapacityError
from orchestrator.state.events import Autoscaled, ResizeAsked
from policies.cost.clock import DECISION_INTERVAL_S

if TYPE_CHECKING:
    from orchestrator.control.attempt import Attempt
    from orchestrator.control.autoscaler import Choice
    from orchestrator.control.controller import Controller
    from orchestrator.providers.capacity import TraceClock
    from orchestrator.state.store import Store

log = logging.getLogger(__name__)


class AutoscalingMixin:
    """Autoscaling for `JobDriver` (which holds `store`, `job_id`, `att`, `plane`, `spec()`, `_clock()`)."""

    # What `JobDriver` holds, named here for the type checker.
    plane: Controller
    store: Store
    job_id: str
    att: Attempt
    spec: Callable[[], JobSpec]
    _clock: Callable[[JobSpec], TraceClock]

    _choice: Choice | None = None  # the policy's last choice before provisioning (its checkpoint interval applies)

    def _spot_chips_available(self, spec: JobSpec) -> int:
        """The largest spot slice the job may ask for (the autoscaler takes off what the zone refused it lately)."""
        assert spec.autoscaling is not None, "asked only for a job that autoscales (`_decide`'s callers check)"
        allowed = [catalog.lookup(a) for a in spec.autoscaling.accelerators]
        if spec.provider == "local":
            allowed = [t for t in allowed if t.hosts <= self.plane.provider.max_hosts]
        return max((t.chips for t in allowed), default=0)

    def _decide(self, spec: JobSpec, current: tuple[str, str] | None, *, ready: bool = False) -> Choice:
        """The policy's `Choice`, told of the running slice and of the request waiting beside it."""
        from orchestrator.control.autoscaler import decide

        waiting = self.att.waiting.key if self.att.waiting is not None else None
        return decide(self.store, self.job_id, now=time.time(), current=current, waiting=waiting,
                      waiting_ready=ready and waiting is not None,
                      spot_chips_available=self._spot_chips_available(spec))

    def _autoscale_before_provisioning(self, spec: JobSpec) -> JobSpec:
        """Let the cost policy choose the slice of the next attempt: the one to run on, or the
        spot size it would wait for (requested, it waits unbilled for capacity)."""
        choice = self._choice = self._decide(spec, None)
        d, move = choice.decision, choice.move
        if move is not None and move.release_waiting and self.att.waiting is not None:
            release(self.att.chosen_provider, self.att.waiting.name, "the policy no longer wants it")
            self.att.waiting = None
        want = (choice.accelerator, choice.tier)
        waiting = self.att.waiting
        if waiting is not None and move is not None and not (move.release_waiting or move.request or move.switch):
            want = waiting.key  # a request still waiting that the policy keeps (`policies.cost.moves`): wait on it
        elif choice.accelerator is None and move is not None and move.request is not None:
            want = (move.request.name, move.request.tier)  # wait for spot: keep its size requested
        elif choice.accelerator is None and self.att.waiting is not None:
            want = self.att.waiting.key
        elif choice.accelerator is None:
            self.store.add_event(self.job_id, Autoscaled(), "the policy would wait for spot capacity; asking for "
                                 f"{spec.accelerator} {spec.tier.value} as the spec says (a queued request waits "
                                 "for capacity)")
            return spec
        every = choice.checkpoint_interval_steps
        saving = f"; checkpoint every {every} steps" if every else ""
        verb = "run" if want == (choice.accelerator, choice.tier) else "wait for"
        self.store.add_event(self.job_id, Autoscaled(*want, d.expected_cost_usd, d.reason, every),
                             f"{verb} {want[0]} {want[1]}{saving}: {d.reason}")
        if want != (spec.accelerator, spec.tier.value):
            accelerator, tier = want
            assert accelerator is not None and tier is not None, "a slice to run on or wait for is named"
            self.store.update_spec(self.job_id, self.store.job(self.job_id).spec.moved(accelerator, tier))
            spec = self.spec()
        return spec  # its checkpoint interval applies once on the slice (`Driver._on_slice`)

    def _still_wanted(self, spec: JobSpec) -> bool:
        """While nothing runs and a request waits: is it still what the policy wants? (Asked every
        decision interval; when not, the request is released and the driver asks again.)"""
        att, now = self.att, time.monotonic()
        if spec.autoscaling is None or now < att.next_decision:
            return True
        att.next_decision = now + self._clock(spec).wall_seconds(DECISION_INTERVAL_S)
        choice = self._decide(spec, None)
        if choice.move is None or (choice.accelerator is None and choice.move.request is None):
            return True  # the policy names nothing to run or wait for: the request the spec says stays
        return not choice.move.release_waiting

    def _autoscale_while_running(self) -> None:
        """Once a poll: follow the request beside the slice; every decision interval (or when the
        request is refused or READY), ask the policy and do its move."""
        att = self.att
        turned_ready = self._follow_waiting() if att.waiting is not None and att.notice is None else False
        now = time.monotonic()
        if not att.started or att.notice or (now < att.next_decision and not turned_ready):
            return
        spec = self.spec()
        att.next_decision = now + self._clock(spec).wall_seconds(DECISION_INTERVAL_S)
        if spec.autoscaling is None:
            return
        choice = self._decide(spec, (spec.accelerator, spec.tier.value), ready=att.next_slice is not None)
        move, d = choice.move, choice.decision
        if move is None:
            return
        if move.switch and att.next_slice is not None:
            self._switch(d.reason)
            return
        if move.release_waiting and att.waiting is not None:
            release(att.chosen_provider, att.waiting.name, "the policy no longer wants it")
            att.waiting, att.next_slice = None, None
        if move.release_held:
            self.store.add_event(self.job_id, Autoscaled(None, None, d.expected_cost_usd, d.reason),
                                 f"release {att.held_slice.name} and wait for spot: {d.reason}")
            att.resize_to, att.resize_tier = spec.accelerator, spec.tier.value
            att.stop_requested(f"the policy releases the slice: {d.reason}")
            return
        if move.request is not None and att.waiting is None:
            o = move.request
            self.store.add_event(self.job_id, Autoscaled(o.name, o.tier, d.expected_cost_usd, d.reason),
                                 f"request {o.name} {o.tier} beside {att.held_slice.name}: {d.reason}")
            att.requests += 1
            name = f"{self.job_id}-{att.generation + 1}m{att.requests}"
            try:
                att.waiting = request(att.chosen_provider, self.job_id, name, spec, o.name, o.tier,
                                      created_at=self.store.job(self.job_id).created_at, limit_s=None)
            except CapacityError as e:  # refused at once: a capacity fact, asked about again next interval
                log.info("job %s: request for %s %s refused: %s", self.job_id, o.name, o.tier, e)
            except ProvisioningError as e:
                log.warning("job %s: could not request %s %s: %s", self.job_id, o.name, o.tier, e)

    def _follow_waiting(self) -> bool:
        """One look at the request beside the running slice; True when it is READY (the policy is
        asked at once whether to switch). A refusal asks the policy at once, that size missing."""
        att = self.att
        if att.next_slice is not None:
            return False  # READY already, the policy kept the running slice for now
        w = att.waiting
        assert w is not None, "followed only while a request waits (the caller checks)"
        kind, s, why = look(att.chosen_provider, w)
        if kind is Look.WAITING:
            return False
        if kind is Look.REFUSED:
            att.waiting = None
            log.info("job %s: slice %s (%s %s) refused: %s", self.job_id, w.name, w.accelerator, w.tier, why)
            att.next_decision = 0.0
            return False
        att.next_slice, att.next_ready_at = s, time.time()
        att.next_provision_s = time.monotonic() - w.since
        return True

    def _switch(self, why: str) -> None:
        """Stop the workers at a committed checkpoint; the next launch goes to the READY request."""
        att = self.att
        w, s = att.waiting, att.next_slice
        assert w is not None and s is not None, "a switch is made only to a READY request (the caller checks)"
        att.waiting = None
        att.resize_to, att.resize_tier = w.accelerator, w.tier
        reason = f"slice {s.name} ({w.accelerator} {w.tier}) is ready beside {att.held_slice.name}"
        self.store.add_event(self.job_id, ResizeAsked(att.held_slice.tpu_type.name, w.accelerator, w.tier,
                                                      f"{reason}: {why}", att.last_step + 1),
                             f"{reason}: checkpointing, then switching ({why})")
        att.stop_requested(f"move to {w.accelerator} {w.tier}: {reason}")
