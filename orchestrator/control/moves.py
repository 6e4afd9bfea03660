"""The driver's side of autoscaling: ask the policy, and move make-before-break.

Before each provisioning the policy chooses the slice (type and tier) of the attempt.
While the job runs it is asked every decision interval (scaled by the job's clock when
it replays a capacity trace); a choice other than the running slice is requested
*beside* it, and the job trains on while the request waits. Once the new slice is READY
the workers stop at a committed checkpoint, the old slice is released and the next
launch restores resharded on the new one. A request the policy no longer wants is
released (never filled: never billed); one refused or expired goes back to the policy,
its size marked missing by the slice events the store keeps, and spends nothing of
`max_failures`.
"""

from __future__ import annotations

import logging
import time

from orchestrator import catalog
from orchestrator.control.waiting import Look, look, release, request
from orchestrator.errors import ProvisioningError
from orchestrator.providers.base import CapacityError
from orchestrator.state.events import Autoscaled, ResizeAsked
from orchestrator.user.spec import JobSpec
from policies.clock import DECISION_INTERVAL_S

log = logging.getLogger(__name__)


class AutoscalingMixin:
    """Autoscaling for `JobDriver` (which holds `store`, `job_id`, `att`, `plane`, `spec()`, `_clock()`)."""

    _choice = None  # the policy's last choice before provisioning (its checkpoint interval applies)

    def _spot_chips_available(self, spec: JobSpec) -> int:
        """The largest spot slice the job may ask for (the autoscaler takes off what the zone refused it lately)."""
        allowed = [catalog.lookup(a) for a in spec.autoscaling.accelerators]
        if spec.provider == "local":
            allowed = [t for t in allowed if t.hosts <= self.plane.provider.max_hosts]
        return max((t.chips for t in allowed), default=0)

    def _decide(self, spec: JobSpec, current: tuple[str, str] | None):
        """The policy's choice (None: hold no slice, wait for spot), told of the request waiting beside."""
        from orchestrator.control.autoscaler import decide

        waiting = self.att.waiting.key if self.att.waiting is not None else None
        choice = decide(self.store, self.job_id, now=time.time(), current=current, waiting=waiting,
                        spot_chips_available=self._spot_chips_available(spec))
        return None if choice.accelerator is None else choice

    def _autoscale_before_provisioning(self, spec: JobSpec) -> JobSpec:
        """Let the cost policy choose the slice type and tier of the next attempt."""
        from orchestrator.control.autoscaler import with_checkpoint_interval

        choice = self._choice = self._decide(spec, None)
        if choice is None:
            self.store.add_event(self.job_id, Autoscaled(), "the policy would wait for spot capacity; asking for "
                                 f"{spec.accelerator} {spec.tier.value} as the spec says (a queued request waits "
                                 "for capacity)")
            return spec
        d = choice.decision
        every = choice.checkpoint_interval_steps
        saving = f"; checkpoint every {every} steps" if every else ""
        self.store.add_event(self.job_id, Autoscaled(choice.accelerator, choice.tier, d.expected_cost_usd, d.reason,
                                                     every),
                             f"run {choice.accelerator} {choice.tier}{saving}: {d.reason}")
        if (choice.accelerator, choice.tier) != (spec.accelerator, spec.tier.value):
            raw = dict(self.store.job(self.job_id).spec, accelerator=choice.accelerator, tier=choice.tier)
            self.store.update_spec(self.job_id, raw)
            spec = self.spec()
        return with_checkpoint_interval(spec, choice)

    def _autoscale_while_running(self) -> None:
        """Once a poll: follow a request waiting beside the slice; every decision interval, ask the policy."""
        att = self.att
        if att.waiting is not None and att.notice is None:
            self._follow_waiting()
        now = time.monotonic()
        if not att.started or att.notice or now < att.next_decision:
            return
        spec = self.spec()
        att.next_decision = now + self._clock(spec).wall_seconds(DECISION_INTERVAL_S)
        if spec.autoscaling is None:
            return
        current = (spec.accelerator, spec.tier.value)
        choice = self._decide(spec, current)
        target = None if choice is None else (choice.accelerator, choice.tier)
        # Stay. None: the policy would rather hold nothing and wait for spot; the job trains on
        # (it would save less to stop now than to run until spot is there again).
        if target is None or target == current:
            if att.waiting is not None:
                release(att.provider, att.waiting.name, "the policy no longer wants it")
                att.waiting = None
            return
        if att.waiting is not None and att.waiting.key == target:
            return  # still wanted: it goes on waiting
        if att.waiting is not None:
            release(att.provider, att.waiting.name, f"the policy wants {target[0]} {target[1]} instead")
            att.waiting = None
        d = choice.decision
        self.store.add_event(self.job_id, Autoscaled(choice.accelerator, choice.tier, d.expected_cost_usd, d.reason),
                             f"move to {choice.accelerator} {choice.tier}, requested beside {att.slice.name}: "
                             f"{d.reason}")
        att.requests += 1
        name = f"{self.job_id}-{att.generation + 1}m{att.requests}"
        try:
            att.waiting = request(att.provider, self.job_id, name, spec, *target,
                                  created_at=self.store.job(self.job_id).created_at, limit_s=None)
        except CapacityError as e:  # refused at once: a capacity fact, asked about again next interval
            log.info("job %s: request for %s %s refused: %s", self.job_id, *target, e)
        except ProvisioningError as e:
            log.warning("job %s: could not request %s %s: %s", self.job_id, *target, e)

    def _follow_waiting(self) -> None:
        """One look at the request beside the running slice: READY switches, a refusal asks the policy again."""
        att = self.att
        w = att.waiting
        kind, s, why = look(att.provider, w)
        if kind is Look.WAITING:
            return
        att.waiting = None
        if kind is Look.REFUSED:
            log.info("job %s: slice %s (%s %s) refused: %s", self.job_id, w.name, w.accelerator, w.tier, why)
            att.next_decision = 0.0  # the policy hears of it at once, with that size missing
            return
        att.next_slice, att.next_ready_at = s, time.time()
        att.next_provision_s = time.monotonic() - w.since
        att.resize_to, att.resize_tier = w.accelerator, w.tier
        reason = f"slice {s.name} ({w.accelerator} {w.tier}) is ready beside {att.slice.name}"
        self.store.add_event(self.job_id, ResizeAsked(att.slice.tpu_type.name, w.accelerator, w.tier, reason,
                                                      att.last_step + 1),
                             f"{reason}: checkpointing, then switching")
        att.stop_requested(f"move to {w.accelerator} {w.tier}: {reason}")
