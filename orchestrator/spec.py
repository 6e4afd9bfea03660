"""The job spec: what a user hands the orchestrator, loaded from YAML and validated.

A job file looks like ``examples/tiny-lm.yaml``. Every model here is frozen and rejects
unknown keys; `JobSpec.from_yaml` turns every problem (missing file, bad YAML, unknown
key, wrong type, unknown accelerator, a mesh that does not divide the slice's devices,
an unsafe name) into one `SpecError` that names the file, the field path and what is
allowed.
"""

from __future__ import annotations

import datetime as dt
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from orchestrator import catalog
from orchestrator.catalog import Tier
from orchestrator.errors import SpecError, UnknownAcceleratorError
from policies.sharding import MeshError, ModelDims, plan_mesh

NAME_RE = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,38}[a-z0-9])?$")
NAME_RULE = "1 to 40 lowercase letters, digits and dashes, starting and ending with a letter or digit"
ENTRYPOINT_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


PositiveInt = Annotated[int, Field(gt=0)]


class ModelConfig(_Frozen):
    """A decoder-only transformer over bytes (vocabulary 256 covers every byte)."""

    d_model: PositiveInt = 128
    n_layers: PositiveInt = 2
    n_heads: PositiveInt = 4
    n_kv_heads: PositiveInt | None = None  # grouped-query attention; None means n_heads
    d_ff: PositiveInt = 512
    vocab_size: PositiveInt = 256
    moe_experts: Annotated[int, Field(ge=0)] = 0  # > 0: a mixture-of-experts feed-forward
    moe_top_k: PositiveInt = 2
    scan_layer: bool = False  # add a gated linear-recurrence (state-space) mixer to every block

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads


class Schedule(_Frozen):
    """Learning rate: linear warmup to `peak`, then cosine decay to `end` at the last step."""

    peak: Annotated[float, Field(gt=0)] = 3e-3
    end: Annotated[float, Field(ge=0)] = 3e-4
    warmup_steps: Annotated[int, Field(ge=0)] = 10
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


class LmWorkload(_Frozen):
    """The built-in language-model trainer."""

    type: Literal["lm"] = "lm"
    model: ModelConfig = ModelConfig()
    seq_len: PositiveInt = 128
    global_batch_size: PositiveInt = 16
    steps: PositiveInt = 100
    learning_rate: Schedule = Schedule()
    seed: Annotated[int, Field(ge=0)] = 0
    mesh: MeshWishes = MeshWishes()
    kernels: Literal["pallas", "xla"] | None = None  # None: chosen from the backend (Pallas on TPU)


class EntrypointWorkload(_Frozen):
    """A user function ``module:function`` called on every host once the JAX runtime is up.

    It receives a `workers.context.WorkerContext` (rank, mesh helpers, checkpoint
    directory, a `report(step, loss, tokens)` callback) and returns when done.
    """

    type: Literal["entrypoint"]
    entrypoint: str
    args: dict[str, Any] = Field(default_factory=dict)
    steps: PositiveInt | None = None  # for progress display only

    @field_validator("entrypoint")
    @classmethod
    def _entrypoint_form(cls, v: str) -> str:
        if not ENTRYPOINT_RE.match(v):
            raise ValueError("must look like 'package.module:function'")
        return v


Workload = Annotated[Union[LmWorkload, EntrypointWorkload], Field(discriminator="type")]


class CheckpointConfig(_Frozen):
    directory: str | None = None  # default: $ORCHESTRATOR_HOME/checkpoints/<job name>
    interval_steps: PositiveInt = 20  # with autoscaling, the longest: spot slices preempted often save sooner
    keep: PositiveInt = 3


class RecoveryConfig(_Frozen):
    max_preemptions: Annotated[int, Field(ge=0)] = 100
    max_failures: Annotated[int, Field(ge=0)] = 2
    heartbeat_timeout_s: Annotated[float, Field(gt=0)] = 120.0
    grace_period_s: Annotated[float, Field(gt=0)] = 30.0
    start_timeout_s: Annotated[float, Field(gt=0)] = 300.0  # for a slice's hosts to join and its workers to start
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
    budget_usd: Annotated[float, Field(gt=0)] | None = None
    deadline: dt.timedelta | None = None  # from submission, e.g. "PT12H" or "12:00:00"

    @field_validator("name")
    @classmethod
    def _safe_name(cls, v: str) -> str:
        if not NAME_RE.match(v):
            raise ValueError(f"{v!r} is not a valid job name: use {NAME_RULE}")
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
        source = str(path)
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise SpecError(source, [("", "file not found")]) from None
        except (IsADirectoryError, PermissionError, UnicodeDecodeError) as e:
            raise SpecError(source, [("", f"cannot read the file: {e}")]) from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            where = ""
            mark = getattr(e, "problem_mark", None)
            if mark is not None:
                where = f" at line {mark.line + 1}, column {mark.column + 1}"
            problem = getattr(e, "problem", None) or str(e)
            raise SpecError(source, [("", f"invalid YAML{where}: {problem}")]) from None
        spec = cls.from_dict(data, source=source)
        ckpt = spec.checkpoint.directory
        if ckpt is not None and not Path(ckpt).is_absolute():
            # Relative checkpoint paths are relative to the job file, not to wherever
            # the command happens to run.
            resolved = str((path.parent / ckpt).resolve())
            spec = spec.model_copy(update={"checkpoint": spec.checkpoint.model_copy(update={"directory": resolved})})
        return spec

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
        w = self.workload
        if not isinstance(w, LmWorkload):
            return []
        m = w.model
        problems: list[tuple[str, str]] = []
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
                dims=ModelDims(d_model=m.d_model, n_heads=m.n_heads, n_kv_heads=m.kv_heads, d_ff=m.d_ff,
                               vocab_size=m.vocab_size),
                global_batch_size=w.global_batch_size,
            )
        except MeshError as e:
            problems.append((f"workload.{e.field}", f"{e} (accelerator {self.accelerator} has {self.tpu_type.chips} devices)"))
        return problems

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


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
