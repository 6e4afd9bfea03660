"""What every host of a launch is told to run: one frozen `LaunchOrder`, resolved by the controller.

The controller resolves it once per generation from the job's placed spec
(`orchestrator.control.launch.launch_plan`) and hands the same order to every host's
`workers.host.HostWorker.start`; the plain-process runs (`workers.reference`, the chaos tests'
hosts) read it pickled from a file. It travels as it is, pickled by Ray over its authenticated
channel: a TPU VM imports this package from the code shipped with the launch
(`orchestrator.control.shipping`), so it reads the same classes.

An order names its program as one of two records, and a host runs it by its type:

- `BuiltInTrainer`: the project's trainer (`workers.train.Trainer`) with its model and schedule;
- `UserEntrypoint`: a user's function on the training API, imported from the job's folder.

Nothing here imports JAX or the controller.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from workers.settings import LmSettings, TrainingSettings


@dataclass(frozen=True)
class BuiltInTrainer:
    """The project's trainer, with what it adds to the training settings."""

    lm: LmSettings
    # The settings of the runtime a lost slice leaves, whose program is compiled while the job trains
    # (`workers.ahead`); None: one slice, or a global batch that does not split over one fewer.
    ahead: TrainingSettings | None = None


@dataclass(frozen=True)
class UserEntrypoint:
    """A user's program on the training API: ``module:function``, called with the host's context."""

    entrypoint: str  # "module:function"
    args: dict[str, Any] = field(default_factory=dict)  # the job file's `workload.args`, as `ctx.args`
    # Where the module is imported from: the job's folder on the controller's machine; None where the launch
    # ships a copy of it (Ray's working directory, the host's current folder).
    workdir: str | None = None

    def __post_init__(self) -> None:
        module, _, function = self.entrypoint.partition(":")
        if not module or not function:
            raise ValueError(f"UserEntrypoint.entrypoint must be 'module:function', got {self.entrypoint=}")

    @property
    def module(self) -> str:
        return self.entrypoint.partition(":")[0]

    @property
    def function(self) -> str:
        return self.entrypoint.partition(":")[2]


Program = BuiltInTrainer | UserEntrypoint


@dataclass(frozen=True)
class StoredPrograms:
    """Where a launch's hosts look for their train step compiled ahead (`workers.stored_programs.take`)."""

    directory: str  # the job's checkpoint folder (the programs are under its ``programs/``)
    key: bytes = field(repr=False)  # the job's key, that seals what the controller stored; never logged
    targets: dict[str, str] = field(default_factory=dict)  # platform ("tpu", "cpu") -> the target a host selects by


@dataclass(frozen=True)
class LaunchOrder:
    """What every host of one generation runs, and the services it reaches while it does."""

    settings: TrainingSettings  # `workers.api.Context.settings`: the mesh, batch, intervals, ... on this slice
    program: Program
    fence_dir: str | None = None  # where the fence is (the checkpoint folder); None: no checkpoints, no fence
    storage_endpoint: str | None = None  # the object store's endpoint, for the hosts' buckets; None: the default
    metadata_url: str | None = None  # where hosts long-poll for preemption notices; None: none
    programs: StoredPrograms | None = None  # the train step compiled ahead; None: the hosts compile it
