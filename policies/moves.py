"""What a decision means for the job's slices, make-before-break.

The policy names the slice the job should run on (`Decision.option`, None: hold no
slice and wait for spot). The job may hold a running slice and one request waiting
beside it; `next_move` turns the choice into what the controller (or the simulator)
does with them:

- KEEP: stay as is; a request still waiting for the choice goes on waiting.
- REQUEST: nothing runs; request the target and start on it when it is READY.
- REQUEST_BESIDE: request the target beside the running slice, which trains on while the
  request waits; switch when it is READY. A waiting request costs nothing, so a move
  never idles the job while capacity is looked for.
- SWITCH: the waiting request is READY and still wanted: stop the workers at a committed
  checkpoint, release the old slice, restore resharded on the new one.
- RELEASE: the policy would rather hold nothing than pay for the running slice (it waits
  for spot): stop at a committed checkpoint and release it. Nothing is lost.

`release_waiting` says the waiting request is no longer wanted: release it (a request
never filled was never billed). A request with nothing running beside it waits at most
`wait_limit_s` (the queue timeout); then it is released and counts as a refusal of its
size, a capacity fact for the policy, never a failure. Beside a running slice it waits
until the policy stops choosing it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from policies.slice_options import Option

QUEUE_TIMEOUT_S = 300.0  # how long a request waits for capacity while nothing runs (policy seconds)


class MoveKind(str, enum.Enum):
    KEEP = "keep"
    REQUEST = "request"
    REQUEST_BESIDE = "request_beside"
    SWITCH = "switch"
    RELEASE = "release"


@dataclass(frozen=True)
class Move:
    kind: MoveKind
    target: Option | None  # the slice the job should end up on (None: none, waiting for spot)
    release_waiting: bool = False  # release the request waiting beside (never filled: never billed)
    wait_limit_s: float | None = None  # release the (new or kept) request unless READY within this; None: no limit

    def __str__(self) -> str:
        what = self.kind.value.replace("_", " ")
        if self.target is not None:
            what += f" {self.target.label}"
        return what + (" (release the waiting request)" if self.release_waiting else "")


def next_move(target: Option | None, *, held: Option | None, waiting: Option | None = None,
              waiting_ready: bool = False, queue_timeout_s: float = QUEUE_TIMEOUT_S) -> Move:
    """The move that takes a job holding `held` (running) and `waiting` (requested, READY if
    `waiting_ready`) to the policy's choice `target`."""
    keep_request = waiting is not None and target == waiting and target != held
    release_waiting = waiting is not None and not keep_request
    limit = None if held is not None else queue_timeout_s
    if target is None:
        kind = MoveKind.RELEASE if held is not None else MoveKind.KEEP
    elif target == held:
        kind = MoveKind.KEEP
    elif keep_request:
        kind = MoveKind.SWITCH if waiting_ready else MoveKind.KEEP
    else:
        kind = MoveKind.REQUEST if held is None else MoveKind.REQUEST_BESIDE
    wants_request = kind in (MoveKind.REQUEST, MoveKind.REQUEST_BESIDE) or (keep_request and not waiting_ready)
    return Move(kind, target, release_waiting, limit if wants_request else None)
