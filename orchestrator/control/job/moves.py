"""Moves: ask the cost policy, and apply the `Move` it names to the job's `Placement`, make-before-break.

The policy (`orchestrator.control.job.policy.JobPolicy`) answers with a `policies.cost.moves.Move`
for the job's slices: the running ones (one, or several of one type: `autoscaling.max_slices`)
and at most one request waiting beside them. `Moves` does it:

- `request`: ask for that option's slices without waiting for them. Beside running slices
  the job trains on while the request waits; nothing times out: a request waits while the
  policy wants it (a spot size the plan waits for stays requested, so capacity is caught
  the moment it returns). More slices of the running type and tier are a grow: only the
  slices to add are asked for. A spot request for several slices that takes part of them
  (`policies.cost.moves.takes_part`: while the job holds none, or for a grow) is filled
  with those READY once the others wait for capacity; those are let go (a refusal).
- `switch`: the waiting request is READY and is the policy's choice: a MOVE stop request;
  the workers stop at a committed checkpoint, the old slices are released (a grow keeps
  them), the next launch restores resharded on the new ones.
- `release_waiting`: give the request back (never filled: never billed).
- `release_held`: a RELEASE stop request; the next attempt asks the policy what to request.

Not autoscaled, a multi-slice job short of slices (it lost some) asks for one beside the
survivors and, once READY, makes a REGROW stop request (`regrow`).

The policy is asked before each provisioning, every decision interval (on the job's clock:
trace time when it replays a capacity trace), and at once when a request is refused or turns READY.
`Moves` is the one writer of when the policy is asked next and of its choice before provisioning.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from orchestrator.control.job.requests import Followed
from orchestrator.control.job.stop import StopKind, StopRequest, Stops
from orchestrator.domain.shape import Shape
from orchestrator.domain.spec import JobSpec
from orchestrator.state.events import Autoscaled, ResizeAsked
from policies.cost.clock import DECISION_INTERVAL_S
from policies.cost.snapshot import Decision

if TYPE_CHECKING:
    from orchestrator.control.autoscaler import Choice, Key
    from orchestrator.control.job.placement import Placement
    from orchestrator.control.job.policy import JobPolicy
    from orchestrator.control.job.reports import ReportSink
    from orchestrator.state.protocol import JobStore
    from policies.cost.clock import Clock

FIRST_DECISION_S = 30.0  # a new launch measures its speed this long before the policy is asked


class Moves:
    def __init__(self, store: JobStore, job_id: str, spec: Callable[[], JobSpec], clock: Callable[[JobSpec], Clock],
                 *, policy: JobPolicy, placement: Placement, stops: Stops, progress: ReportSink):
        self.store, self.job_id, self.spec, self.clock = store, job_id, spec, clock
        self.policy, self.placement, self.stops, self.progress = policy, placement, stops, progress
        self.choice: Choice | None = None  # the policy's last choice before provisioning (its checkpoint interval)
        self._next_decision = 0.0  # monotonic time the policy is asked again

    def ask_now(self) -> None:
        """Ask the policy at the next poll."""
        self._next_decision = 0.0

    def launched(self, spec: JobSpec) -> None:
        self._next_decision = time.monotonic() + FIRST_DECISION_S / self.clock(spec).scale

    def _choose(self, spec: JobSpec, current: Key | None, *, ready: bool = False) -> Choice:
        w = self.placement.waiting
        return self.policy.choose(spec, current, waiting=w.key if w is not None else None, ready=ready)

    def _interval_passed(self, spec: JobSpec) -> bool:
        now = time.monotonic()
        if now < self._next_decision:
            return False
        self._next_decision = now + self.clock(spec).wall_s(DECISION_INTERVAL_S)
        return True

    # -- while nothing runs --------------------------------------------------------------

    def before_provisioning(self, spec: JobSpec) -> JobSpec:
        """Let the cost policy choose the slices of the next attempt: those to run on, or the spot size it
        would wait for (requested, it waits unbilled for capacity). Returns the spec to provision."""
        placement = self.placement
        if placement.waiting is not None and placement.waiting.grow:  # the slices it would add to are gone
            placement.drop("the slices it would have added to are gone")
        choice = self.choice = self._choose(spec, None)
        d, move = choice.decision, choice.move
        if move is not None and move.release_waiting and placement.waiting is not None:
            placement.drop("the policy no longer wants it")
        want: tuple[str, str, int] = (choice.accelerator or "", choice.tier or "", choice.count)
        waiting = placement.waiting
        if waiting is not None and move is not None and not (move.release_waiting or move.request or move.switch):
            want = waiting.key  # a request still waiting that the policy keeps (`policies.cost.moves`): wait on it
        elif choice.accelerator is None and move is not None and move.request is not None:
            want = (move.request.name, move.request.tier, move.request.count)  # wait for spot: keep it requested
        elif choice.accelerator is None and waiting is not None:
            want = waiting.key
        elif choice.accelerator is None:
            self.store.add_event(self.job_id, Autoscaled(), "the policy would wait for spot capacity; asking for "
                                 f"{spec.accelerator} {spec.tier.value} as the spec says (a queued request waits "
                                 "for capacity)")
            return spec
        shape = Shape(*want)
        every = choice.checkpoint_interval_steps
        saving = f"; checkpoint every {every} steps" if every else ""
        verb = "run" if want == (choice.accelerator, choice.tier, choice.count) else "wait for"
        self.store.add_event(self.job_id, Autoscaled(shape.accelerator, shape.tier, d.expected_cost_usd, d.reason,
                                                     every, shape.count),
                             f"{verb} {shape.label}{saving}: {d.reason}")
        if want != (spec.accelerator, spec.tier.value, spec.slices):
            self.store.place(self.job_id, shape)
            spec = self.spec()
        return spec  # its checkpoint interval applies once on the slice (`JobDriver.on_slices`)

    def still_wanted(self, spec: JobSpec) -> bool:
        """While nothing runs and a request waits: is it still what the policy wants? (Asked every
        decision interval; when not, the request is released and the driver asks again.)"""
        if spec.autoscaling is None or not self._interval_passed(spec):
            return True
        choice = self._choose(spec, None)
        if choice.move is None or (choice.accelerator is None and choice.move.request is None):
            return True  # the policy names nothing to run or wait for: the request the spec says stays
        return not choice.move.release_waiting

    # -- beside running slices -----------------------------------------------------------

    def while_running(self) -> None:
        """Once a poll: follow the request beside the slices; every decision interval (or when the
        request is refused or READY), ask the policy and do its move."""
        placement, stopping = self.placement, self.stops.current is not None
        followed = placement.follow() if placement.waiting is not None and not stopping else Followed.WAITING
        if followed is Followed.REFUSED:
            self.ask_now()
        spec = self.spec()
        if not self.progress.started or stopping:
            return
        if followed is not Followed.READY and not self._interval_passed(spec):
            return
        if followed is Followed.READY:
            self._interval_passed(spec)  # asked now: the next time counts from here
        if spec.autoscaling is None:
            return
        held = Shape(spec.accelerator, spec.tier.value, len(placement.slices))
        choice = self._choose(spec, held.key, ready=bool(placement.ready))
        move, d = choice.move, choice.decision
        if move is None:
            return
        if move.switch and placement.ready:
            self._switch(d.reason)
            return
        if move.release_waiting and (w := placement.waiting) is not None:
            self.store.add_event(self.job_id, Autoscaled(choice.accelerator, choice.tier, d.expected_cost_usd, d.reason,
                                                         None, choice.count),
                                 f"let go of the request for {Shape(*w.key).label} ({', '.join(w.names)}): "
                                 f"{d.reason}")
            placement.drop("the policy no longer wants it")
        if move.release_held:
            self.store.add_event(self.job_id, Autoscaled(None, None, d.expected_cost_usd, d.reason),
                                 f"release {placement.slices[0].name} and wait for spot: {d.reason}")
            self.stops.ask(StopRequest(StopKind.RELEASE, f"the policy releases the slice: {d.reason}",
                                       Shape(spec.accelerator, spec.tier.value, held.count)))
            return
        if move.request is not None and placement.waiting is None:
            self._request_beside(spec, Shape(move.request.name, move.request.tier, move.request.count), d)

    def _request_beside(self, spec: JobSpec, want: Shape, d: Decision) -> None:
        held = len(self.placement.slices)
        grow = want.count > held and (want.accelerator, want.tier) == (spec.accelerator, spec.tier.value)
        self.store.add_event(self.job_id, Autoscaled(want.accelerator, want.tier, d.expected_cost_usd, d.reason, None,
                                                     want.count),
                             f"request {want.label} beside {self.placement.slices[0].name}"
                             f"{f' (adding {want.count - held})' if grow else ''}: {d.reason}")
        self.placement.request_beside(spec, want, generation=self.progress.generation)

    def _switch(self, why: str) -> None:
        """Stop the workers at a committed checkpoint; the next launch goes to the READY slices (for a
        grow, beside the running ones)."""
        running = self.placement.slices[0]
        w, new = self.placement.switch()
        target = Shape(w.accelerator, w.tier, w.count)
        names = ", ".join(x.name for x in new)
        what = f"{w.accelerator} {w.tier}" if len(new) == 1 and not w.grow else target.label
        reason = f"slice {names} ({what}) {'is' if len(new) == 1 else 'are'} ready beside {running.name}"
        self.store.add_event(self.job_id, ResizeAsked(running.tpu_type.name, w.accelerator, w.tier, f"{reason}: {why}",
                                                      self.progress.last_step + 1),
                             f"{reason}: checkpointing, then switching ({why})")
        self.stops.ask(StopRequest(StopKind.MOVE, f"move to {target.label}: {reason}", target))

    # -- a job short of slices -----------------------------------------------------------

    def regrow(self) -> None:
        """A multi-slice job running on fewer slices than its spec's (it lost some): ask for one beside
        them, and once it is READY stop at a committed step and go on on all of them (make-before-break,
        restoring from storage: the new slice's hosts hold nothing in memory)."""
        spec, placement = self.spec(), self.placement
        running = placement.slices
        if (spec.autoscaling is not None or not spec.recovery.regrow or not self.progress.started
                or self.stops.current is not None or len(running) >= spec.slices
                or self.progress.last_step < 0):  # the survivors train again first
            return
        new = placement.regrow(spec, generation=self.progress.generation)
        if new is None:
            return
        reason = (f"slice {new.name} is ready beside the {len(running)} running; checkpointing, then going on "
                  f"on {len(running) + 1} slices")
        self.store.add_event(self.job_id, ResizeAsked(spec.accelerator, spec.accelerator, spec.tier.value, reason,
                                                      self.progress.last_step + 1), reason)
        self.stops.ask(StopRequest(StopKind.REGROW, f"adding slice {new.name} back",
                                   Shape(spec.accelerator, spec.tier.value, len(running) + 1)))
