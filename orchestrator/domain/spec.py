"""The job spec: what a user hands the orchestrator, loaded from YAML and validated.

A job file looks like ``examples/tiny-lm.yaml``. Every model here is frozen and rejects
unknown keys; `JobSpec.from_yaml` turns every problem (missing file, bad YAML, unknown
key, wrong type, unknown accelerator, a mesh that does not divide the slice's devices,
an unsafe name, a number out of range) into one `SpecError` that names the file, the field
path and what is allowed.

Numbers are bounded by what the code can run (int32 steps and token indices, a uint32
PRNG seed) or, where nothing breaks, by far more than any real job needs, so a typo
(an extra zero or three) is an error rather than a job that fails hours later.

The workload section's models live in `orchestrator.domain.workload`, the other sections' (checkpoint,
storage, recovery, gcp, autoscaling, capacity trace) in `orchestrator.domain.sections`; the names other
modules import from here are re-exported.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator

from orchestrator import catalog
from orchestrator.catalog import Tier
from orchestrator.domain import requirements
from orchestrator.domain.job_file import read_job_file
from orchestrator.domain.locations import looks_like_url
from orchestrator.domain.provider_facts import ProviderFacts, facts
from orchestrator.domain.sections import (
    MAX_SLICES,
    AutoscalingConfig,
    CapacityTraceConfig,
    CheckpointConfig,
    GcpConfig,
    RecoveryConfig,
    StorageConfig,
)
from orchestrator.domain.workload import (
    MAX_TOKENS_PER_STEP,
    NAME_RE,
    NAME_RULE,
    EntrypointWorkload,
    LmWorkload,
    ModelConfig,
    Workload,
    _Frozen,
)
from orchestrator.errors import SpecError, UnknownAcceleratorError
from policies.cost.slice_options import MAX_CHIPS
from policies.model.sharding import MeshError, batch_share, plan_slices


class JobSpec(_Frozen):
    name: str
    accelerator: str = "v4-8"
    # Several slices of `accelerator`, one JAX runtime: data parallel across slices (over the data-center
    # network), the mesh's axes inside each; a lost slice is survived from the others' host memory.
    slices: Annotated[int, Field(ge=1, le=MAX_SLICES)] = 1
    tier: Tier = Tier.SPOT
    provider: Literal["local", "gcp"] = "local"
    zone: str | None = None
    gcp: GcpConfig | None = None
    workload: Workload = LmWorkload()
    checkpoint: CheckpointConfig = CheckpointConfig()
    storage: StorageConfig = StorageConfig()
    recovery: RecoveryConfig = RecoveryConfig()
    autoscaling: AutoscalingConfig | None = None
    capacity_trace: CapacityTraceConfig | None = None  # provider local: replay a spot trace as spot capacity
    budget_usd: Annotated[float, Field(gt=0)] | None = None
    deadline: dt.timedelta | None = None  # from submission, e.g. "PT12H" or "12:00:00"
    # The admission queue: a job waits QUEUED until there is capacity for it. Of the jobs
    # waiting, a higher priority goes first (equal ones in submission order).
    priority: Annotated[int, Field(ge=-1000, le=1000)] = 0
    queue_timeout: dt.timedelta | None = None  # waiting QUEUED longer than this ends the job FAILED; None: no limit
    # Where an entrypoint's module is imported from (absolute; in a job file a relative path is taken from the
    # file's folder, as checkpoint.directory's); `submit` sets the job file's folder when it is left out.
    # The folder goes to every host. Its requirements.txt, if it has one, names the packages the program
    # imports beyond the hosts' own (jax, optax, orbax, ... at the project's versions): one pip requirement
    # by name a line (flax==0.12.1), installed on every host and pinned so it cannot move those; no pip
    # options, URLs or paths (`orchestrator.domain.requirements`).
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

    @property
    def provider_facts(self) -> ProviderFacts:
        """What sets the job's provider apart (`orchestrator.domain.provider_facts`)."""
        return facts(self.provider)

    def moved(self, accelerator: str, tier: str, *, slices: int | None = None) -> "JobSpec":
        """This spec on another slice type and tier (a resize, or a move of the cost policy's), and
        on `slices` slices of it if given (else as many as before)."""
        update: dict[str, Any] = {"accelerator": accelerator, "tier": Tier(tier)}
        if slices is not None:
            update["slices"] = slices
        return self.model_copy(update=update)

    def with_checkpoint_directory(self, local_default: str | Path) -> "JobSpec":
        """This spec with `checkpoint.directory` filled in when left out: on provider gcp
        gs://<gcp.bucket>/checkpoints/<name>, else `local_default` (the state directory's)."""
        if self.checkpoint.directory is not None:
            return self
        if not self.provider_facts.hosts_share_disk:
            assert self.gcp is not None and self.gcp.bucket, "checked by semantic_problems"
            directory = f"gs://{self.gcp.bucket}/checkpoints/{self.name}"
        else:
            directory = str(local_default)
        return self.model_copy(update={"checkpoint": self.checkpoint.model_copy(update={"directory": directory})})

    # -- loading ---------------------------------------------------------------

    @classmethod
    def from_yaml(cls, path: str | Path, *, check_memory: bool = True) -> "JobSpec":
        """`check_memory`: refuse a slice the memory estimate says training does not fit (False: the TPU
        compiler's figures decide instead, `orchestrator.user.compiled`)."""
        path = Path(path)
        data = read_job_file(path)  # SpecError: unreadable, over 1 MiB, duplicate keys, invalid YAML
        return cls.from_dict(_resolve_checkpoint_dir(data, path.parent), source=str(path), check_memory=check_memory)

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "<spec>", check_memory: bool = True) -> "JobSpec":
        if not isinstance(data, dict):
            kind = "nothing" if data is None else type(data).__name__
            raise SpecError(source, [("", f"expected a mapping of job fields at the top level, got {kind}")])
        try:
            spec = cls.model_validate(data)
        except ValidationError as e:
            raise SpecError(source, [_describe(err) for err in e.errors()]) from None
        problems = spec.semantic_problems(check_memory=check_memory)
        if problems:
            raise SpecError(source, problems)
        return spec

    @classmethod
    def from_stored(cls, raw: dict) -> "JobSpec":
        """The spec as the store keeps it (validated when it was submitted; an older store kept the working
        directory as `_workdir`)."""
        data = {k: v for k, v in raw.items() if not k.startswith("_")}
        if raw.get("_workdir") and not data.get("workdir"):
            data["workdir"] = raw["_workdir"]
        return cls.model_validate(data)

    def semantic_problems(self, *, check_memory: bool = True) -> list[tuple[str, str]]:
        """Problems that involve several fields (the provider's settings, the mesh against the slice)."""
        if self.provider_facts.needs_gcp_config and self.gcp is None:
            return [("gcp", "provider gcp needs a gcp section with at least project and zones")]
        if self.capacity_trace is not None and not self.provider_facts.replays_capacity_trace:
            return [("capacity_trace", "a replayed capacity trace is for provider local only")]
        general = self._storage_problems()
        if self.autoscaling is not None and self.deadline is None:
            general.append(("deadline", "autoscaling needs a deadline (e.g. deadline: PT24H): the cost policy "
                                        "weighs each slice's cost against the time left"))
        if sliced := self._slices_problems():  # the mesh and batch checks below take the slice count as valid
            return general + sliced
        w = self.workload
        return general + (self._lm_problems(w, check_memory) if isinstance(w, LmWorkload)
                          else self._entrypoint_problems(w))

    def _storage_problems(self) -> list[tuple[str, str]]:
        """On gcp every file the hosts share lives in Cloud Storage: TPU VMs share no disk with this machine."""
        if self.provider_facts.hosts_share_disk:
            return []
        problems = []
        assert self.gcp is not None, "checked by semantic_problems first"
        directory, bucket = self.checkpoint.directory, self.gcp.bucket
        if directory is None and bucket is None:
            problems.append(("checkpoint.directory", "provider gcp keeps checkpoints in Cloud Storage (TPU VMs share "
                                                     "no disk with this machine): set checkpoint.directory to "
                                                     "gs://BUCKET/FOLDER, or gcp.bucket to a bucket for the default "
                                                     f"gs://BUCKET/checkpoints/{self.name}"))
        elif directory is not None and not directory.startswith("gs://"):
            problems.append(("checkpoint.directory", f"{directory!r} is on this machine, and TPU VMs share no disk "
                                                     "with it; use gs://BUCKET/FOLDER (or leave it out and set "
                                                     "gcp.bucket)"))
        data = self.workload.data
        if data is not None and not data.path.startswith("gs://"):
            problems.append(("workload.data.path", f"{data.path!r} is not in Cloud Storage, and TPU VMs share no disk "
                                                   "with this machine; put the token files in a bucket (orchestrator "
                                                   "data prepare SRC -o gs://BUCKET/FOLDER) and name that"))
        return problems

    def _slices_problems(self) -> list[tuple[str, str]]:
        """Several slices: at most `MAX_CHIPS` chips in all, a batch split evenly between them, no policy choosing."""
        n = self.slices
        if n == 1:
            return []
        problems = []
        if n * self.tpu_type.chips > MAX_CHIPS:
            problems.append(("slices", f"{n} slices of {self.accelerator} are {n * self.tpu_type.chips} chips; a job "
                                       f"takes at most {MAX_CHIPS} chips in all"))
        batch = self.workload.global_batch_size
        try:
            if batch is not None:
                batch_share(batch, n)
        except MeshError as e:
            problems.append((f"workload.{e.field}", str(e)))
        auto = self.autoscaling
        if auto is not None and n > auto.max_slices:
            problems.append(("slices", f"with autoscaling the cost policy chooses the slice count, up to "
                                       f"autoscaling.max_slices ({auto.max_slices}); leave slices out and set "
                                       f"autoscaling.max_slices: {n} to let it run on up to {n}"))
        return problems

    @property
    def _devices_note(self) -> str:
        """What a mesh or batch problem is measured against: the slice's devices, and its share of the batch."""
        note = f"accelerator {self.accelerator} has {self.tpu_type.chips} devices"
        batch = self.workload.global_batch_size
        if self.slices > 1 and batch is not None:
            note += f"; each of its {self.slices} slices trains {batch // self.slices} of the {batch} rows"
        return note

    def _lm_problems(self, w: LmWorkload, check_memory: bool = True) -> list[tuple[str, str]]:
        """The built-in trainer's settings together, then its mesh and memory on every slice it may run on."""
        from orchestrator.domain.fit import memory_problems

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
            plan_slices(num_devices=self.tpu_type.chips, num_hosts=self.tpu_type.hosts, wishes=w.mesh.model_dump(),
                        shape=m.shape(), global_batch_size=w.global_batch_size, slices=self.slices)
        except MeshError as e:
            problems.append((f"workload.{e.field}",
                             f"{e} ({self._devices_note})"))
        return problems + memory_problems(self, check_hbm=check_memory)

    def _entrypoint_problems(self, w: EntrypointWorkload) -> list[tuple[str, str]]:
        """A user program's packages and batch settings against the slice (its model is its own: not checked here)."""
        if self.workdir is not None and (problems := requirements.read(self.workdir)[1]):
            return problems
        if w.global_batch_size is None:
            return []
        try:
            mesh = plan_slices(num_devices=self.tpu_type.chips, num_hosts=self.tpu_type.hosts,
                               wishes=w.mesh.model_dump(), shape=None, global_batch_size=w.global_batch_size,
                               slices=self.slices)
        except MeshError as e:
            return [(f"workload.{e.field}", f"{e} ({self._devices_note})")]
        if w.gradient_accumulation != "auto" and mesh.rows_per_shard % w.gradient_accumulation:
            return [("workload.gradient_accumulation",
                     f"{w.gradient_accumulation} microbatches do not divide the {mesh.rows_per_shard} rows each batch "
                     f"shard gets on {self.accelerator}; use a divisor of {mesh.rows_per_shard} or 'auto'")]
        return []

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def _resolve_checkpoint_dir(data: Any, folder: Path) -> Any:
    """`data` with relative paths (checkpoint.directory, workload.data.path, workdir) taken from `folder`, the
    job file's; an entrypoint job's `workdir` defaults to that folder."""
    def resolved(value: Any) -> Any:
        if not isinstance(value, str) or not value.strip() or "\0" in value or looks_like_url(value):
            return None  # nothing to resolve (a URL, gs:// or not, is never a path), or a value refused later
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
    if isinstance(workload, dict) and workload.get("type") == "entrypoint" and data.get("workdir") is None:
        data = {**data, "workdir": str(folder.resolve())}  # the folder an entrypoint is imported from and shipped
    elif resolved(data.get("workdir")):
        data = {**data, "workdir": resolved(data["workdir"])}
    return data


def _describe(err: Mapping[str, Any]) -> tuple[str, str]:  # one of ValidationError.errors()
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


__all__ = ["AutoscalingConfig", "CheckpointConfig", "EntrypointWorkload", "GcpConfig", "JobSpec", "LmWorkload",
           "ModelConfig", "RecoveryConfig", "StorageConfig", "json_schema"]


def json_schema() -> dict:
    """The JSON Schema of a job file, for editors."""
    schema = JobSpec.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "tpu-orchestrator job"
    return schema
