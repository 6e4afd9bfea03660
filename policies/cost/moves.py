"""What a decision means for the job's slices, make-before-break.

The policy names the slice the job should run on now (`Decision.option`; None: hold no
slice) and, when its plan waits for a spot size the zone cannot give now, that size
(`Decision.wait_for`). The job holds at most a running slice and one request beside it;
`next_move` turns the decision into what the controller (or the simulator) does:

- `request`: ask for this slice. A move to another slice is requested beside the running
  one, which trains on while the request waits; a spot size the plan waits for is kept
  requested too (a probe: a queued request costs nothing until it is filled, it catches
  capacity the moment it returns, and how long it waits is what the job learns of the
  zone's outages). Nothing times out: a request waits until the policy stops wanting it.
- A spot request still waiting is kept, not traded for another spot request that the
  zone could fill no sooner (`fills_no_later`): zone capacity is nested (a size that can
  be had means every smaller one can), so a request for at least as many chips would
  wait at least as long, and giving up a queued request to ask again only loses its
  place. A request for several slices of one type, while the job holds no slice, takes
  the slices that fit when some do (the policy adds the rest later), so it is filled as
  soon as one slice of it can be; a request adding slices to those the job holds takes
  those that fit beside them, and stays queued while the job trains, even when the
  policy's plan stops counting on it for a while (it costs nothing until filled).
- `switch`: the waiting request is READY and is what the policy chooses, or fewer slices of
  the type, tier and zone it chooses (the job starts on those, beside or instead of the
  running slice, and asks for the rest as slices to add: giving up the READY slices to ask
  for all of them at once would only queue again): stop the workers at a committed
  checkpoint, release the old slice, restore resharded on the new one.
- `release_waiting`: the waiting request is no longer wanted: release it (never filled:
  never billed). A request let go unfilled is a refusal of its size: a capacity fact the
  policy learns from, never a failure.
- `release_held`: the policy would rather hold nothing than pay for the running slice (it
  waits for spot): stop at a committed checkpoint and release it. Nothing is lost.

The controller asks again when a request turns READY, so a switch is always the policy's
choice at that moment, not a stale one.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from policies.cost.slice_options import Option

QUEUE_TIMEOUT_S = 300.0  # release-first replays only: how long a request waits for capacity (policy seconds)


class MoveKind(str, enum.Enum):
    """The move's main part, for records and logs."""

    KEEP = "keep"
    REQUEST = "request"
    REQUEST_BESIDE = "request beside"
    SWITCH = "switch"
    RELEASE = "release"


@dataclass(frozen=True)
class Move:
    target: Option | None  # the slice the job should run on (None: none, waiting for spot)
    switch: bool = False  # the waiting request is READY and is the target: move onto it now
    release_held: bool = False  # stop at a checkpoint and release the running slice
    release_waiting: bool = False  # release the waiting request
    request: Option | None = None  # request this, beside the running slice if one is kept

    @property
    def kind(self) -> MoveKind:
        if self.switch:
            return MoveKind.SWITCH
        if self.release_held:
            return MoveKind.RELEASE
        if self.request is not None:
            return MoveKind.REQUEST_BESIDE if self.beside else MoveKind.REQUEST
        return MoveKind.KEEP

    beside: bool = False  # `request` is made while a running slice trains on

    def __str__(self) -> str:
        what = self.kind.value
        if self.target is not None and self.kind in (MoveKind.SWITCH, MoveKind.KEEP):  # a switch has its target
            what += f" {self.target.label}"
        if self.request is not None:
            what += f"{'' if self.kind in (MoveKind.REQUEST, MoveKind.REQUEST_BESIDE) else '; request'} " \
                    f"{self.request.label}"
        return what + ("; release the waiting request" if self.release_waiting else "")


def next_move(target: Option | None, *, held: Option | None, waiting: Option | None = None,
              waiting_ready: bool = False, wait_for: Option | None = None) -> Move:
    """The move that takes a job running `held` with `waiting` requested beside it (READY if
    `waiting_ready`) to the policy's choice: run `target`, and keep `wait_for` requested."""
    if waiting_ready and waiting is not None and target != held and (
            target == waiting or (target is not None and grows(target, held=waiting))):
        return Move(waiting, switch=True)  # (fewer slices than wanted: start on them, the rest are added later)
    if target is not None and target != held:
        want = target  # a move: requested beside the running slice
    elif wait_for is not None and wait_for != held:
        want = wait_for  # the spot size the plan waits for
    else:
        want = None
    if waiting is not None and not waiting_ready:
        if want is not None and fills_no_later(waiting, want, held=held):
            want = waiting  # kept: asking for `want` instead would not catch capacity sooner
        elif want is None and target == held and grows(waiting, held=held):
            want = waiting  # slices to add to the running ones: kept queued while they train (free until filled)
    release_held = target is None and held is not None
    return Move(target, False, release_held, waiting is not None and waiting != want,
                want if want != waiting else None, beside=held is not None and not release_held)


def takes_part(request: Option, *, held: Option | None) -> bool:
    """Whether a request for several slices takes the slices that fit when not all do: while
    the job holds no slice (it starts on those, and the policy adds the rest later), or when
    it adds slices to those the job holds (`grows`). Beside a slice of another type or tier
    it waits for all of them: the policy chose to move for all of them, not for a part."""
    return request.count > 1 and request.preemptible and (held is None or grows(request, held=held))


def grows(request: Option, *, held: Option | None) -> bool:
    """Whether `request` is more slices of the type, tier and zone the job holds."""
    return held is not None and request.count > held.count and \
        (held.name, held.tier, held.zone) == (request.name, request.tier, request.zone)


def fills_no_later(waiting: Option, want: Option, *, held: Option | None) -> bool:
    """Whether the spot request `waiting` is filled no later than a spot request for `want`
    would be, capacity being nested: `want` needs at least the chips `waiting` needs to be
    filled (one slice of it, if it takes part of its slices)."""
    if not (waiting.preemptible and want.preemptible) or waiting.zone != want.zone:
        return False
    needs = waiting.slice_chips if takes_part(waiting, held=held) else waiting.chips
    return want.chips >= needs
