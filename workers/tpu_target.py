"""A TPU slice as a compile target: XLA's TPU compiler (Mosaic included) on a machine without a TPU.

Vocabulary:

- *topology*: one slice's chips as the TPU runtime names them, ``v4:2x2x2`` for a v4-16
  (`Topology.name`); with ``slices`` several such slices joined over the data-center network.
- *target devices*: the devices JAX describes for a topology
  (``jax.experimental.topologies.get_topology_desc``): real TPU device records, with
  their kind ("TPU v4"), process and slice indices, that nothing runs on. A program
  lowered with shardings over them is compiled by libtpu's compiler for that slice.
- *report*: what the compiler says of one program (`ProgramReport`): its memory per
  chip, its FLOPs and bytes, and its cost model's step time.

What is compiled is what the hosts run: `compile_train_step` builds the built-in trainer
(`workers.train.Trainer`) from the settings the controller resolves for the slice
(`orchestrator.control.launch.launch_order`), so the jit, mesh, shardings, precision,
remat, microbatches and kernels are the hosts' own; only the devices differ. The kernels
take their generation and implementation from the mesh compiled for (`kernels.dispatch.target`),
which is why each compile runs under ``jax.set_mesh``.

Needs ``libtpu`` (the ``jax[tpu]`` pin); without it `Topology.devices` raises `TargetUnavailable`, saying why.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import jax

from kernels import hardware
from workers import api, program_counts, storage
from workers.settings import LmSettings, TrainingSettings


class TargetUnavailable(RuntimeError):
    """XLA's TPU compiler cannot be had here (libtpu is not installed, or its version does not load)."""


@dataclasses.dataclass(frozen=True)
class Topology:
    """``slices`` slices of ``chip`` chips laid out as ``topology`` (``2x2x2``) on ``hosts`` hosts each."""

    chip: str  # a `kernels.hardware` generation: "v4", "v5e", "v5p", "v6e"
    topology: str
    hosts: int
    slices: int = 1

    def __post_init__(self) -> None:
        if self.chip not in hardware.CHIPS:
            raise ValueError(f"chip {self.chip!r} is not a TPU generation; valid: {', '.join(hardware.CHIPS)}")
        if self.hosts < 1 or self.slices < 1 or self.chips % self.hosts:
            raise ValueError(f"{self.name}: {self.chips} chips do not split over {self.hosts} hosts")

    @property
    def name(self) -> str:
        return f"{self.chip}:{self.topology}"

    @property
    def chips(self) -> int:
        """Chips of one slice."""
        return functools.reduce(lambda a, b: a * b, (int(x) for x in self.topology.split("x")))

    @property
    def chips_per_host(self) -> int:
        return self.chips // self.hosts

    @property
    def label(self) -> str:
        return self.name if self.slices == 1 else f"{self.slices} x {self.name}"

    def devices(self) -> list[Any]:
        """The target devices of every slice, slice-major, then by process and id (as hosts order theirs)."""
        return list(_devices(self))


# libtpu lets one process at a time load it (a lock file in /tmp), for the chips' sake. A compile target uses
# no chip, so it neither takes that lock from a process that trains nor fails for one that holds it.
_SHARE_LIBTPU = "ALLOW_MULTIPLE_LIBTPU_LOAD"


@functools.cache
def _devices(t: Topology) -> tuple[Any, ...]:
    from jax.experimental import topologies

    os.environ.setdefault(_SHARE_LIBTPU, "1")

    chip = hardware.CHIPS[t.chip]
    # A host's chips: 2x2 on every multi-host slice; a one-host slice's are all its chips.
    per_host = {1: (1, 1, 1), 4: (2, 2, 1), 8: (2, 4, 1)}.get(t.chips_per_host)
    if per_host is None:
        raise ValueError(f"{t.name}: {t.chips_per_host} chips per host is not a TPU host's layout")
    try:
        desc = topologies.get_topology_desc(
            topology_name=t.name, platform="tpu", chip_config_name="megacore" if chip.tensorcores == 2 else "default",
            chips_per_host_bounds=per_host, num_slices=t.slices)
    except (RuntimeError, ValueError) as e:  # jaxlib raises its own error types as these
        raise TargetUnavailable(f"XLA's TPU compiler could not describe {t.label}: {_first_line(e)} "
                                "(it needs libtpu: pip install the project's 'tpu' extra)") from e
    found: list[Any] = list(desc.devices)  # jaxlib's Device stub names neither process_index nor slice_index
    devices = sorted(found, key=lambda d: (getattr(d, "slice_index", None) or 0, d.process_index, d.id))
    if len(devices) != t.chips * t.slices:
        raise TargetUnavailable(f"{t.label}: the TPU compiler described {len(devices)} devices, expected "
                                f"{t.chips * t.slices}")
    return tuple(devices)


@dataclasses.dataclass(frozen=True)
class ProgramReport:
    """What XLA's TPU compiler says of one program for one target; sizes per chip (one device each)."""

    target: str  # the topology's label
    compile_s: float
    argument_bytes: int
    output_bytes: int
    alias_bytes: int  # outputs written over donated arguments (the train step's state)
    temp_bytes: int
    code_bytes: int
    # Of one run of the program, every loop's body as often as it runs (`workers.program_counts`): its dots, and
    # the FLOPs its Pallas kernels declare; the bytes it reads and writes in HBM.
    flops_per_chip: float
    bytes_accessed_per_chip: float
    xla_flops_per_chip: float  # XLA's own cost analysis, which counts each loop's body once
    optimal_s: float | None  # the cost model's time for one run of the program (its roofline), if it gives one
    chips: int
    # The model FLOPs of one step over the whole target as the program states them (a user's program: the
    # `flops_per_step` it gives `ctx.loop`), for MFU; None: not stated.
    model_flops_per_step: float | None = None

    @property
    def hbm_bytes_per_chip(self) -> int:
        """HBM the program needs at its peak on each chip: its live arguments and outputs (donated ones
        once), its scratch, and its code."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes + self.code_bytes

    @property
    def flops(self) -> float:
        """FLOPs of one step over the whole target."""
        return self.flops_per_chip * self.chips


def report(compiled: jax.stages.Compiled, target: str, chips: int, compile_s: float) -> ProgramReport:
    m = compiled.memory_analysis()
    if m is None:
        raise TargetUnavailable(f"{target}: the TPU compiler gave no memory analysis")
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else (cost or {})
    optimal = cost.get("optimal_seconds")
    counted = program_counts.counts(compiled.as_text() or "")  # every loop's body as often as it runs
    return ProgramReport(
        target=target, compile_s=compile_s, argument_bytes=int(m.argument_size_in_bytes),
        output_bytes=int(m.output_size_in_bytes), alias_bytes=int(m.alias_size_in_bytes),
        temp_bytes=int(m.temp_size_in_bytes), code_bytes=int(m.generated_code_size_in_bytes),
        flops_per_chip=counted.flops, bytes_accessed_per_chip=counted.hbm_bytes,
        xla_flops_per_chip=float(cost.get("flops", 0.0)),
        optimal_s=float(optimal) if optimal is not None and optimal > 0 else None, chips=chips)


def compile_on(mesh: jax.sharding.Mesh, lower: Callable[[], jax.stages.Lowered]) -> tuple[jax.stages.Compiled, float]:
    """``lower().compile()`` with ``mesh`` current (the kernels read their target from it); and its seconds."""
    t0 = time.perf_counter()
    with jax.set_mesh(mesh):
        compiled = lower().compile()
    return compiled, time.perf_counter() - t0


def context(topology: Topology, settings: TrainingSettings, **given: Any) -> api.Context:
    """The training API's context a program gets on `topology`, its mesh laid over the target devices."""
    return api.Context(rank=0, num_hosts=topology.hosts * topology.slices, settings=settings,
                       devices=topology.devices(), **given)


def roofline_s(r: ProgramReport, chip: hardware.Chip) -> float:
    """The least time one step can take on `chip` by the compiler's own counts: its FLOPs at the chip's peak
    bf16 rate, or its HBM traffic at the chip's bandwidth, whichever is longer (a lower bound; not measured)."""
    return max(r.flops_per_chip / (chip.peak_bf16_tflops * 1e12), r.bytes_accessed_per_chip / (chip.hbm_gbps * 1e9))


# -- reports kept by program ---------------------------------------------------------------
#
# A report is a pure function of the settings, the target, the code that builds the program and the
# compiler: kept under a key of all four, a second look at the same job is a file read.

_PROGRAM_CODE = ("kernels", "workers", "policies/model")  # what builds the step (`workers.train`, the kernels)


@functools.cache
def _code_digest() -> str:
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for folder in _PROGRAM_CODE:
        for path in sorted((root / folder).glob("*.py")):
            h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def program_key(lm: LmSettings, settings: TrainingSettings, topology: Topology) -> str:
    """The key of the step's report: what the step is, where it is compiled for, by which code and compiler."""
    return _key(repr(lm), settings, topology)


def user_program_key(entrypoint: str, args: dict[str, Any], workdir: str | os.PathLike | None,
                     settings: TrainingSettings, topology: Topology) -> str:
    """The key of a user's program's report: its entrypoint and args, the Python files of its folder (the
    code shipped to its hosts), the settings, the target, and the code and compiler that build it."""
    h = hashlib.sha256()
    if workdir is not None:
        root = Path(workdir)
        for path in sorted(root.rglob("*.py")):
            if ".venv" not in path.parts and "__pycache__" not in path.parts:
                h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return _key(repr((entrypoint, sorted(args.items(), key=lambda kv: kv[0]), h.hexdigest())), settings, topology)


# Settings that say where and how often state is kept, not what the step computes: left out of the key, so a
# report made before the job had its checkpoint folder (the CLI's `--compile`) is found by its controller.
_NOT_THE_PROGRAM: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(TrainingSettings)
                                    if f.name in ("checkpoint_dir", "checkpoint_interval", "checkpoint_keep",
                                                  "memory_interval")}


def _key(program: str, settings: TrainingSettings, topology: Topology) -> str:
    import jaxlib

    settings = dataclasses.replace(settings, **_NOT_THE_PROGRAM)

    try:
        libtpu = metadata.version("libtpu")
    except metadata.PackageNotFoundError:
        libtpu = "none"
    parts = (program, repr(settings), repr(topology), jax.__version__, jaxlib.__version__, libtpu, _code_digest())
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]


def kept_report(cache_dir: str | os.PathLike | None, key: str) -> ProgramReport | None:
    """The report kept under `key` in `cache_dir`, or None (none kept, or unreadable: compiled again)."""
    if cache_dir is None:
        return None
    try:
        return ProgramReport(**json.loads((Path(cache_dir) / f"{key}.json").read_text()))
    except (OSError, ValueError, TypeError):
        return None


def keep_report(cache_dir: str | os.PathLike | None, key: str, found: ProgramReport) -> None:
    if cache_dir is not None:
        storage.write_text(Path(cache_dir) / f"{key}.json", json.dumps(dataclasses.asdict(found)))  # whole or not


def compile_train_step(lm: LmSettings, settings: TrainingSettings,
                       topology: Topology) -> tuple[jax.stages.Compiled, ProgramReport]:
    """The built-in trainer's step for `topology`, as its hosts would compile it, and the compiler's report.

    Raises whatever the compiler raises for a program it rejects (a kernel Mosaic cannot
    lower, a program over the chip's memory): the caller says which target and why.
    """
    from workers.train import Trainer

    ctx = context(topology, settings)
    compiled, seconds = compile_on(ctx.mesh, Trainer(lm, ctx).lower_step)
    return compiled, report(compiled, topology.label, topology.chips * topology.slices, seconds)


def compile_program(main: Callable[[api.Context], Any], settings: TrainingSettings, topology: Topology, *,
                    args: dict[str, Any] | None = None) -> tuple[jax.stages.Compiled, ProgramReport]:
    """A user's program (the `main(ctx)` a job file's entrypoint names) traced for `topology` and its step
    compiled, as its hosts would run it: `main` gets a context that only traces (`api.Context.trace_only`), and
    the step, state and batch it declares to `ctx.loop` are compiled with the target's mesh current.

    Raises:
      api.StepNotDeclared: `main` reached its loop without ``step=``, or ended without a loop.
      Whatever `main` raises while it is traced (code that needs concrete values), and whatever the
      compiler raises for a program it rejects.
    """
    ctx = context(topology, settings, args=dict(args or {}), trace_only=True)
    try:
        main(ctx)
    except api.DeclaredStep as declared:
        found = declared
    else:
        raise api.StepNotDeclared("the program ended without calling ctx.loop(state, step=...): the compiler "
                                  "cannot see its step")
    step = found.step
    jitted = step if hasattr(step, "lower") else jax.jit(step)
    compiled, seconds = compile_on(ctx.mesh, lambda: jitted.lower(found.state, found.batch))
    chips = topology.chips * topology.slices
    return compiled, dataclasses.replace(report(compiled, topology.label, chips, seconds),
                                         model_flops_per_step=found.flops_per_step)


def serialize(compiled: jax.stages.Compiled) -> bytes:
    """The executable as bytes a TPU host of the same target and JAX build could load."""
    import pickle

    from jax.experimental import serialize_executable

    return pickle.dumps(serialize_executable.serialize(compiled))


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
