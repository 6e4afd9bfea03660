"""One driver per job: a thread that runs the job's state machine, attempt after attempt, until one ends it.

Its loop reads plainly: wait for a turn in the queue, provision slices (`Placement`), launch the
workers (a frozen `Launch`), watch them until the attempt ends with a typed outcome, tear down, and
ask `policies.decisions.recovery.after` what comes next (recover, resize, succeed, fail, cancel).
What the workers report goes to the `ReportSink`; what the cost policy asks goes through `Moves`;
why the workers are asked to stop is one `StopRequest` (`Stops`). See `orchestrator.control.job`.

A store that cannot be written does not stop the driver (`orchestrator.control.store_faults`): its
own writes wait until the store takes them, and what its workers report is held and written in order
once it does; meanwhile the workers train on.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from orchestrator.control.attempt import Attempt
from orchestrator.control.autoscaler import with_checkpoint_interval
from orchestrator.control.captures import Captures
from orchestrator.control.compile_ahead import ProgramsAhead
from orchestrator.control.group import WorkerGroup
from orchestrator.control.job.moves import Moves
from orchestrator.control.job.placement import Placement
from orchestrator.control.job.policy import JobPolicy, StoredFactsPolicy
from orchestrator.control.job.reports import ReportSink
from orchestrator.control.job.requests import Requests
from orchestrator.control.job.services import JobServices
from orchestrator.control.job.stop import StopKind, StopRequest, Stops
from orchestrator.control.job.watch import Watched
from orchestrator.control.launch import launch_plan
from orchestrator.control.launched import Launch
from orchestrator.control.limits import Limits
from orchestrator.control.store_faults import HoldingStore
from orchestrator.control.waiting import clock_for
from orchestrator.domain.shape import Shape
from orchestrator.domain.spec import JobSpec
from orchestrator.providers.base import Slice
from orchestrator.state.events import StateChange
from orchestrator.state.protocol import JobStore
from orchestrator.state.states import FailedBecause, JobState
from policies.cost.clock import Clock
from workers.protocol import Report

if TYPE_CHECKING:
    from orchestrator.control.adoption import Adoption

GroupFactory = Callable[["JobDriver", JobSpec], WorkerGroup]


def ray_group(driver: JobDriver, spec: JobSpec) -> WorkerGroup:
    """The real group: one `HostWorker` actor per host of the launch's slices."""
    from orchestrator.control.group import RayWorkerGroup

    assert driver.launched is not None, "a group is made for a launch"
    return RayWorkerGroup(driver.plane.store, driver.plane.home, driver.job_id, spec, driver.launched,
                          on_lost=driver.placement.mark_lost, wake=driver.wake)


class JobDriver:
    """The job's state machine: each attempt goes QUEUED/PROVISIONING -> STARTING -> RUNNING and ends with an
    `Outcome`, from which `policies.decisions.recovery.after` names the next state. A transition the store
    refuses is a bug of ours: it ends the driver's loop loudly (the job FAILED_CONTROLLER), never silently."""

    def __init__(self, plane: JobServices, job_id: str, adoption: Adoption | None = None, *,
                 groups: GroupFactory = ray_group, policy: JobPolicy | None = None):
        self.plane, self.job_id, self.groups = plane, job_id, groups
        # The store as the driver writes it: a write waits out a store fault (`HoldingStore`, a `JobStore`).
        self.store: JobStore = HoldingStore(plane.store, plane.store_health, plane.held)
        self.cancelled = threading.Event()  # the user's cancel, seen between polls
        self.wake = threading.Event()  # a report, a stop or a cancel: the watch loop looks at once (`watch._wait_s`)
        self.stops = Stops()
        self.placement = Placement(Requests(self.store, job_id, self.cancelled, self.transition), job_id)
        self.captures = Captures(self.store, job_id)  # `orchestrator profile`
        self.limits = Limits(self.store, job_id)  # budget_usd and deadline
        self.programs = ProgramsAhead(plane.home, job_id, self.store)  # the step for the next shapes, off the hosts
        self.progress = ReportSink(plane, job_id, self.spec, placement=self.placement, stops=self.stops,
                                   captures=self.captures, limits=self.limits, programs=self.programs)
        self.policy: JobPolicy = policy or StoredFactsPolicy(plane, job_id)
        self.moves = Moves(self.store, job_id, self.spec, self._clock, policy=self.policy, placement=self.placement,
                           stops=self.stops, progress=self.progress)
        self.launched: Launch | None = None  # what the current generation was started with
        self.group: WorkerGroup | None = None  # its workers, once launched
        self.adopted = adoption is not None
        self.rng = random.Random()
        if adoption is not None:
            self._adopt(adoption)

    def _adopt(self, adoption: Adoption) -> None:
        """The running group a restarted controller found."""
        from orchestrator.control.group import RayWorkerGroup

        self.placement.adopt(adoption.provider, list(adoption.launch.slices))
        self.launched = adoption.launch
        self.progress.adopted(adoption.launch, adoption.last_step)
        self.group = RayWorkerGroup(self.plane.store, self.plane.home, self.job_id, self.spec(), adoption.launch,
                                    on_lost=self.placement.mark_lost, workers=adoption.workers, pg=adoption.pg,
                                    wake=self.wake)

    def spec(self) -> JobSpec:
        return self.store.job(self.job_id).spec

    # -- what the controller asks --------------------------------------------------------

    def report(self, generation: int, rank: int, report: Report, lines: list[str]) -> None:
        before = self.stops.current
        self.progress.report(generation, rank, report, lines)
        if self.stops.current is not before:  # a host's notice asked a stop: the loop sends it to every host now
            self.wake.set()

    def cancel(self) -> None:
        self.cancelled.set()
        self.wake.set()

    def resize(self, accelerator: str, tier: str, reason: str) -> StopRequest | None:
        """Stop at the current step (checkpointed) and go on on `accelerator` `tier` (a user's resize).
        None if taken; else the stop that stands already (a notice, a move, ...): the resize is not made."""
        count = max(1, len(self.placement.slices))
        asked = StopRequest(StopKind.RESIZE, f"resize to {accelerator}: {reason}", Shape(accelerator, tier, count))
        taken = self.stops.ask(asked)
        self.wake.set()
        return None if taken else self.stops.current

    def view(self) -> Attempt:
        """The launch as the budget, profile captures and compile-ahead read it (a snapshot), with its one
        write: a stop request (a notice-like stop at a committed step)."""
        stop, slices = self.stops.current, self.placement.slices
        return Attempt(generation=self.progress.generation, started=self.progress.started, group=self.group,
                       notice=stop.reason if stop is not None else None,
                       resize_to=stop.target.accelerator if stop is not None and stop.target is not None else None,
                       slice=slices[0] if slices else None, others=slices[1:], waiting=self.placement.waiting,
                       last_step=self.progress.last_step,
                       on_stop=self._stop_for)

    def _stop_for(self, reason: str) -> None:
        """A stop asked from outside the loop (the budget): the workers stop at a committed step."""
        self.stops.ask(StopRequest.notice(reason))
        self.wake.set()

    def start_group(self, spec: JobSpec) -> WorkerGroup:
        """The workers of the current launch (`groups`: Ray actors, or a test's scripted ones)."""
        self.group = self.groups(self, spec)
        return self.group

    def watched(self) -> Watched:
        assert self.group is not None, "watched once launched"
        return Watched(self.group, self.placement, self.stops, self.cancelled, self.progress, self.wake)

    # -- what the loop uses --------------------------------------------------------------

    def on_slices(self, slices: tuple[Slice, ...]) -> JobSpec:
        """The spec the launch on `slices` uses: the submitted one placed on their type and tier (and for an
        autoscaled job, on the count of slices it goes on: the policy's, or the survivors')."""
        job, s = self.store.job(self.job_id), slices[0]
        count = len(slices) if job.spec.autoscaling is not None else job.spec.slices
        if (shape := Shape(s.tpu_type.name, s.tier.value, count)) != job.shape:
            self.store.place(self.job_id, shape)
        spec = self.spec()
        choice = self.moves.choice
        return with_checkpoint_interval(spec, choice) if choice is not None else spec

    def on_poll(self) -> None:
        """Once a poll of a running attempt: the budget and deadline, then the moves, then compiling ahead."""
        self.limits.check(self.view(), self.spec)
        self.moves.while_running()
        self.moves.regrow()
        self.programs.poll(self.spec, self.view())

    def teardown(self) -> None:
        """End the workers and release the slices (each idempotent) but those the next launch goes on."""
        self.progress.close()
        if self.group is not None:
            self.group.stop()
            self.group = None
        self.placement.teardown()

    def clock(self, spec: JobSpec) -> Clock:
        return clock_for(spec, self.store.job(self.job_id).created_at)

    _clock = clock

    def user_queue_limit_s(self, spec: JobSpec) -> float | None:
        """The spec's `queue_timeout` on the job's clock (wall seconds), or None: no limit."""
        return self.clock(spec).wall_s(spec.queue_timeout.total_seconds()) if spec.queue_timeout else None

    def queue_limit_s(self, spec: JobSpec) -> float | None:
        """How long (wall seconds) a request may wait for capacity before it expires: an autoscaled job's
        waits while the policy wants it (asked every decision interval); any other job's up to its
        `queue_timeout` (None: no limit)."""
        return None if spec.autoscaling is not None else self.user_queue_limit_s(spec)

    def transition(self, target: JobState, reason: str, *, data: StateChange | None = None,
                   cause: FailedBecause | None = None, at: float | None = None) -> None:
        """Move the job to `target`; raises IllegalTransitionError if the store refuses (see the class)."""
        fields: dict[str, Any] = {} if cause is None else {"cause": cause.value}
        self.store.transition(self.job_id, target, reason, data=data, at=at, **fields)

    def new_launch(self, slices: tuple[Slice, ...], spec: JobSpec, memory_step: int | None) -> Launch:
        """Generation N+1 on `slices`: its plan resolved and recorded, its record, a clean stop, progress
        counted from it."""
        plan = launch_plan(spec, self.store.bump_generation(self.job_id), len(slices), memory_step=memory_step)
        planned = plan.planned
        self.store.add_event(self.job_id, planned, f"plan: {planned.line}")
        launch = self.launched = Launch.of(plan, slices)
        self.stops.clear()
        self.progress.begin(launch)
        self.limits.new_attempt()
        self.moves.launched(spec)
        return launch
