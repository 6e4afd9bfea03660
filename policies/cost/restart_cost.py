"""What a restart costs a job, and how often it checkpoints.

A restart (a new slice) costs `provisioning_s` (not billed) and `startup_s` (billed, no
progress: JAX init, restore, XLA compile); a preemption also loses the work since the
last checkpoint. Each checkpoint costs `save_s` of training time, so the interval is a
trade between the two: Young and Daly's optimum for the slice's preemption rate
(`RestartCost.interval_s`), every few minutes where spot lasts minutes and the job's
own interval where nothing preempts it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Restart figures used until the orchestrator feeds measured ones (DESIGN.md: 60-180 s
# to provision a slice; init + orbax restore + XLA compile of a ~1B model, a few minutes).
DEFAULT_PROVISIONING_S = 120.0
DEFAULT_STARTUP_S = 240.0
DEFAULT_CHECKPOINT_INTERVAL_S = 600.0  # the longest interval: what the job checkpoints at without preemptions
# Training time one checkpoint costs: the blocking part of an async orbax save (the
# state copied to host memory) plus the slowdown while it is written. An assumption
# for a ~1B model (12 GB of parameters and Adam moments over 2-8 hosts) until a job
# measures its own; the local cluster measures a fraction of a second for its small model.
DEFAULT_SAVE_S = 5.0
# A job on several slices that loses one (not the last), or adds one back, is relaunched: the
# controller stops every host (at a committed step when it chooses the change), starts the
# workers on the new set of slices and restores, the survivors of a loss from their hosts'
# memory (nothing lost), a grow from the step it stopped at (orchestrator/control/slices.py:
# `_keep_survivors`, `_regrow`). Its workers start as at any launch (JAX init, restore,
# compile), so the pause is `startup_s` unless given: the replay benchmarks measured 35-91 s of
# startup for one launch on the local cluster (benchmarks/results/autoscale_replay_slices.json,
# `restart_s`) against the 240 s assumed for a ~1B model on a TPU slice, and nothing shorter
# for a relaunch on survivors. (Issue 38: a grow once cost no time here, a shrink 30 s.)
MIN_CHECKPOINT_INTERVAL_S = 60.0


@dataclass(frozen=True)
class RestartCost:
    """What one restart costs; measured figures replace the defaults once known."""

    provisioning_s: float = DEFAULT_PROVISIONING_S  # request to slice ready; not billed
    startup_s: float = DEFAULT_STARTUP_S  # JAX init, restore, compile; billed, no progress
    checkpoint_interval_s: float = DEFAULT_CHECKPOINT_INTERVAL_S  # the longest; shorter on spot (below)
    save_s: float = DEFAULT_SAVE_S  # training time one checkpoint costs
    # Relaunch of a multi-slice job losing a slice or adding one (billed, no progress); None: startup_s.
    reshape_s: float = None  # type: ignore[assignment]  # (set to a float by __post_init__)
    # Whether a preemption notice (GCE gives about 30 s) leaves time to commit a checkpoint,
    # so that a preemption loses no work. Off by default: whether a big state commits that
    # fast from every host of a slice is not known here.
    saves_on_notice: bool = False

    def __post_init__(self) -> None:
        if self.reshape_s is None:
            object.__setattr__(self, "reshape_s", self.startup_s)
        for name in ("provisioning_s", "startup_s", "checkpoint_interval_s", "save_s", "reshape_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"RestartCost.{name} must be a number of seconds >= 0, not {getattr(self, name)!r}")

    @property
    def overhead_s(self) -> float:
        return self.provisioning_s + self.startup_s

    def interval_s(self, hazard_per_hour: float) -> float:
        """How often to checkpoint a slice preempted `hazard_per_hour` times an hour.

        Young and Daly's first-order optimum sqrt(2 x save cost x mean time between
        preemptions) balances the time spent saving (save_s / interval) against the work
        lost at a preemption (half an interval on average), kept between
        `MIN_CHECKPOINT_INTERVAL_S` and the job's own interval.
        """
        if hazard_per_hour <= 0 or self.saves_on_notice:
            return self.checkpoint_interval_s
        best = math.sqrt(2 * self.save_s * 3600 / hazard_per_hour)
        return min(max(best, MIN_CHECKPOINT_INTERVAL_S), self.checkpoint_interval_s)

    def train_s(self, tokens: float, tokens_per_s: float, hazard_per_hour: float = 0.0) -> float:
        """Time to train `tokens` without a preemption: the training plus the saves on the way."""
        run_s = tokens / tokens_per_s
        saves = max(math.ceil(run_s / self.interval_s(hazard_per_hour) - 1e-9) - 1, 0)  # none at the end
        return run_s + self.save_s * saves

    def lost_fraction(self, hazard_per_hour: float) -> float:
        """Share of a slice's time lost to restarts, lost work and saves at that hazard."""
        interval, per_s = self.interval_s(hazard_per_hour), hazard_per_hour / 3600
        return per_s * (self.overhead_s + self.lost_per_preemption_s(interval)) + self.save_s / interval

    def shrink_loss_s(self, count: int) -> float:
        """Training time of the whole group the loss of one of `count` slices costs (the job goes
        on without it): the relaunch on the survivors (their share of the speed paused), a slice's
        share missing while one is added back (make-before-break: its provisioning), and the
        relaunch of the whole group when it joins."""
        return self.reshape_s * (count - 1) / count + self.provisioning_s / count + self.reshape_s

    def lost_per_preemption_s(self, interval_s: float) -> float:
        """Work a preemption loses on average: half an interval, or none if the notice is used."""
        return 0.0 if self.saves_on_notice else interval_s / 2
