"""What a host's worker tells the controller, and how its training ended: frozen records.

A worker sends one report at a time (`Controller.report(job_id, generation, rank, report,
lines)`), fire-and-forget, with the log lines collected since the last one; `result()`
answers None while it trains, then a `WorkerResult`. The controller imports these; the
workers import nothing of the controller.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Ready:
    """Every process joined the runtime."""

    init_s: float


@dataclass(frozen=True)
class Timings:
    """Worker 0 restored (or started fresh) and compiled the step."""

    restore_s: float
    compile_s: float
    restored_step: int | None
    unreadable: tuple[int, ...] = ()  # checkpoints it fell back past
    source: str = "storage"  # where the restored step came from: storage, or the hosts' memory (`workers.memory`)
    memory_miss: str | None = None  # why a restore from memory was refused (then it came from storage)


# The metrics the training API's loop adds to a step's own (`workers.api.Loop`); any other name is the program's.
LOOP_METRICS = ("mfu", "tflops_per_chip", "hbm_in_use_gib", "hbm_peak_gib", "hbm_limit_gib")


@dataclass(frozen=True)
class StepDone:
    step: int
    loss: float
    tokens_per_s: float | None = None
    step_time_s: float | None = None
    # The program's own metrics, and the loop's: tflops_per_chip, mfu, hbm_in_use_gib, hbm_peak_gib.
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Saved:
    """Worker 0 committed a checkpoint of `step`; the save blocked training for `blocking_s`."""

    step: int
    blocking_s: float | None = None


def saved_entry(report: Saved) -> dict:
    """What a worker's step history (`HostWorker.history`) keeps of a checkpoint committed after that step: a
    controller that restarted meanwhile records it from there (`ReportSink.record_missed`)."""
    return {"saved": report.step, "save_blocking_s": report.blocking_s, "saved_at": time.time()}


@dataclass(frozen=True)
class MemoryKept:
    """How often the hosts copy the state to their memory (`workers.memory`), from what a copy costs."""

    every: int  # steps between copies: a lost slice loses at most every - 1 steps
    copy_s: float
    step_s: float


@dataclass(frozen=True)
class CompiledAhead:
    """Host 0 compiled the step for the runtime one slice smaller, for a lost slice's survivors (`workers.ahead`);
    or, sent by slice 1's first host, that host now keeps it too (taken from host 0)."""

    slices: int
    seconds: float
    compiled: bool  # False: that program was kept already (or, from slice 1's host, it was taken, not compiled)


@dataclass(frozen=True)
class ProgramLooked:
    """What this host found in the job's storage for its train step (`workers.stored_programs`): the executable
    compiled ahead for its shape, which it loads (`used`), or why not. `kept`: it keeps the step compiled
    already in its own cache (compiled ahead on the hosts, or by an earlier generation on this host), which it
    loads instead of compiling."""

    target: str
    used: bool
    reason: str
    kept: bool = False


@dataclass(frozen=True)
class Noticed:
    """This host got a preemption notice (or a stop from the controller)."""

    reason: str


@dataclass(frozen=True)
class Lines:
    """Nothing but the log lines that travel with every report."""


@dataclass(frozen=True)
class ProfileDone:
    """A host finished its part of a profile capture (`workers.profiling`): its trace is in `path`.

    Sent by each host that traced, whatever the generation: the controller matches it by
    `capture_id`. `error` says why there is no trace (then `path` may be None).
    """

    capture_id: str
    path: str | None  # the host's folder: <checkpoint dir>/profiles/<capture id>/host-<rank>
    first_step: int | None = None  # the first step traced (numbered as `StepDone.step`)
    steps: int = 0  # steps traced: the number asked for, or fewer if training stopped first
    memory: tuple[dict, ...] = ()  # per local device at the capture's end (`workers.profiling.memory_stats`)
    error: str | None = None


Report = (Ready | Timings | StepDone | Saved | MemoryKept | CompiledAhead | ProgramLooked | Noticed | Lines
          | ProfileDone)


class Ending(str, enum.Enum):
    SUCCEEDED = "succeeded"
    STOPPED = "stopped"  # after a notice or a stop, at an agreed step with its checkpoint committed
    FAILED = "failed"


@dataclass(frozen=True)
class WorkerResult:
    ending: Ending
    rank: int
    steps: int | None = None  # steps complete
    notice: str | None = None  # why it stopped
    error: str | None = None  # "Type: message" of what the job's code raised
    traceback: str | None = None
    cause: str | None = None  # for FAILED: a `policies.decisions.recovery.FailureCause` (error, exit, import, storage)
    exit_code: int | None = None  # for the cause "exit": the status sys.exit() was given
    param_sums: dict[str, float] | None = None  # sum of each final parameter (built-in trainer)
