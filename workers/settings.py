"""A job's training settings as its hosts get them, resolved once per launch (`orchestrator.control.launch`).

`TrainingSettings` is what every program on the training API is told: the built-in trainer
and users' own programs alike read it as `workers.api.Context.settings` (and, for programs
written before it, as `ctx.steps`, `ctx.seq_len`, ...). `LmSettings` is what only the built-in
trainer (`workers.train`) adds: its model, optimizer schedule and kernels. Each setting is
declared here once, with its one default; both records travel to the hosts as they are
(Ray pickles them). Nothing here imports JAX: the job spec takes its defaults from here.
"""

from __future__ import annotations

from dataclasses import dataclass

from policies.model.shape import ModelShape


@dataclass(frozen=True)
class TrainingSettings:
    """The settings common to every program on the training API, on the slice it runs on."""

    steps: int | None = None  # the step loop's length; None: the program runs its own loop
    seq_len: int | None = None  # tokens per row of a batch
    global_batch_size: int | None = None  # rows a step, over all hosts
    seed: int = 0  # batch s is a pure function of (seed, s)
    mesh_shape: tuple[int, int, int] | None = None  # (data, fsdp, model); None: every device on `data`
    slices: int = 1  # slices the runtime spans, slice-major in process order; `data` is split across them first
    memory_step: int | None = None  # restore this step from the hosts' memory (`workers.memory`), not storage
    memory_interval: int | None = None  # steps between those copies; None: chosen from their measured cost
    data: str | None = None  # token files (`workers.tokens`); None: the standard library's bytes
    checkpoint_dir: str | None = None  # None: no checkpoints
    checkpoint_interval: int = 20  # in steps; on spot, the cost policy's, never longer than the job file's
    checkpoint_keep: int = 3
    precision: str = "float32"  # the compute dtype: float32, bfloat16, or auto (bfloat16 on TPU and GPU)
    remat: str = "none"  # `workers.model.Numerics.remat`
    microbatches: int = 1  # gradient accumulation: the global batch in this many parts, one update
    kernel_blocks: dict | None = None  # `kernels.blocks.KernelBlocks.from_mapping`; None: the chip's defaults
    peak_flops_per_chip: float | None = None  # the slice type's bf16 peak, for MFU; None: no MFU

    @property
    def tokens_per_step(self) -> int | None:
        if self.seq_len is None or self.global_batch_size is None:
            return None
        return self.seq_len * self.global_batch_size


@dataclass(frozen=True)
class LmSettings:
    """What the built-in trainer adds to `TrainingSettings`: the model and how it is optimized."""

    model: ModelShape
    lr_peak: float
    lr_end: float
    warmup_steps: int
    weight_decay: float
    implementation: str | None = None  # the kernels: pallas or xla; None: chosen from the backend
