"""What a user entrypoint (`workload.entrypoint: module:function`) receives on each host."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass(frozen=True)
class WorkerContext:
    rank: int  # this host's worker id (0 is the coordinator)
    num_hosts: int
    args: dict[str, Any] = field(default_factory=dict)
    checkpoint_dir: str | None = None
    stop_requested: Callable[[], bool] = lambda: False  # True once a preemption notice arrived
    may_write: Callable[[], bool] = lambda: True  # False once a newer generation of the job was launched
    report: Callable[..., None] = lambda step, loss, tokens_per_s=None: None  # progress for `status`
