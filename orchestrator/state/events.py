"""What the store records about a job besides its state: one kind enum, one frozen record per kind.

Every event is written through `Store.add_event(job_id, record, reason)`, which takes the
kind from the record, and read back as `Event.payload`, the same record. No other module
names an event kind by a string. The JSON kept in the store is the record's fields
(`to_data`); a field a row lacks (an older version's row, or a partial one) reads back as
None, and a key the record does not know is ignored.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any, ClassVar


class EventKind(str, enum.Enum):
    STATE = "state"  # a job state transition (`Store.transition`)
    SLICE = "slice"  # a slice of the job changed state
    LAUNCHED = "launched"  # a generation of workers was placed on a slice
    RESTORE = "restore"  # the workers restored a checkpoint (or started fresh) and compiled
    LOST_WORK = "lost_work"  # steps to be computed again after a disruption
    CHECKPOINT = "checkpoint"  # worker 0 saved a step
    NOTICE = "notice"  # a host got a preemption notice
    DISRUPTION = "disruption"  # an attempt ended other than as asked
    RESUMED = "resumed"  # the first step after a disruption
    ADOPTED = "adopted"  # a restarted controller took over the running group
    AUTOSCALE = "autoscale"  # the cost policy's choice
    RESIZE = "resize"  # a move to another slice type was asked for
    PROFILE = "profile"  # a profile capture ended (traced, or why not)
    DEADLINE = "deadline"  # at its measured speed the job now ends after its deadline, or in time again
    FOLDER = "folder"  # at submit: what the job does with its checkpoint folder (new, resume, fresh, ...)
    STORE = "store"  # the state store refused writes for a while (recorded when it took them again)
    MEMORY = "memory"  # how often the hosts copy the state to their memory (a multi-slice job)
    AHEAD = "ahead"  # the program for one slice fewer was compiled while the job trained (a multi-slice job)
    PROGRAM = "program"  # a program compiled ahead for a shape was stored in the job's storage, or a host looked for it
    PLAN = "plan"  # what a generation was launched with: its shape, mesh, microbatches and intervals


@dataclass(frozen=True)
class Payload:
    KIND: ClassVar[EventKind]
    _RENAMED: ClassVar[dict[str, str]] = {}  # field -> key in the stored JSON

    def to_data(self) -> dict[str, Any] | None:
        data = {self._RENAMED.get(f.name, f.name): getattr(self, f.name) for f in dataclasses.fields(self)}
        return data or None

    @classmethod
    def from_data(cls, data: dict[str, Any] | None) -> "Payload":
        data = data or {}
        back = {v: k for k, v in cls._RENAMED.items()}
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{back.get(k, k): v for k, v in data.items() if back.get(k, k) in names})


@dataclass(frozen=True)
class StateChange(Payload):
    """Extra facts of a transition (each optional)."""

    KIND: ClassVar[EventKind] = EventKind.STATE
    outcome: str | None = None  # how the attempt ended, on -> RECOVERING (and no_capacity on -> QUEUED)
    init_s: float | None = None  # on -> RUNNING
    generation: int | None = None
    provision_s: float | None = None  # on -> STARTING
    slice: str | None = None
    to: str | None = None  # on -> RESIZING: the accelerator moved to
    overlap_s: float | None = None  # on -> STARTING after a move: how long the old and new slices both ran

    def to_data(self) -> dict[str, Any] | None:
        return {k: v for k, v in (super().to_data() or {}).items() if v is not None} or None


@dataclass(frozen=True)
class SliceChanged(Payload):
    KIND: ClassVar[EventKind] = EventKind.SLICE
    name: str | None = None
    accelerator: str | None = None
    chips: int | None = None
    tier: str | None = None
    state: str | None = None
    usd_per_hour: float | None = None
    zone: str | None = None  # where the slice is (pooled capacity memory keys on it); None: the job's zone


@dataclass(frozen=True)
class Launched(Payload):
    KIND: ClassVar[EventKind] = EventKind.LAUNCHED
    slice: str | None = None
    nodes: list[str] | None = None
    pids: list[int] | None = None
    generation: int | None = None
    slices: int | None = None  # slices the generation trains on (None: one, from before this was recorded)
    slice_names: list[str] | None = None  # all of them (None: `slice` alone, from before this was recorded)


@dataclass(frozen=True)
class Restored(Payload):
    KIND: ClassVar[EventKind] = EventKind.RESTORE
    restore_s: float | None = None
    compile_s: float | None = None
    restored_step: int | None = None  # None: started from scratch
    unreadable: list[int] = dataclasses.field(default_factory=list)  # checkpoints it fell back past
    source: str = "storage"  # storage, or memory: the surviving slices' own copy (`workers.memory`)
    memory_miss: str | None = None  # why the copy in memory could not be used (it came from storage)


@dataclass(frozen=True)
class MemoryCadence(Payload):
    """How often the hosts of a multi-slice job copy the state to their memory, and what a lost slice risks."""

    KIND: ClassVar[EventKind] = EventKind.MEMORY
    every: int = 1
    copy_s: float = 0.0
    step_s: float = 0.0


@dataclass(frozen=True)
class AheadCompiled(Payload):
    """Host 0 compiled the step for `slices` slices (one fewer than the job runs on) while it trained,
    so that a lost slice's survivors load it rather than compile it (`workers.ahead`)."""

    KIND: ClassVar[EventKind] = EventKind.AHEAD
    slices: int = 1
    seconds: float = 0.0
    compiled: bool = True  # False: that program was kept already
    host: int = 0  # 0: the host that compiled it; else slice 1's first host, which took it from host 0


@dataclass(frozen=True)
class ProgramStored(Payload):
    """The train step compiled ahead for `target` off the hosts (`orchestrator.control.compile_ahead`): stored in
    the job's storage by the controller (`host` None), or looked for by host `host` at its launch (`ok`: it loads
    it; else `reason` says why not, and `kept` whether it loads the step it keeps itself instead of compiling)."""

    KIND: ClassVar[EventKind] = EventKind.PROGRAM
    target: str = ""
    ok: bool = True
    host: int | None = None
    seconds: float | None = None
    size: int | None = None  # bytes stored
    reason: str | None = None
    kept: bool = False  # not in the storage, but the host keeps the step compiled already: it loads that


@dataclass(frozen=True)
class Planned(Payload):
    """A generation's launch plan, resolved once from the placed spec when it was launched
    (`orchestrator.control.launch.launch_plan`): what every host of it was told to run."""

    KIND: ClassVar[EventKind] = EventKind.PLAN
    generation: int | None = None
    accelerator: str | None = None
    tier: str | None = None
    slices: int | None = None
    mesh: list[int] | None = None  # (data, fsdp, model) over all its slices; None: every device on data
    microbatches: int | None = None
    checkpoint_interval: int | None = None  # steps between saves; None: no checkpoints
    memory_interval: int | None = None  # steps between copies to the hosts' memory (several slices); None: measured
    memory_step: int | None = None  # the step restored from the survivors' memory; None: from storage, or fresh
    entrypoint: str | None = None  # the user's program; None: the built-in trainer

    @property
    def line(self) -> str:
        """As `orchestrator status` shows it: "gen 3 on 2 x v4-16 spot, mesh (4,2,1), 2 microbatches,
        checkpoint every 50 steps"."""
        on = f"{self.accelerator} {self.tier}" if (self.slices or 1) == 1 else \
            f"{self.slices} x {self.accelerator} {self.tier}"
        parts = [f"gen {self.generation} on {on}"]
        if self.mesh:
            parts.append(f"mesh ({','.join(map(str, self.mesh))})")
        if self.microbatches is not None:
            parts.append(f"{self.microbatches} microbatch{'' if self.microbatches == 1 else 'es'}")
        parts.append(f"checkpoint every {self.checkpoint_interval} steps" if self.checkpoint_interval
                     else "no checkpoints")
        if (self.slices or 1) > 1:
            parts.append(f"memory copy every {self.memory_interval} steps" if self.memory_interval
                         else "memory copy interval measured")
        if self.memory_step is not None:
            parts.append(f"restoring step {self.memory_step} from memory")
        return ", ".join(parts)


@dataclass(frozen=True)
class LostWork(Payload):
    KIND: ClassVar[EventKind] = EventKind.LOST_WORK
    steps: int | None = None
    seconds: float | None = None
    from_step: int | None = None
    to_step: int | None = None


@dataclass(frozen=True)
class CheckpointSaved(Payload):
    KIND: ClassVar[EventKind] = EventKind.CHECKPOINT
    step: int | None = None
    blocking_s: float | None = None


@dataclass(frozen=True)
class NoticeSeen(Payload):
    KIND: ClassVar[EventKind] = EventKind.NOTICE
    rank: int | None = None
    step: int | None = None


@dataclass(frozen=True)
class Disrupted(Payload):
    KIND: ClassVar[EventKind] = EventKind.DISRUPTION
    kind: str | None = None  # the outcome's kind (policies.decisions.recovery.OutcomeKind value)
    step: int | None = None
    reason: str | None = None
    generation: int | None = None
    teardown_s: float | None = None


@dataclass(frozen=True)
class Resumed(Payload):
    KIND: ClassVar[EventKind] = EventKind.RESUMED
    seconds: float | None = None
    step: int | None = None


@dataclass(frozen=True)
class Adopted(Payload):
    KIND: ClassVar[EventKind] = EventKind.ADOPTED


@dataclass(frozen=True)
class Autoscaled(Payload):
    """The policy's choice; all None when it would wait for spot capacity."""

    KIND: ClassVar[EventKind] = EventKind.AUTOSCALE
    accelerator: str | None = None
    tier: str | None = None
    expected_cost_usd: float | None = None
    reason: str | None = None
    checkpoint_interval_steps: int | None = None
    slices: int | None = None  # slices of `accelerator` at once (None: one)

    def to_data(self) -> dict[str, Any] | None:
        return None if self.accelerator is None else super().to_data()


@dataclass(frozen=True)
class ResizeAsked(Payload):
    KIND: ClassVar[EventKind] = EventKind.RESIZE
    _RENAMED: ClassVar[dict[str, str]] = {"from_accelerator": "from"}
    from_accelerator: str | None = None
    to: str | None = None
    tier: str | None = None
    reason: str | None = None
    step: int | None = None


@dataclass(frozen=True)
class Profiled(Payload):
    """A profile capture (`orchestrator profile`) ended: its traces are under `path`, or `error` says why not."""

    KIND: ClassVar[EventKind] = EventKind.PROFILE
    capture: str | None = None  # the capture's id, the name of its folder
    path: str | None = None  # <checkpoint dir>/profiles/<capture>, one folder host-<k> per host
    hosts: list[int] | None = None  # the hosts asked to trace
    first_step: int | None = None  # the first step traced (numbered as the job's metrics)
    steps: int | None = None  # steps traced (on every host that traced)
    steps_asked: int | None = None
    # host -> {bytes_in_use, peak_bytes_in_use, bytes_limit} over its devices
    memory: dict[str, dict[str, float]] | None = None
    error: str | None = None


@dataclass(frozen=True)
class DeadlineForecast(Payload):
    """When the job ends at the speed it has kept (saves included), against its deadline (seconds from submission)."""

    KIND: ClassVar[EventKind] = EventKind.DEADLINE
    late_by_s: float | None = None  # after the deadline by this much; 0 or less: in time
    end_s: float | None = None  # from submission
    deadline_s: float | None = None
    steps_left: int | None = None
    step_s: float | None = None  # wall seconds a step, over the last steps


@dataclass(frozen=True)
class FolderClaimed(Payload):
    """What a submit did with the job's checkpoint folder (`orchestrator.control.ownership`)."""

    KIND: ClassVar[EventKind] = EventKind.FOLDER
    directory: str | None = None
    action: str | None = None  # an `ownership.Action` value: new, resume, resume-anyway, fresh
    last_step: int | None = None  # the newest step folder there was (None: none)
    previous_job: str | None = None  # the job the folder's record named, if any
    differences: list[list[Any]] | None = None  # [field, in the record, in this job] for resume-anyway
    set_aside_to: str | None = None  # for fresh: where the old checkpoints went


@dataclass(frozen=True)
class StoreFaulted(Payload):
    """The state store could not be written for `seconds` (a full disk, a read-only or deleted file);
    the job went on, and what it did meanwhile was written when the store worked again."""

    KIND: ClassVar[EventKind] = EventKind.STORE
    cause: str | None = None  # StoreFaultError.cause
    seconds: float | None = None
    message: str | None = None


PAYLOADS: dict[EventKind, type[Payload]] = {
    cls.KIND: cls for cls in (StateChange, SliceChanged, Launched, Restored, LostWork, CheckpointSaved, NoticeSeen,
                              Disrupted, Resumed, Adopted, Autoscaled, ResizeAsked, Profiled, DeadlineForecast,
                              FolderClaimed,
                              StoreFaulted, MemoryCadence, AheadCompiled, ProgramStored, Planned)
}
assert set(PAYLOADS) == set(EventKind), "every kind has its record"
