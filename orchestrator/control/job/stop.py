"""Why the running workers are asked to stop at a committed step: one frozen request per launch.

Six kinds, each with one meaning (before this, `notice`, `notice_at`, `resize_to` and `resize_tier`
said them between four fields):

- NOTICE: the slice is going (a preemption notice, a host's own notice) or the budget is spent;
  nothing is planned after it, the recovery rules decide.
- CANCEL: the user cancelled; the hosts stop with their step committed.
- RESIZE: the user asked for another accelerator or tier (`orchestrator resize`).
- MOVE: the cost policy's move to slices that came READY beside the running ones (make-before-break).
- RELEASE: the cost policy gives back the running slices and waits for spot capacity.
- REGROW: a job short of slices goes on on the survivors plus a slice READY beside them.

The last four end the attempt RESIZED and the job goes RESIZING (never RECOVERING): `relaunches`.
"""

from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass, field

from orchestrator.domain.shape import Shape


class StopKind(str, enum.Enum):
    NOTICE = "notice"
    CANCEL = "cancel"
    RESIZE = "resize"
    MOVE = "move"
    RELEASE = "release"
    REGROW = "regrow"


RELAUNCHES = frozenset({StopKind.RESIZE, StopKind.MOVE, StopKind.RELEASE, StopKind.REGROW})


@dataclass(frozen=True)
class StopRequest:
    kind: StopKind
    reason: str  # what the hosts are told, and the events say
    target: Shape | None = None  # where the next launch goes, for the kinds that relaunch
    at: float = field(default_factory=time.monotonic)  # the grace period counts from here

    def __post_init__(self) -> None:
        if (self.kind in RELAUNCHES) != (self.target is not None):
            raise ValueError(f"StopRequest.target: a {self.kind.value} stop "
                             f"{'names' if self.kind in RELAUNCHES else 'names no'} shape, got {self.target=}")

    @property
    def relaunches(self) -> bool:
        """Whether a planned launch follows (the attempt ends RESIZED, not PREEMPTED)."""
        return self.kind in RELAUNCHES

    @classmethod
    def notice(cls, reason: str) -> StopRequest:
        return cls(StopKind.NOTICE, reason)

    @classmethod
    def cancel(cls) -> StopRequest:
        return cls(StopKind.CANCEL, "cancelled by the user")


class Stops:
    """The launch's stop request: the first one asked for stands until the next launch (`clear`).

    Asked from the driver's thread (moves, watch) and from report threads (a host's notice), so a lock
    keeps "the first one wins" true.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._current: StopRequest | None = None

    @property
    def current(self) -> StopRequest | None:
        return self._current

    def ask(self, request: StopRequest) -> bool:
        """Ask the workers to stop; False (and nothing changes) if a stop was asked already."""
        with self._lock:
            if self._current is not None:
                return False
            self._current = request
            return True

    def clear(self) -> None:
        """A new launch: no stop asked of it yet."""
        with self._lock:
            self._current = None
