"""The one builder of the cost policy's `Snapshot`, shared by the product's autoscaler and
the trace simulator, so that what the policy does in a replay is what it does for a user.

Both hand in the same kinds of facts: where the job stands (`Progress`), what it may
run on and what a restart costs, and its slice records (`policies.cost.slice_history`): the
autoscaler's from the store's slice events, the simulator's from the records it emits
as its slices move through the same lifecycle. Records of earlier jobs in the zone
(`policies.cost.capacity_memory.pooled`) come first, so a new job starts from what they
learned. Only the simulator's capacity-feed mode replaces what the records say of
spot with the zone's true capacity (`CapacityFeed`), the upper bound of what knowing
more could give.

Rules both paths follow through this function:

- spot the job may ask for now: `largest_spot_chips` (what the provider allows) less the
  sizes refused or reclaimed within `REFUSAL_HOLDS_S` (longer for a size refused again and
  again: `spot_estimates.spot_chips_known`), more any slice up since;
- a request READY beside the running slice costs only its startup to move to (`ready`);
  one not READY yet is the job's request (`waiting`), which the policy keeps while its
  plan still wants it;
- a request still waiting says its size is missing now (the policy keeps it requested
  while its plan waits for it: `Decision.wait_for`, `policies.cost.moves.next_move`);
- the hazard counts spot preemptions only; an on-demand host loss is none;
- `restart.checkpoint_interval_s` is the job's own (longest) interval; the interval a
  running slice saves at was chosen when it started and is not changed while it runs;
- options of more than `max_slices` slices at once are left out (the controller passes the
  job's `autoscaling.max_slices`; the simulator the most its job's options hold).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from policies.cost.capacity_memory import chips_known, learn
from policies.cost.clock import DECISION_INTERVAL_S
from policies.cost.restart_cost import RestartCost
from policies.cost.slice_history import SliceRecord
from policies.cost.slice_options import Option
from policies.cost.snapshot import Snapshot
from policies.cost.spot_estimates import SpotAvailability, SpotHazard


@dataclass(frozen=True)
class Progress:
    """Where the job stands; times in policy seconds from the job's start."""

    deadline_s: float
    total_tokens: float
    tokens_done: float  # including steps after the last checkpoint
    tokens_committed: float
    spent_usd: float = 0.0
    budget_usd: float | None = None


@dataclass(frozen=True)
class CapacityFeed:
    """The zone's spot capacity as a feed shows it (the simulator's knowledge "trace" only)."""

    spot_chips: int
    availability: SpotAvailability


def build_snapshot(*, now_s: float, progress: Progress, options: tuple[Option, ...], restart: RestartCost,
                   records: Sequence[SliceRecord] = (), pooled_records: Sequence[SliceRecord] = (),
                   current: Option | None = None, current_ready_in_s: float = 0.0, ready: Option | None = None,
                   waiting: Option | None = None,
                   largest_spot_chips: int | None = None, feed: CapacityFeed | None = None,
                   hazard: SpotHazard = SpotHazard(), availability: SpotAvailability = SpotAvailability(),
                   decision_interval_s: float = DECISION_INTERVAL_S, max_slices: int = 1) -> Snapshot:
    """What the policy knows now (see the module docstring for the rules)."""
    options = tuple(o for o in options if o.count <= max_slices)
    spot = [o for o in options if o.preemptible]
    sizes = sorted({o.chips for o in spot})
    zone = spot[0].zone if spot else "default"
    history, learned, hazard = learn([*pooled_records, *records], now_s=now_s, sizes=sizes,
                                     availability=availability, hazard=hazard)
    if feed is not None:
        chips, learned = feed.spot_chips, feed.availability
    else:
        largest = max(sizes, default=0) if largest_spot_chips is None else largest_spot_chips
        chips = chips_known(history, zone=zone, sizes=sizes, largest=largest, now_s=now_s)
    return Snapshot(now_s, progress.deadline_s, progress.total_tokens, progress.tokens_done,
                    progress.tokens_committed, options, chips, current, current_ready_in_s, hazard, learned,
                    restart, progress.spent_usd, progress.budget_usd, decision_interval_s, ready, waiting)
