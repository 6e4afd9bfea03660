"""What a job's driver knows of its current attempt: its slices, one generation of workers (its group).

In memory only (the store has the rest); a driver keeps one `Attempt` for the job's whole
life and resets the per-launch fields at each launch.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from orchestrator.control.memory import drop_keepers
from orchestrator.providers.base import Slice, SliceProvider

if TYPE_CHECKING:
    from orchestrator.control.group import WorkerGroup
    from orchestrator.control.waiting import Waiting


@dataclass
class Attempt:
    generation: int = 0
    provider: SliceProvider | None = None  # of the current slice
    slice: Slice | None = None  # the first (or only) slice
    others: list[Slice] = field(default_factory=list)  # a multi-slice job's other slices, in slice order
    group: WorkerGroup | None = None  # the workers of `generation` on `slice`, once launched
    started: bool = False  # every host joined the runtime
    accepting: bool = False  # whether reports of `generation` still count (not once its attempt ended)
    adopted: bool = False  # a group started by an earlier controller
    last_progress: float = field(default_factory=time.monotonic)
    last_step: int = -1  # newest step reported by worker 0 in this generation
    restored_step: int | None = None  # the steps complete that this generation restored (None: fresh, or not yet)
    cancel: threading.Event = field(default_factory=threading.Event)
    notice: str | None = None  # a preemption notice (or a stop the controller asked for), and when
    notice_at: float | None = None
    disrupted_at: float | None = None  # wall time of the last disruption, for "resumed after"
    disrupted_step: int | None = None  # steps complete when it happened
    resumed: bool = True
    resize_to: str | None = None  # accelerator to move to once the current step is checkpointed
    resize_tier: str | None = None
    next_decision: float = 0.0  # monotonic time of the next autoscaling decision
    # Make-before-break: a request waiting beside the running slice, and once READY the slice
    # the next launch goes to (the running one is released only after the switch).
    waiting: Waiting | None = None
    next_slice: Slice | None = None
    next_others: list[Slice] = field(default_factory=list)
    lost: set[str] = field(default_factory=set)  # slices of this attempt that went (a host gone, a reclaim)
    memory_step: int | None = None  # the next launch restores this step from the survivors' memory
    shrunk_from: str | None = None  # the next launch goes on the survivors of this many slices
    regrow_at: float = 0.0  # monotonic time a job short of slices may ask for one again
    next_ready_at: float | None = None  # wall time the next slice became READY
    next_provision_s: float = 0.0  # from its request to READY
    requests: int = 0  # slice requests made by this driver, for unique names

    @property
    def chosen_provider(self) -> SliceProvider:
        """`provider`, where the code runs only after it was chosen (every request and slice comes from it)."""
        if self.provider is None:
            raise RuntimeError("no provider chosen yet: this attempt has requested no slice")
        return self.provider

    @property
    def held_slice(self) -> Slice:
        """`slice`, where the code runs only while the attempt holds one (launched, running, stopping)."""
        if self.slice is None:
            raise RuntimeError("this attempt holds no slice")
        return self.slice

    @property
    def slices(self) -> list[Slice]:
        """Every slice the attempt holds, in slice order (slice-major process ids)."""
        return [self.slice, *self.others] if self.slice is not None else []

    def slice_of(self, rank: int) -> str | None:
        """The name of the slice whose host `rank` is (ranks are slice-major)."""
        for s in self.slices:
            if rank < s.tpu_type.hosts:
                return s.name
            rank -= s.tpu_type.hosts
        return None

    @property
    def held_group(self) -> WorkerGroup:
        """`group`, where the code runs only while the attempt's workers are launched."""
        if self.group is None:
            raise RuntimeError("this attempt has launched no workers")
        return self.group

    def begin(self, generation: int) -> None:
        """A new launch: reports of `generation` count from now on."""
        self.generation, self.started, self.last_step, self.notice, self.accepting = generation, False, -1, None, True
        self.restored_step = None
        self.lost = set()

    def teardown(self) -> None:
        """End the workers and release the slices (each idempotent) but those the next launch goes on
        (the survivors of a lost slice); reports of this generation no longer count."""
        self.accepting = False  # a dying group's last words must not land after its disruption
        if self.group is not None:
            self.group.stop()
            self.group = None
        kept = {s.name for s in [self.next_slice, *self.next_others] if s is not None}
        for s in self.slices:
            if s.name not in kept:
                drop_keepers(s)  # the copies in its hosts' memory go with it
                self.chosen_provider.release(s.name)
        self.slice, self.others = None, []

    def stop_requested(self, reason: str) -> None:
        if self.notice is None:
            self.notice, self.notice_at = reason, time.monotonic()


def worker_name(slice_name: str, generation: int, rank: int) -> str:
    return f"{slice_name}-g{generation}-w{rank}"


def pg_name(slice_name: str, generation: int) -> str:
    return f"{slice_name}-g{generation}"
