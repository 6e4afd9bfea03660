"""The driver's side of autoscaling: ask the policy, and do the move it names, make-before-break.

The policy (`orchestrator.control.autoscaler.decide`) answers with a `policies.cost.moves.Move`
for the job's slices: the running ones (one, or several of one type: `autoscaling.max_slices`)
and at most one request waiting beside them. The driver does it:

- `request`: ask for that option's slices without waiting for them. Beside running slices
  the job trains on while the request waits; nothing times out: a request waits while the
  policy wants it (a spot size the plan waits for stays requested, so capacity is caught
  the moment it returns). More slices of the running type and tier are a grow: only the
  slices to add are asked for. A spot request for several slices that takes part of them
  (`policies.cost.moves.takes_part`: while the job holds none, or for a grow) is filled
  with those READY once the others wait for capacity; those are let go (a refusal).
- `switch`: the waiting request is READY (all of it, or the part it takes) and is the
  policy's choice, or has fewer slices of the type it chooses: the workers stop at a
  committed checkpoint, the old slices are released (a grow keeps them), the next launch
  restores resharded on the new ones. The policy is asked the moment a request turns READY.
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
from dataclasses import replace
from typing import TYPE_CHECKING, Callable

from orchestrator import catalog
from orchestrator.control.waiting import Look, Waiting, look, release, request
from orchestrator.domain.spec import JobSpec
from orchestrator.errors import ProvisioningError
from orchestrator.providers.base import CapacityError, Slice
from orchestrator.state.events import Autoscaled, ResizeAsked
from orchestrator.state.states import SliceState
from policies.cost.clock import DECISION_INTERVAL_S
from policies.cost.slice_options import MAX_CHIPS, Option
from policies.cost.snapshot import Decision

if TYPE_CHECKING:
    from orchestrator.control.attempt import Attempt
    from orchestrator.control.autoscaler import Choice, Key
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
        """The most spot chips the job may ask for at once: the largest allowed slice, times the
        slices of it it may hold (`max_slices`, 32 chips in all; the autoscaler takes off what the
        zone refused it lately)."""
        auto = spec.autoscaling
        assert auto is not None, "asked only for a job that autoscales (`_decide`'s callers check)"
        hosts = self.plane.provider.max_hosts if spec.provider_facts.limited_by_local_hosts else None
        most = 0
        for t in (catalog.lookup(a) for a in auto.accelerators):
            for n in range(1, auto.max_slices + 1):
                if (n == 1 or n * t.chips <= MAX_CHIPS) and (hosts is None or n * t.hosts <= hosts):
                    most = max(most, n * t.chips)
        return most

    def _decide(self, spec: JobSpec, current: Key | None, *, ready: bool = False) -> Choice:
        """The policy's `Choice`, told of the running slices and of the request waiting beside them."""
        from orchestrator.control.autoscaler import decide

        waiting = self.att.waiting.key if self.att.waiting is not None else None
        return decide(self.store, self.job_id, now=time.time(), current=current, waiting=waiting,
                      waiting_ready=ready and waiting is not None,
                      spot_chips_available=self._spot_chips_available(spec))

    def _drop_request(self, why: str) -> None:
        """Release the request waiting beside the running slices, every slice of it (idempotent;
        never filled: never billed), and any of it READY for a switch not made."""
        att = self.att
        if att.waiting is not None:
            for name in att.waiting.names:
                release(att.chosen_provider, name, why)
        for s in [att.next_slice, *att.next_others]:
            if s is not None:
                release(att.chosen_provider, s.name, why)
        att.waiting, att.next_slice, att.next_others = None, None, []

    def _autoscale_before_provisioning(self, spec: JobSpec) -> JobSpec:
        """Let the cost policy choose the slices of the next attempt: those to run on, or the
        spot size it would wait for (requested, it waits unbilled for capacity)."""
        if self.att.waiting is not None and self.att.waiting.grow:  # the slices it would add to are gone
            self._drop_request("the slices it would have added to are gone")
        choice = self._choice = self._decide(spec, None)
        d, move = choice.decision, choice.move
        if move is not None and move.release_waiting and self.att.waiting is not None:
            self._drop_request("the policy no longer wants it")
        want: tuple[str, str, int] = (choice.accelerator or "", choice.tier or "", choice.count)
        waiting = self.att.waiting
        if waiting is not None and move is not None and not (move.release_waiting or move.request or move.switch):
            want = waiting.key  # a request still waiting that the policy keeps (`policies.cost.moves`): wait on it
        elif choice.accelerator is None and move is not None and move.request is not None:
            want = (move.request.name, move.request.tier, move.request.count)  # wait for spot: keep it requested
        elif choice.accelerator is None and self.att.waiting is not None:
            want = self.att.waiting.key
        elif choice.accelerator is None:
            self.store.add_event(self.job_id, Autoscaled(), "the policy would wait for spot capacity; asking for "
                                 f"{spec.accelerator} {spec.tier.value} as the spec says (a queued request waits "
                                 "for capacity)")
            return spec
        accelerator, tier, count = want
        every = choice.checkpoint_interval_steps
        saving = f"; checkpoint every {every} steps" if every else ""
        verb = "run" if want == (choice.accelerator, choice.tier, choice.count) else "wait for"
        self.store.add_event(self.job_id, Autoscaled(accelerator, tier, d.expected_cost_usd, d.reason, every, count),
                             f"{verb} {_label(accelerator, tier, count)}{saving}: {d.reason}")
        if want != (spec.accelerator, spec.tier.value, spec.slices):
            self.store.update_spec(self.job_id, self.store.job(self.job_id).spec.moved(accelerator, tier,
                                                                                        slices=count))
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
        """Once a poll: follow the request beside the slices; every decision interval (or when the
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
        held: Key = (spec.accelerator, spec.tier.value, len(att.slices))
        choice = self._decide(spec, held, ready=att.next_slice is not None)
        move, d = choice.move, choice.decision
        if move is None:
            return
        if move.switch and att.next_slice is not None:
            self._switch(d.reason)
            return
        if move.release_waiting and att.waiting is not None:
            w = att.waiting
            self.store.add_event(self.job_id, Autoscaled(choice.accelerator, choice.tier, d.expected_cost_usd, d.reason,
                                                         None, choice.count),
                                 f"let go of the request for {_label(*w.key)} ({', '.join(w.names)}): {d.reason}")
            self._drop_request("the policy no longer wants it")
        if move.release_held:
            self.store.add_event(self.job_id, Autoscaled(None, None, d.expected_cost_usd, d.reason),
                                 f"release {att.held_slice.name} and wait for spot: {d.reason}")
            att.resize_to, att.resize_tier = spec.accelerator, spec.tier.value
            att.stop_requested(f"the policy releases the slice: {d.reason}")
            return
        if move.request is not None and att.waiting is None:
            self._request_beside(spec, move.request, d)

    def _request_beside(self, spec: JobSpec, o: Option, d: Decision) -> None:
        """Ask for `o` beside the running slices: all its slices, or for more of the running
        type and tier (a grow), only those to add."""
        att = self.att
        held = len(att.slices)
        grow = o.count > held and (o.name, o.tier) == (spec.accelerator, spec.tier.value)
        self.store.add_event(self.job_id, Autoscaled(o.name, o.tier, d.expected_cost_usd, d.reason, None, o.count),
                             f"request {_label(o.name, o.tier, o.count)} beside {att.held_slice.name}"
                             f"{f' (adding {o.count - held})' if grow else ''}: {d.reason}")
        att.requests += 1
        stem = f"{self.job_id}-{att.generation + 1}m{att.requests}"
        made: list[Waiting] = []
        try:
            for part in range(o.count - held if grow else o.count):
                made.append(request(att.chosen_provider, self.job_id, stem + (f"s{part}" if part else ""), spec,
                                    o.name, o.tier, created_at=self.store.job(self.job_id).created_at, limit_s=None))
        except ProvisioningError as e:  # refused at once (CapacityError): a capacity fact, asked again next interval
            (log.info if isinstance(e, CapacityError) else log.warning)(
                "job %s: request for %s refused: %s", self.job_id, _label(o.name, o.tier, o.count), e)
            for w in made:
                release(att.chosen_provider, w.name, "the rest of the request was refused")
            return
        att.waiting = replace(made[0], count=o.count, parts=tuple(w.name for w in made[1:]), grow=grow)

    def _follow_waiting(self) -> bool:
        """One look at the request beside the running slices; True when it is READY (the policy is
        asked at once whether to switch): all its slices, or for a grow those that could be had
        once the others wait for capacity (they are let go). A refusal asks the policy at once."""
        att = self.att
        if att.next_slice is not None:
            return False  # READY already, the policy kept the running slices for now
        w = att.waiting
        assert w is not None, "followed only while a request waits (the caller checks)"
        if w.grow and w.count != len(att.slices) + len(w.names):  # the running slices changed (a shrink)
            w = att.waiting = replace(w, count=len(att.slices) + len(w.names))
        ready: list[Slice] = []
        pending: list[str] = []  # still waiting for capacity
        refused: list[str] = []
        starting = False
        for name in w.names:
            kind, s, why = look(att.chosen_provider, replace(w, name=name))
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
            self._drop_request("a slice of the request was refused")
            att.next_decision = 0.0
            return False
        if refused:  # a grow goes on asking for those left
            w = att.waiting = replace(w, name=left[0], parts=tuple(left[1:]), count=len(att.slices) + len(left))
        if starting or (pending and not (w.grow and ready)):
            return False
        for name in pending:  # a grow takes the slices it got; those still waiting for capacity are let go
            release(att.chosen_provider, name, "the slices that came are taken; this one waits for capacity")
        taken = len(att.slices) + len(ready) if w.grow else len(ready)
        att.waiting = replace(w, name=ready[0].name, parts=tuple(s.name for s in ready[1:]), count=taken)
        att.next_slice, att.next_others, att.next_ready_at = ready[0], ready[1:], time.time()
        att.next_provision_s = time.monotonic() - w.since
        return True

    def _switch(self, why: str) -> None:
        """Stop the workers at a committed checkpoint; the next launch goes to the READY slices
        (for a grow, beside the running ones)."""
        att = self.att
        w, s = att.waiting, att.next_slice
        assert w is not None and s is not None, "a switch is made only to a READY request (the caller checks)"
        att.waiting = None
        new = [s, *att.next_others]
        if w.grow:
            att.next_others = [*att.next_others, *att.slices]
        att.resize_to, att.resize_tier = w.accelerator, w.tier
        names = ", ".join(x.name for x in new)
        what = f"{w.accelerator} {w.tier}" if len(new) == 1 and not w.grow else _label(w.accelerator, w.tier, w.count)
        reason = f"slice {names} ({what}) {'is' if len(new) == 1 else 'are'} ready beside {att.held_slice.name}"
        self.store.add_event(self.job_id, ResizeAsked(att.held_slice.tpu_type.name, w.accelerator, w.tier,
                                                      f"{reason}: {why}", att.last_step + 1),
                             f"{reason}: checkpointing, then switching ({why})")
        att.stop_requested(f"move to {_label(w.accelerator, w.tier, w.count)}: {reason}")


def _label(accelerator: str, tier: str, count: int) -> str:
    return f"{accelerator} {tier}" if count == 1 else f"{count}x{accelerator} {tier}"
