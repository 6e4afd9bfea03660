"""What a job trains (`workload:` in a job file): the built-in trainer or a user's program, and their settings.

The pydantic models of the job spec's workload section, with the bounds shared by the whole
spec (`orchestrator.domain.spec` builds the job on them). Every model is frozen and rejects
unknown keys; numbers are bounded by what the code can run.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Union, get_args

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

from orchestrator.domain.locations import check_data_path
from policies.model.memory_fit import REMAT_CHOICES
from policies.model.shape import ModelShape

# Both are matched whole (`fullmatch`): with `match`, `$` also accepts a trailing newline.
NAME_RE = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,38}[a-z0-9])?")
NAME_RULE = "1 to 40 lowercase letters, digits and dashes, starting and ending with a letter or digit"
ENTRYPOINT_RE = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")

MAX_STEPS = 10**9  # the step counter is an int32 on the device (2**31 - 1); 10**9 is years of training
MAX_TOKENS_PER_STEP = 2**31  # a step's batch is indexed with int32: global_batch_size * (seq_len + 1) below this
MAX_COUNT = 10**6  # retry budgets: a million is "never give up" without overflowing anything
MAX_TIMEOUT_S = 30 * 24 * 3600.0  # 30 days: far longer than any wait worth making


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


Steps = Annotated[int, Field(gt=0, le=MAX_STEPS)]
Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]
Timeout = Annotated[float, Field(gt=0, le=MAX_TIMEOUT_S)]
# Model sizes: several times the largest published models', small enough that every shape
# product stays far inside int64. Layers, heads, experts: the largest models use 128 to 256.
Few = Annotated[int, Field(gt=0, le=1024)]


class ModelConfig(_Frozen):
    """A decoder-only transformer over bytes (vocabulary 256 covers every byte)."""

    d_model: Annotated[int, Field(gt=0, le=2**16)] = 128  # largest models: about 2**14
    n_layers: Few = 2
    n_heads: Few = 4
    n_kv_heads: Few | None = None  # grouped-query attention; None means n_heads
    d_ff: Annotated[int, Field(gt=0, le=2**18)] = 512  # largest models: about 2**16
    vocab_size: Annotated[int, Field(gt=0, le=2**20)] = 256  # largest tokenizers: about 2**18
    moe_experts: Annotated[int, Field(ge=0, le=1024)] = 0  # > 0: a mixture-of-experts feed-forward
    moe_top_k: Few = 2  # at most moe_experts (checked with the other fields)
    scan_layer: bool = False  # add a gated linear-recurrence (state-space) mixer to every block

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    def shape(self) -> ModelShape:
        """The model's shape, as the sharding plan, the throughput model and the workers take it."""
        return ModelShape(d_model=self.d_model, n_layers=self.n_layers, n_heads=self.n_heads,
                          n_kv_heads=self.kv_heads, d_ff=self.d_ff, vocab_size=self.vocab_size,
                          moe_experts=self.moe_experts, moe_top_k=self.moe_top_k, scan_layer=self.scan_layer)


class Schedule(_Frozen):
    """Learning rate: linear warmup to `peak`, then cosine decay to `end` at the last step."""

    peak: Annotated[float, Field(gt=0)] = 3e-3
    end: Annotated[float, Field(ge=0)] = 3e-4
    warmup_steps: Annotated[int, Field(ge=0, le=MAX_STEPS)] = 10
    weight_decay: Annotated[float, Field(ge=0)] = 0.01


class MeshWishes(_Frozen):
    """Mesh axis sizes; -1 on one axis means "all devices left over"."""

    data: int = -1
    fsdp: int = 1
    model: int = 1

    @field_validator("data", "fsdp", "model")
    @classmethod
    def _positive_or_rest(cls, v: int) -> int:
        if v == 0 or v < -1:
            raise ValueError("must be a positive axis size, or -1 for the devices left over")
        return v


class DataConfig(_Frozen):
    """Token files a user brings (the format: `workers.tokens`; made by `orchestrator data prepare`)."""

    # A folder of token files: an absolute path (in a job file a relative one is taken from the
    # file's folder) or a URL (gs://bucket/folder, file://, memory://) read through fsspec; on
    # provider gcp a gs:// URL (TPU VMs share no disk with the machine that submits).
    path: str

    @field_validator("path")
    @classmethod
    def _path_form(cls, v: str) -> str:
        return check_data_path(v)


SeqLen = Annotated[int, Field(gt=0, le=2**17)]  # 131072 tokens of context
GlobalBatch = Annotated[int, Field(gt=0, le=2**20)]
Seed = Annotated[int, Field(ge=0, le=2**32 - 1)]  # JAX's PRNG key takes a uint32 seed


class Precision(_Frozen):
    """Mixed precision: matmuls and activations in `compute`, master parameters and optimizer state in float32.

    Softmax statistics, norms and the loss stay float32 inside the kernels whatever `compute` is.
    """

    # auto: bfloat16 on TPU and GPU (the MXU's and tensor cores' fast type), float32 on CPU, where
    # bfloat16 is no faster and the tests compare runs exactly.
    compute: Literal["auto", "bfloat16", "float32"] = "auto"
    # float32 only: bfloat16 master weights (8 bits of mantissa) drop every update smaller than
    # about 1/256 of the weight, so training stalls at small learning rates; the bfloat16 copy the
    # matmuls read is made each step from the float32 master.
    params: Literal["float32"] = "float32"

    @field_validator("params", mode="before")
    @classmethod
    def _float32_master(cls, v: Any) -> Any:
        if v != "float32":
            raise ValueError(f"must be float32, got {v!r}: master parameters and optimizer state stay float32 "
                             "(bfloat16 ones drop updates smaller than 1/256 of a weight); compute: bfloat16 "
                             "runs the matmuls in bfloat16")
        return v

    def compute_dtype(self, platform: str) -> str:
        """The compute dtype on a JAX backend ("tpu", "gpu", "cpu")."""
        if self.compute != "auto":
            return self.compute
        return "float32" if platform == "cpu" else "bfloat16"


# Rematerialisation of each transformer block in the backward pass: none (keep every activation),
# full (keep each block's input, recompute the rest), or a `jax.checkpoint_policies` policy that
# takes no arguments, e.g. dots_with_no_batch_dims_saveable (keep the projections' outputs).
Remat = Literal["none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable", "checkpoint_dots",
                "checkpoint_dots_with_no_batch_dims", "nothing_saveable", "everything_saveable"]
assert get_args(Remat) == REMAT_CHOICES, "Remat spells out policies.memory_fit.REMAT_CHOICES"
MAX_MICROBATCHES = 2**20  # as many as rows in the largest global batch


def _microbatches(v: Any) -> Any:
    """`gradient_accumulation`: a count >= 1 or "auto", with one message for anything else."""
    if v == "auto" and isinstance(v, str):
        return v
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_MICROBATCHES:
        raise ValueError(f"must be a whole number of microbatches from 1 to {MAX_MICROBATCHES:,}, or 'auto', "
                         f"got {v!r}")
    return v


# Microbatches a step is split into, their gradients summed before the one optimizer update: the
# global batch, and so the math, stay the same on a slice too small to hold it at once. auto: for
# the built-in trainer the fewest that fit the slice's HBM, chosen per slice (`policies.model.memory_fit`);
# for a user program, 1 (its model is its own).
GradientAccumulation = Annotated[Union[int, Literal["auto"]], BeforeValidator(_microbatches)]
AttentionBlock = Annotated[int, Field(gt=0, le=2**17, multiple_of=8)]  # tokens; a multiple of 8 (the sublanes)


class AttentionBlocks(_Frozen):
    """Attention tile sizes in tokens; one left out takes the kernels' default for the chip generation.

    Speed and memory change with them, never the result; the kernels fit a block to the sequence.
    """

    block_q: AttentionBlock | None = None
    block_kv: AttentionBlock | None = None
    block_q_bwd: AttentionBlock | None = None  # the backward pass's tiles
    block_kv_bwd: AttentionBlock | None = None


class KernelBlockSizes(_Frozen):
    # Two literals, one string: the docstring is what `orchestrator schema` prints, and there it stays one line.
    ("Block sizes per op, as `kernels.blocks.KernelBlocks.from_mapping` takes them "
     "(``model_dump(exclude_none=True)``).")

    attention: AttentionBlocks | None = None


class LmWorkload(_Frozen):
    """The built-in language-model trainer."""

    type: Literal["lm"] = "lm"
    model: ModelConfig = ModelConfig()
    # Each bounded alone, and their product by MAX_TOKENS_PER_STEP (checked with the other fields).
    seq_len: SeqLen = 128
    global_batch_size: GlobalBatch = 16
    steps: Steps = 100
    learning_rate: Schedule = Schedule()
    seed: Seed = 0
    mesh: MeshWishes = MeshWishes()
    kernels: Literal["pallas", "xla"] | None = None  # None: chosen from the backend (Pallas on TPU)
    data: DataConfig | None = None  # None: the bytes of Python's standard library (zero setup)
    precision: Precision = Precision()
    remat: Remat = "none"
    gradient_accumulation: GradientAccumulation = "auto"
    kernel_blocks: KernelBlockSizes | None = None  # None: the kernels' defaults for the chip generation


class EntrypointWorkload(_Frozen):
    """A user function ``module:function`` called on every host once the JAX runtime is up.

    It receives a `workers.api.Context`: the slice's mesh, `restore_or_init`, the step loop
    that saves, stops on notices and reports, and the dataset (see `workers.api`). The
    training settings below reach it as `ctx.steps`, `ctx.global_batch_size`, ...
    """

    type: Literal["entrypoint"]
    entrypoint: str
    args: dict[str, Any] = Field(default_factory=dict)
    steps: Steps | None = None  # the step loop's length; None: the program's own (progress shows no total)
    seq_len: SeqLen | None = None  # tokens per row of `ctx.dataset` (needs `data` or the default corpus)
    global_batch_size: GlobalBatch | None = None  # rows per step, over all hosts
    seed: Seed = 0
    mesh: MeshWishes = MeshWishes()
    data: DataConfig | None = None  # None: the bytes of Python's standard library, if the program asks for data
    # The same training settings as the built-in trainer's, for the program to honour: they reach it
    # as ctx.precision (ctx.compute_dtype resolves auto), ctx.remat, ctx.microbatches (auto: 1, its
    # model is its own) and ctx.kernel_blocks.
    precision: Precision = Precision()
    remat: Remat = "none"
    gradient_accumulation: GradientAccumulation = "auto"
    kernel_blocks: KernelBlockSizes | None = None

    @field_validator("entrypoint")
    @classmethod
    def _entrypoint_form(cls, v: str) -> str:
        if not ENTRYPOINT_RE.fullmatch(v):
            raise ValueError("must look like 'package.module:function'")
        return v


Workload = Annotated[Union[LmWorkload, EntrypointWorkload], Field(discriminator="type")]
