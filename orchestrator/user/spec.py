"""The job spec: what a user hands the orchestrator, loaded from YAML and validated.

A job file looks like ``examples/tiny-lm.yaml``. Every model here is frozen and rejects
unknown keys; `JobSpec.from_yaml` turns every problem (missing file, bad YAML, unknown
key, wrong type, unknown accelerator, a mesh that does not divide the slice's devices,
an unsafe name, a number out of range) into one `SpecError` that names the file, the field
path and what is allowed.

Numbers are bounded by what the code can run (int32 steps and token indices, a uint32
PRNG seed) or, where nothing breaks, by far more than any real job needs, so a typo
(an extra zero or three) is an error rather than a job that fails hours later.
"""

from __future__ import annotations

import datetime as dt
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator

from orchestrator import catalog
from orchestrator.catalog import Tier
from orchestrator.errors import SpecError, UnknownAcceleratorError
from orchestrator.user.job_file import read_job_file
from policies.memory_fit import REMAT_CHOICES
from policies.model_shape import ModelShape
from policies.sharding import MeshError, plan_mesh

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
    # file's folder) or a URL (gs://bucket/folder, file://, memory://) read through fsspec.
    path: str

    @field_validator("path")
    @classmethod
    def _path_form(cls, v: str) -> str:
        if not v.strip() or any(c in v for c in "\0\n\r"):
            raise ValueError(f"must be a non-empty path or URL without NUL or line breaks, got {v!r}")
        if "://" not in v and not Path(v).is_absolute():
            raise ValueError(f"must be an absolute path or a URL, got {v!r} (in a job file, a relative path is "
                             "taken from the file's folder)")
        return v


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
Remat = Literal[REMAT_CHOICES]
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
# the built-in trainer the fewest that fit the slice's HBM, chosen per slice (`policies.memory_fit`);
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


class KernelBlocks(_Frozen):
    """Block sizes per op, as `kernels.blocks.KernelBlocks.from_mapping` takes them (``model_dump(exclude_none=True)``)."""

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
    kernel_blocks: KernelBlocks | None = None  # None: the kernels' defaults for the chip generation


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
    kernel_blocks: KernelBlocks | None = None

    @field_validator("entrypoint")
    @classmethod
    def _entrypoint_form(cls, v: str) -> str:
        if not ENTRYPOINT_RE.fullmatch(v):
            raise ValueError("must look like 'package.module:function'")
        return v


Workload = Annotated[Union[LmWorkload, EntrypointWorkload], Field(discriminator="type")]


class CheckpointConfig(_Frozen):
    # An absolute path; in a job file a relative one is taken from the file's folder (not from
    # where the command runs). None: $ORCHESTRATOR_HOME/checkpoints/<job name>.
    directory: str | None = None
    interval_steps: Steps = 20  # with autoscaling, the longest: spot slices preempted often save sooner
    keep: Annotated[int, Field(gt=0, le=1000)] = 3  # each checkpoint is a full copy of the model and optimizer

    @field_validator("directory")
    @classmethod
    def _absolute_path(cls, v: str | None) -> str | None:
        if v is None:
            return v
        if not v.strip():
            raise ValueError("must not be empty; leave it out for the default")
        if any(c in v for c in "\0\n\r"):
            raise ValueError(f"must not contain NUL or line breaks, got {v!r}")
        if not Path(v).is_absolute():
            raise ValueError(f"must be an absolute path, got {v!r} (in a job file, a relative path is taken "
                             "from the file's folder)")
        return v


class RecoveryConfig(_Frozen):
    max_preemptions: Count = 100
    max_failures: Count = 2
    heartbeat_timeout_s: Timeout = 120.0
    grace_period_s: Timeout = 30.0
    start_timeout_s: Timeout = 300.0  # for a slice's hosts to join and its workers to start
    # Where hosts long-poll for preemption notices; None: the GCE metadata server on gcp, none locally.
    metadata_url: str | None = None


class GcpConfig(_Frozen):
    """Where and how `provider: gcp` gets slices (see the README's Google Cloud section)."""

    project: str
    zones: Annotated[list[str], Field(min_length=1)]  # tried in order when one has no capacity
    endpoint: str | None = None  # the TPU API; None: Google's. The emulator's URL for local runs
    reservation: str | None = None  # for tier: reserved
    service_account: str | None = None  # the TPU VMs' service account
    head_address: str | None = None  # the Ray head as the TPU VMs reach it; default: the cluster's address
    ray_token_secret: str | None = None  # Secret Manager secret with the Ray token, for the VMs


class AutoscalingConfig(_Frozen):
    """The slice types and tiers the cost policy may choose between (`orchestrator plan`)."""

    accelerators: Annotated[list[str], Field(min_length=1)] = ["v4-16", "v4-32", "v4-64"]
    tiers: Annotated[list[Tier], Field(min_length=1)] = [Tier.SPOT, Tier.ON_DEMAND]

    @field_validator("accelerators")
    @classmethod
    def _known(cls, v: list[str]) -> list[str]:
        for name in v:
            try:
                catalog.lookup(name)
            except UnknownAcceleratorError as e:
                raise ValueError(str(e)) from None
        return v


class CapacityTraceConfig(_Frozen):
    """`provider: local` only: replay a spot trace as the job's spot capacity (`providers.capacity`)."""

    path: str  # a trace file, {"metadata": {"gap_seconds": G}, "data": [...]}; relative: from the job file's folder
    time_scale: Annotated[float, Field(gt=0, le=1e6)] = 60.0  # trace seconds per wall second (60: an hour a minute)
    start_s: Annotated[float, Field(ge=0)] = 0.0  # where in the trace the job starts
    grace_s: Annotated[float, Field(gt=0, le=3600)] = 30.0  # trace seconds from a reclaim notice to the hosts' end

    @field_validator("path")
    @classmethod
    def _a_trace(cls, v: str) -> str:
        from policies.traces import load_trace

        load_trace(v)  # TraceError (a ValueError) names the file and what is wrong with it
        return v


class JobSpec(_Frozen):
    name: str
    accelerator: str = "v4-8"
    tier: Tier = Tier.SPOT
    provider: Literal["local", "gcp"] = "local"
    zone: str | None = None
    gcp: GcpConfig | None = None
    workload: Workload = LmWorkload()
    checkpoint: CheckpointConfig = CheckpointConfig()
    recovery: RecoveryConfig = RecoveryConfig()
    autoscaling: AutoscalingConfig | None = None
    capacity_trace: CapacityTraceConfig | None = None  # provider local: replay a spot trace as spot capacity
    budget_usd: Annotated[float, Field(gt=0)] | None = None
    deadline: dt.timedelta | None = None  # from submission, e.g. "PT12H" or "12:00:00"
    # The admission queue: a job waits QUEUED until there is capacity for it. Of the jobs
    # waiting, a higher priority goes first (equal ones in submission order).
    priority: Annotated[int, Field(ge=-1000, le=1000)] = 0
    queue_timeout: dt.timedelta | None = None  # waiting QUEUED longer than this ends the job FAILED; None: no limit
    # Where an entrypoint's module is imported from (absolute); `submit` sets the job file's folder.
    workdir: str | None = None

    @field_validator("workdir")
    @classmethod
    def _absolute_workdir(cls, v: str | None) -> str | None:
        if v is not None and (not Path(v).is_absolute() or any(c in v for c in "\0\n\r")):
            raise ValueError(f"must be an absolute path without line breaks, got {v!r}")
        return v

    @field_validator("name")
    @classmethod
    def _safe_name(cls, v: str) -> str:
        if not NAME_RE.fullmatch(v):
            raise ValueError(f"{v!r} is not a valid job name: use {NAME_RULE}")
        return v

    @field_validator("deadline", "queue_timeout")
    @classmethod
    def _positive_duration(cls, v: dt.timedelta | None) -> dt.timedelta | None:
        if v is not None and v <= dt.timedelta(0):
            raise ValueError(f"must be a positive duration, e.g. 'PT12H' or '12:00:00', got {v}")
        return v

    @field_validator("accelerator")
    @classmethod
    def _known_accelerator(cls, v: str) -> str:
        try:
            catalog.lookup(v)
        except UnknownAcceleratorError as e:
            raise ValueError(str(e)) from None
        return v

    @property
    def tpu_type(self) -> catalog.TpuType:
        return catalog.lookup(self.accelerator)

    # -- loading ---------------------------------------------------------------

    @classmethod
    def from_yaml(cls, path: str | Path) -> "JobSpec":
        path = Path(path)
        data = read_job_file(path)  # SpecError: unreadable, over 1 MiB, duplicate keys, invalid YAML
        return cls.from_dict(_resolve_checkpoint_dir(data, path.parent), source=str(path))

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "<spec>") -> "JobSpec":
        if not isinstance(data, dict):
            kind = "nothing" if data is None else type(data).__name__
            raise SpecError(source, [("", f"expected a mapping of job fields at the top level, got {kind}")])
        try:
            spec = cls.model_validate(data)
        except ValidationError as e:
            raise SpecError(source, [_describe(err) for err in e.errors()]) from None
        problems = spec.semantic_problems()
        if problems:
            raise SpecError(source, problems)
        return spec

    def semantic_problems(self) -> list[tuple[str, str]]:
        """Problems that involve several fields (the provider's settings, the mesh against the slice)."""
        if self.provider == "gcp" and self.gcp is None:
            return [("gcp", "provider gcp needs a gcp section with at least project and zones")]
        if self.capacity_trace is not None and self.provider != "local":
            return [("capacity_trace", "a replayed capacity trace is for provider local only")]
        general = []
        if self.autoscaling is not None and self.deadline is None:
            general.append(("deadline", "autoscaling needs a deadline (e.g. deadline: PT24H): the cost policy "
                                        "weighs each slice's cost against the time left"))
        w = self.workload
        return general + (self._lm_problems(w) if isinstance(w, LmWorkload) else self._entrypoint_problems(w))

    def _lm_problems(self, w: LmWorkload) -> list[tuple[str, str]]:
        """The built-in trainer's settings together, then its mesh and memory on every slice it may run on."""
        from orchestrator.user.fit import memory_problems

        m = w.model
        problems: list[tuple[str, str]] = []
        if w.learning_rate.warmup_steps > w.steps:
            problems.append(("workload.learning_rate.warmup_steps",
                             f"must be at most workload.steps={w.steps}, got {w.learning_rate.warmup_steps}"))
        tokens = w.global_batch_size * (w.seq_len + 1)  # inputs and the shifted targets
        if tokens >= MAX_TOKENS_PER_STEP:
            problems.append(("workload.global_batch_size",
                             f"global_batch_size * (seq_len + 1) must be below 2**31 = {MAX_TOKENS_PER_STEP:,} "
                             f"tokens a step (int32 indexing), got {w.global_batch_size} * {w.seq_len + 1} = "
                             f"{tokens:,}"))
        if w.data is None and m.vocab_size < 256:
            problems.append(("workload.model.vocab_size",
                             f"must be at least 256 to train on the default data (bytes), got {m.vocab_size}"))
        if m.moe_experts and m.moe_top_k > m.moe_experts:
            problems.append(("workload.model.moe_top_k", f"must be at most moe_experts={m.moe_experts}"))
        if m.d_model % m.n_heads:
            problems.append(("workload.model.n_heads", f"must divide d_model={m.d_model}, got {m.n_heads}"))
        elif m.n_heads % m.kv_heads:
            problems.append(("workload.model.n_kv_heads", f"must divide n_heads={m.n_heads}, got {m.kv_heads}"))
        if problems:
            return problems
        try:
            plan_mesh(
                num_devices=self.tpu_type.chips,
                num_hosts=self.tpu_type.hosts,
                wishes=w.mesh.model_dump(),
                shape=m.shape(),
                global_batch_size=w.global_batch_size,
            )
        except MeshError as e:
            problems.append((f"workload.{e.field}", f"{e} (accelerator {self.accelerator} has {self.tpu_type.chips} devices)"))
        return problems + memory_problems(self)

    def _entrypoint_problems(self, w: EntrypointWorkload) -> list[tuple[str, str]]:
        """A user program's batch settings against the slice (its model is its own: not checked here)."""
        if w.global_batch_size is None:
            return []
        try:
            mesh = plan_mesh(num_devices=self.tpu_type.chips, num_hosts=self.tpu_type.hosts,
                             wishes=w.mesh.model_dump(), shape=None, global_batch_size=w.global_batch_size)
        except MeshError as e:
            return [(f"workload.{e.field}", f"{e} (accelerator {self.accelerator} has {self.tpu_type.chips} devices)")]
        if w.gradient_accumulation != "auto" and mesh.rows_per_shard % w.gradient_accumulation:
            return [("workload.gradient_accumulation",
                     f"{w.gradient_accumulation} microbatches do not divide the {mesh.rows_per_shard} rows each batch "
                     f"shard gets on {self.accelerator}; use a divisor of {mesh.rows_per_shard} or 'auto'")]
        return []

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def _resolve_checkpoint_dir(data: Any, folder: Path) -> Any:
    """`data` with relative paths (checkpoint.directory, workload.data.path) taken from `folder`, the job file's."""
    def resolved(value: Any) -> Any:
        if not isinstance(value, str) or not value.strip() or "\0" in value or "://" in value:
            return None  # nothing to resolve, or a value the validator refuses with its own message
        return None if Path(value).is_absolute() else str((folder / value).resolve())

    if not isinstance(data, dict):
        return data
    ckpt = data.get("checkpoint")
    if isinstance(ckpt, dict) and resolved(ckpt.get("directory")):
        data = {**data, "checkpoint": {**ckpt, "directory": resolved(ckpt["directory"])}}
    workload = data.get("workload")
    source = workload.get("data") if isinstance(workload, dict) else None
    if isinstance(source, dict) and resolved(source.get("path")):
        data = {**data, "workload": {**workload, "data": {**source, "path": resolved(source["path"])}}}
    trace = data.get("capacity_trace")
    if isinstance(trace, dict) and resolved(trace.get("path")):
        data = {**data, "capacity_trace": {**trace, "path": resolved(trace["path"])}}
    return data


def _describe(err: dict) -> tuple[str, str]:
    loc = [str(p) for p in err["loc"]]
    # Drop the discriminator tag pydantic inserts ("workload.lm.steps" -> "workload.steps").
    if len(loc) >= 2 and loc[0] == "workload" and loc[1] in ("lm", "entrypoint"):
        loc.pop(1)
    path = ".".join(loc)
    kind = err["type"]
    if kind == "extra_forbidden":
        return path, "unknown key" + _allowed_keys_hint(loc)
    if kind == "missing":
        return path, "required field is missing"
    if kind == "union_tag_invalid":
        return path, "workload type must be 'lm' or 'entrypoint'"
    if kind == "union_tag_not_found":
        return path + ".type" if path else "type", "workload needs a type: 'lm' or 'entrypoint'"
    msg = err["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    return path, msg


def _allowed_keys_hint(loc: list[str]) -> str:
    model: type[BaseModel] | None = JobSpec
    for part in loc[:-1]:
        if model is None:
            return ""
        field = model.model_fields.get(part)
        if field is None:
            return ""
        ann = field.annotation
        model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
        if part == "workload":
            model = LmWorkload
    if model is None:
        return ""
    return f"; allowed keys here: {', '.join(model.model_fields)}"


def json_schema() -> dict:
    """The JSON Schema of a job file, for editors."""
    schema = JobSpec.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "tpu-orchestrator job"
    return schema
