"""The step loop's order of reports around the save that follows a restore from the hosts' memory."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from workers.protocol import Saved, StepDone
from workers.settings import TrainingSettings
from workers.step_loop import Loop


class _Checkpoints:
    """Records each save in the reports' order (the real one is `workers.checkpoints.Checkpoints`)."""

    def __init__(self, sent: list):
        self.sent = sent

    def save(self, step: int, state: Any, meta: dict) -> bool:
        self.sent.append(("save", step))
        return True

    def close(self) -> None:
        pass


@dataclass
class _Context:
    restored_from: str
    settings: TrainingSettings = field(default_factory=lambda: TrainingSettings(steps=10, checkpoint_interval=5))
    profiler: Any = None
    keeping: Any = None
    agreed_stop: Any = None
    sent: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.checkpoints = _Checkpoints(self.sent)

    def stop_requested(self) -> bool:
        return False

    def send(self, report) -> None:
        if isinstance(report, StepDone):
            self.sent.append(("step", report.step))
        elif isinstance(report, Saved):
            self.sent.append(("saved", report.step))

    def data_meta(self) -> dict:
        return {}

    def close_checkpoints(self) -> None:
        pass


def run(restored_from: str, start: int) -> list:
    """The loop from `start` to the settings' 10 steps (a save every 5), what it reported and saved, in order."""
    ctx = _Context(restored_from)
    loop = Loop(ctx, {}, start, flops_per_step=None, tokens_per_step=None)
    for _ in loop:
        loop.done({}, loss=1.0)
    return ctx.sent


def test_after_a_restore_from_memory_the_first_step_is_reported_before_the_save_that_follows_it():
    assert run("memory", 7) == [("step", 7), ("save", 8), ("saved", 8), ("step", 8), ("save", 10), ("saved", 10),
                                ("step", 9)]


def test_after_a_restore_from_storage_each_step_is_reported_a_step_later_and_saved_at_the_interval():
    assert run("storage", 7) == [("step", 7), ("step", 8), ("save", 10), ("saved", 10), ("step", 9)]
