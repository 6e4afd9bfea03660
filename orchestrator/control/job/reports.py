"""What a job's workers report, recorded: the report sink, the one writer of the job's progress.

Heartbeats, steps, saves, notices, restores and log lines arrive through the controller
(`report`); each is written through the store's `HeldWrites`, so a report never waits for
the store nor raises. Before a worker group is torn down, `catch_up` records the steps whose
reports are still in flight. Progress (`started`, `last_step`, the last disruption, ...) is
written here only; the driver tells the sink when a launch begins and when the job was disrupted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from orchestrator.control.job.stop import StopRequest, Stops
from orchestrator.domain.spec import JobSpec
from orchestrator.errors import IllegalTransitionError
from orchestrator.state.events import (
    AheadCompiled,
    CheckpointSaved,
    EventKind,
    LostWork,
    MemoryCadence,
    NoticeSeen,
    ProgramStored,
    Restored,
    Resumed,
    StateChange,
)
from orchestrator.state.states import JobState
from policies.decisions.recovery import Outcome, OutcomeKind
from workers.protocol import (
    CompiledAhead,
    MemoryKept,
    Noticed,
    ProfileDone,
    ProgramLooked,
    Ready,
    Report,
    Saved,
    StepDone,
    Timings,
)

if TYPE_CHECKING:
    from orchestrator.control.captures import Captures
    from orchestrator.control.compile_ahead import ProgramsAhead
    from orchestrator.control.group import WorkerGroup
    from orchestrator.control.job.placement import Placement
    from orchestrator.control.job.services import JobServices
    from orchestrator.control.launched import Launch
    from orchestrator.control.limits import Limits

log = logging.getLogger(__name__)


class ReportSink:
    def __init__(self, services: JobServices, job_id: str, spec: Callable[[], JobSpec], *, placement: Placement,
                 stops: Stops, captures: Captures, limits: Limits, programs: ProgramsAhead):
        self.services, self.job_id, self.spec = services, job_id, spec
        self.placement, self.stops, self.captures, self.limits, self.programs = (placement, stops, captures, limits,
                                                                                 programs)
        self._launch: Launch | None = None
        self.generation = 0  # whose reports count
        self.started = False  # every host of `generation` joined the runtime
        self.accepting = False  # whether reports of `generation` still count (not once its attempt ended)
        self.last_progress = time.monotonic()
        self.last_step = -1  # newest step reported by worker 0 in this generation
        self.memory_every: int | None = None  # the hosts' memory cadence, once worker 0 says it (`MemoryKept`)
        self.last_step_at: float | None = None  # wall time it was reported (None: no step yet this generation)
        self.restored_step: int | None = None  # the steps complete this generation restored (None: fresh, or not yet)
        self.disrupted_at: float | None = None  # wall time of the last disruption, for "resumed after"
        self.disrupted_step: int | None = None  # steps complete when it happened
        self.resumed = True
        self._log_failed_at = -1e9

    # -- what the driver tells it --------------------------------------------------------

    def begin(self, launch: Launch) -> None:
        """A new launch: reports of its generation count from now on."""
        self._launch, self.generation = launch, launch.generation
        self.started, self.last_step, self.accepting, self.restored_step = False, -1, True, None
        self.last_step_at, self.memory_every = None, None  # a new generation chooses its cadence again
        self.last_progress = time.monotonic()

    def adopted(self, launch: Launch, last_step: int) -> None:
        """A launch of an earlier controller, its hosts joined and trained up to `last_step`."""
        self.begin(launch)
        self.started, self.last_step = True, last_step

    def lost_with_the_cluster(self, generation: int, last_step: int) -> None:
        """The launch went with the whole cluster; its last step recorded is `last_step`."""
        self.generation, self.last_step = generation, last_step

    def launched(self) -> None:
        """The workers are up: the heartbeat counts from now."""
        self.last_progress = time.monotonic()

    def close(self) -> None:
        """The attempt ended: a dying group's last words must not land after its disruption."""
        self.accepting = False

    def last_copied_step(self) -> int | None:
        """The newest step the hosts' memory should hold: the steps done, down to the memory cadence's last copy
        (`workers.memory.Keeping`: a copy once `step` steps are done, every `every`); None before any step. The
        cadence is not known to a controller that adopted the job after it was chosen: then every step."""
        done = self.last_step + 1
        if done <= 0:
            return None
        every = self.memory_every or 1
        return done - done % every

    def disrupted(self, at: float, steps_done: int) -> None:
        """The job stood at `steps_done` at wall time `at`; the next first step says how long it took to resume."""
        self.disrupted_at, self.disrupted_step, self.resumed = at, steps_done, False

    def stood_since(self, known_at: float) -> float:
        """When the job last made progress before a disruption the controller knew of at `known_at`: its last
        step of this generation, if it stepped (a host lost mid-step is found only later), else `known_at`."""
        return known_at if self.last_step_at is None else min(known_at, self.last_step_at)

    # -- what the workers say ------------------------------------------------------------

    def report(self, generation: int, rank: int, report: Report, lines: list[str]) -> None:
        """Heartbeats, metrics and log lines from workers; those of an old generation are dropped.

        It never waits for the store and never raises (a worker sends and forgets: an error here
        would be printed by every worker at every step): what the store refuses is held.
        """
        now = time.time()
        if isinstance(report, ProfileDone):  # matched by its capture, whatever the generation
            self.captures.done(rank, report)
        if generation != self.generation or not self.accepting:
            return
        if lines:
            self.log_lines([f"[host-{rank}] {line}" for line in lines])
        self.last_progress = time.monotonic()
        for kind, handle in _HANDLERS:
            if isinstance(report, kind):
                handle(self, generation, rank, report, now)
                return

    # One handler a kind of report; what the store is told is held (`HeldWrites`) and written in order.

    def _ready(self, generation: int, rank: int, report: Ready, now: float) -> None:
        if rank == 0 and not self.started:
            self.started = True
            change = StateChange(init_s=round(report.init_s, 3), generation=generation)
            self.services.held.add(
                lambda: self._transition_raw(JobState.RUNNING, "all hosts joined the runtime", change, now))

    def _timings(self, generation: int, rank: int, report: Timings, now: float) -> None:
        if rank == 0:
            disrupted, self.restored_step = self.disrupted_step, report.restored_step
            self.services.held.add(lambda: self._record_restore(report, disrupted, now))

    def _step_done(self, generation: int, rank: int, report: StepDone, now: float) -> None:
        if rank == 0:
            self.last_step, self.last_step_at = report.step, now
            self.limits.stepped(report.step)
            resumed_after = None
            if not self.resumed and self.disrupted_at is not None:
                self.resumed, resumed_after = True, now - self.disrupted_at
            self.services.held.add(lambda: self._record_step(generation, report, resumed_after, now))

    def _memory_kept(self, generation: int, rank: int, report: MemoryKept, now: float) -> None:
        if rank != 0:
            return
        self.memory_every = report.every
        risk = "no step" if report.every == 1 else f"at most {report.every - 1} steps"
        self.services.held.add(lambda: self.services.store.add_event(
            self.job_id, MemoryCadence(report.every, round(report.copy_s, 6), round(report.step_s, 6)),
            f"host memory: a copy of the state every {report.every} step(s) ({report.copy_s * 1e3:.1f} ms a copy, "
            f"{report.copy_s / report.step_s:.1%} of a step); a lost slice loses {risk}" if report.step_s else
            f"host memory: a copy of the state every {report.every} step(s)", at=now))

    def _compiled_ahead(self, generation: int, rank: int, report: CompiledAhead, now: float) -> None:
        done = "compiled" if report.compiled else "found kept"
        self.services.held.add(lambda: self.services.store.add_event(
            self.job_id, AheadCompiled(report.slices, round(report.seconds, 3), report.compiled, rank),
            f"the program for {report.slices} slice(s) {done} ahead in {report.seconds:.1f} s: a lost slice's "
            f"survivors load it" if rank == 0 else
            f"host {rank} keeps the program for {report.slices} slice(s) too (from host 0): it is the survivors' "
            f"first host if slice 0 is lost", at=now))

    def _program_looked(self, generation: int, rank: int, report: ProgramLooked, now: float) -> None:
        if rank != 0:  # every host looks; the first one speaks for them
            return
        self.programs.hosts_look_for(report.target)
        self.services.held.add(lambda: self.services.store.add_event(
            self.job_id, ProgramStored(report.target, report.used, rank, reason=report.reason, kept=report.kept),
            f"host {rank} loads the step compiled ahead: {report.reason}" if report.used else
            f"host {rank} loads the step it keeps for {report.target} (compiled ahead on the hosts, or before); "
            f"the job's storage: {report.reason}" if report.kept else
            f"host {rank} compiles the step for {report.target}: {report.reason}", at=now))

    def _saved(self, generation: int, rank: int, report: Saved, now: float) -> None:
        if rank == 0:
            self.services.held.add(lambda: self.services.store.add_event(
                self.job_id, CheckpointSaved(report.step, report.blocking_s), f"saved step {report.step}", at=now))

    def _noticed(self, generation: int, rank: int, report: Noticed, now: float) -> None:
        if self.stops.current is not None:
            return
        if self._launch is not None and (going := self._launch.slice_of(rank)) is not None:
            self.placement.mark_lost(going)  # its slice is going: a multi-slice job goes on without it
        self.stops.ask(StopRequest.notice(f"host {rank}: {report.reason}"))
        step = self.last_step + 1
        self.services.held.add(lambda: self.services.store.add_event(
            self.job_id, NoticeSeen(rank, step), f"preemption notice on host {rank} ({report.reason}) after step "
                                                 f"{step}", at=now))

    def log_lines(self, lines: list[str]) -> None:
        """Lines into the job's log (`orchestrator logs`); a log that cannot be written is logged, once a minute."""
        try:
            with open(self.services.home.job_dir(self.job_id) / "job.log", "a") as f:
                f.writelines(f"{line}\n" for line in lines)
        except OSError as e:
            if time.monotonic() - self._log_failed_at > 60:
                self._log_failed_at = time.monotonic()
                log.warning("job %s: cannot write its log (lines are dropped): %s", self.job_id, e)

    def record_missed(self, generation: int, history: list[dict]) -> int:
        """Record the steps of a worker's history that no report brought (reports are fire-and-forget), and the
        checkpoints committed after them (`workers.protocol.saved_entry`: a controller restarted while the hosts
        saved). Returns how many steps. Read and written by the store's writer after every report it holds,
        so a report taken and not yet written is not recorded a second time from the history."""
        return self.services.held.write(lambda: self._record_missed(generation, history))

    def _record_missed(self, generation: int, history: list[dict]) -> int:
        store = self.services.store
        known = {m.step for m in store.steps(self.job_id)}
        # A step whose loss the worker has not read back yet (reads lag the step) is not recorded.
        missed = [(h["step"], h["loss"], h.get("tokens_per_s"), h.get("step_time_s"), h.get("at"), h.get("metrics"))
                  for h in history if h["step"] not in known and h.get("loss") is not None]
        store.record_steps(self.job_id, generation, missed)  # one transaction, each row at its own time
        saves = [h for h in history if "saved" in h]
        recorded = {e.payload.step for e in store.events(self.job_id, kind=EventKind.CHECKPOINT)
                    if isinstance(e.payload, CheckpointSaved)} if saves else set()
        for h in saves:
            if h["saved"] not in recorded:
                store.add_event(self.job_id, CheckpointSaved(h["saved"], h.get("save_blocking_s")),
                                f"saved step {h['saved']}", at=h.get("saved_at"))
        return len(missed)

    def catch_up(self, outcome: Outcome, group: WorkerGroup | None) -> None:
        """Before a group is torn down, record the steps whose reports are still in flight.

        Not after a host was lost: a dead host's worker may not answer, and recovery must not wait for it.
        """
        if group is None or not self.started or outcome.kind is OutcomeKind.INFRA_LOST:
            return
        history = group.history()
        if history is None:  # the worker went with its host after all: what is recorded is what there is
            return
        self.accepting = False
        self.record_missed(self.generation, history)
        self.last_step = max([self.last_step, *(h["step"] for h in history)])

    def _transition_raw(self, target: JobState, reason: str, data: StateChange, at: float) -> None:
        """A transition written by `HeldWrites` (the store's own, not waiting: it is retried from there)."""
        try:
            self.services.store.transition(self.job_id, target, reason, data=data, at=at)
        except IllegalTransitionError as e:
            log.warning("job %s: %s", self.job_id, e)

    def _record_step(self, generation: int, r: StepDone, resumed_after: float | None, at: float) -> None:
        store = self.services.store
        store.record_steps(self.job_id, generation, [(r.step, r.loss, r.tokens_per_s, r.step_time_s, at, r.metrics)])
        if resumed_after is not None:
            store.add_event(self.job_id, Resumed(resumed_after, r.step + 1),
                            f"resumed after {resumed_after:.1f} s, counted from the last step before the "
                            f"disruption (first step done: {r.step + 1})", at=at)

    def _record_restore(self, t: Timings, disrupted_step: int | None, at: float) -> None:
        store = self.services.store  # written by `HeldWrites`: the store's own
        restored, unreadable = t.restored_step, list(t.unreadable)
        what = f"restored step {restored}" if restored is not None else "started from scratch"
        if t.source == "memory":
            what += " from the surviving slices' memory (no checkpoint read)"
        elif t.memory_miss:
            what += f" from storage (the copy in memory could not be used: {t.memory_miss})"
        total = self.spec().workload.steps
        if restored is not None and total is not None and restored >= total:
            what += f" of {total}: the run had already finished, nothing to train"
        if unreadable:
            what += f" (fell back: checkpoint {', '.join(map(str, unreadable))} unreadable)"
        store.add_event(self.job_id, Restored(t.restore_s, t.compile_s, restored, unreadable, t.source, t.memory_miss),
                        f"{what}; " + (f"compile took {t.compile_s:.1f} s" if t.compile_s else
                                       "the program compiles in its first step"), at=at)
        if disrupted_step is not None:
            lost = max(0, disrupted_step - (restored or 0))
            times = [m.step_time_s for m in store.steps(self.job_id) if m.step_time_s]
            mean = sum(times) / len(times) if times else 0.0
            store.add_event(self.job_id, LostWork(lost, lost * mean, disrupted_step, restored or 0),
                            f"lost {lost} steps (from step {disrupted_step} back to {restored or 0})", at=at)


_HANDLERS: tuple[tuple[type, Callable[..., None]], ...] = (
    (Ready, ReportSink._ready), (Timings, ReportSink._timings), (StepDone, ReportSink._step_done),
    (MemoryKept, ReportSink._memory_kept), (CompiledAhead, ReportSink._compiled_ahead),
    (ProgramLooked, ReportSink._program_looked), (Saved, ReportSink._saved), (Noticed, ReportSink._noticed),
)
