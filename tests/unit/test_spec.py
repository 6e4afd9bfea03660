"""Job spec validation: valid files load; every kind of bad input gets one exact message."""

from __future__ import annotations

import datetime as dt
import re
import time
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from orchestrator.domain.fit import microbatches_for
from orchestrator.domain.spec import JobSpec, LmWorkload, json_schema
from orchestrator.errors import SpecError

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("path", sorted((REPO / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_examples_are_valid(path):
    spec = JobSpec.from_yaml(path)
    assert spec.name and spec.tpu_type.chips >= 1


def test_defaults_and_catalog_facts():
    spec = JobSpec.from_dict({"name": "a", "accelerator": "v4-32"})
    assert (spec.tpu_type.chips, spec.tpu_type.hosts, spec.tpu_type.chips_per_host) == (16, 4, 4)
    assert isinstance(spec.workload, LmWorkload)
    assert spec.recovery.max_preemptions > spec.recovery.max_failures


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "job.yaml"
    p.write_text(text)
    return p


def problem(tmp_path: Path, text: str) -> str:
    path = write(tmp_path, text)
    with pytest.raises(SpecError) as info:
        JobSpec.from_yaml(path)
    return str(info.value).replace(str(path), "job.yaml")


CASES = {
    "unknown key": ("name: a\nbogus: 1\n",
                    f"job.yaml: bogus: unknown key; allowed keys here: {', '.join(JobSpec.model_fields)}"),
    "nested unknown key": ("name: a\nworkload: {type: lm, modle: {}}\n",
                           f"job.yaml: workload.modle: unknown key; allowed keys here: "
                           f"{', '.join(LmWorkload.model_fields)}"),
    "wrong type": ("name: a\ncheckpoint: {interval_steps: often}\n",
                   "job.yaml: checkpoint.interval_steps: Input should be a valid integer, unable to parse string "
                   "as an integer"),
    "zero count": ("name: a\nworkload: {type: lm, steps: 0}\n",
                   "job.yaml: workload.steps: Input should be greater than 0"),
    "negative count": ("name: a\nrecovery: {max_failures: -1}\n",
                       "job.yaml: recovery.max_failures: Input should be greater than or equal to 0"),
    "unknown accelerator": ("name: a\naccelerator: v9-8\n",
                            "job.yaml: accelerator: unknown accelerator 'v9-8'; valid types are: v4-8, v4-16, "
                            "v4-32, v4-64, v4-128, v5litepod-1, v5litepod-4, v5litepod-8, v5litepod-16, "
                            "v5litepod-32, v5litepod-64, v5p-8, v5p-16, v5p-32, v5p-64, v5p-128, v6e-1, v6e-4, "
                            "v6e-8, v6e-16, v6e-32, v6e-64"),
    "mesh does not divide": ("name: a\naccelerator: v4-32\nworkload: {type: lm, mesh: {data: 3, model: 1}}\n",
                             "job.yaml: workload.mesh: mesh data=3xfsdp=1xmodel=1 uses 3 devices, not the slice's "
                             "16 (accelerator v4-32 has 16 devices)"),
    "model axis vs heads": ("name: a\nworkload: {type: lm, model: {n_heads: 2, d_model: 64}, mesh: {model: 4}}\n",
                            "job.yaml: workload.mesh.model: mesh axis model=4 does not divide model.n_heads=2 "
                            "(accelerator v4-8 has 4 devices)"),
    "batch vs data axis": ("name: a\naccelerator: v4-16\nworkload: {type: lm, global_batch_size: 12}\n",
                           "job.yaml: workload.global_batch_size: global_batch_size=12 is not divisible by "
                           "data*fsdp=8 (accelerator v4-16 has 8 devices)"),
    "too many chips over slices": ("name: a\naccelerator: v4-64\nslices: 2\n",
                                   "job.yaml: slices: 2 slices of v4-64 are 64 chips; a job takes at most 32 chips "
                                   "in all"),
    "batch vs slices": ("name: a\naccelerator: v4-16\nslices: 3\nworkload: {type: lm, global_batch_size: 16}\n",
                        "job.yaml: workload.global_batch_size: global_batch_size=16 is not divisible by slices=3 "
                        "(each slice trains an equal share of every batch)"),
    "slice's batch vs data axis": ("name: a\naccelerator: v4-16\nslices: 2\n"
                                   "workload: {type: lm, global_batch_size: 8}\n",
                                   "job.yaml: workload.global_batch_size: global_batch_size=4 is not divisible by "
                                   "data*fsdp=8 (accelerator v4-16 has 8 devices; each of its 2 slices trains 4 of "
                                   "the 8 rows)"),
    "slices with autoscaling": ("name: a\naccelerator: v4-16\nslices: 2\ndeadline: PT2H\nautoscaling: {}\n",
                                "job.yaml: slices: with autoscaling the cost policy chooses the slice count, up to "
                                "autoscaling.max_slices (1); leave slices out and set autoscaling.max_slices: 2 to "
                                "let it run on up to 2"),
    "max_slices out of range": ("name: a\naccelerator: v4-16\ndeadline: PT2H\nautoscaling: {max_slices: 5}\n",
                                "job.yaml: autoscaling.max_slices: Input should be less than or equal to 4"),
    "slash in name": ("name: a/b\n",
                      "job.yaml: name: 'a/b' is not a valid job name: use 1 to 40 lowercase letters, digits and "
                      "dashes, starting and ending with a letter or digit"),
    "dotdot name": ("name: ../../x\n",
                    "job.yaml: name: '../../x' is not a valid job name: use 1 to 40 lowercase letters, digits "
                    "and dashes, starting and ending with a letter or digit"),
    "missing name": ("accelerator: v4-8\n", "job.yaml: name: required field is missing"),
    "bad tier": ("name: a\ntier: cheap\n",
                 "job.yaml: tier: Input should be 'spot', 'on-demand' or 'reserved'"),
    "bad entrypoint": ("name: a\nworkload: {type: entrypoint, entrypoint: 'not valid'}\n",
                       "job.yaml: workload.entrypoint: must look like 'package.module:function'"),
    "bad workload type": ("name: a\nworkload: {type: rl}\n",
                          "job.yaml: workload: workload type must be 'lm' or 'entrypoint'"),
    "invalid yaml": ("name: a\nworkload: {type: lm\n",
                     "job.yaml: invalid YAML at line 3, column 1: expected ',' or '}', but got '<stream end>'"),
    "not a mapping": ("- a\n- b\n", "job.yaml: expected a mapping of job fields at the top level, got list"),
    "empty file": ("", "job.yaml: expected a mapping of job fields at the top level, got nothing"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_message(tmp_path, case):
    text, expected = CASES[case]
    assert problem(tmp_path, text) == expected


def test_missing_file(tmp_path):
    with pytest.raises(SpecError) as info:
        JobSpec.from_yaml(tmp_path / "nope.yaml")
    assert str(info.value) == f"{tmp_path / 'nope.yaml'}: file not found"


def test_all_problems_reported_at_once(tmp_path):
    msg = problem(tmp_path, "name: A\naccelerator: v9\nworkload: {type: lm, steps: 0}\n")
    assert msg.count("\n") == 2 and "name:" in msg and "accelerator:" in msg and "workload.steps:" in msg


def test_relative_checkpoint_dir_is_relative_to_the_file(tmp_path):
    spec = JobSpec.from_yaml(write(tmp_path, "name: a\ncheckpoint: {directory: ckpt}\n"))
    assert spec.checkpoint.directory == str((tmp_path / "ckpt").resolve())


def test_schema_describes_fields():
    schema = json_schema()
    assert schema["additionalProperties"] is False
    assert {"name", "accelerator", "workload", "checkpoint", "recovery"} <= set(schema["properties"])


def test_gcp_provider_needs_its_section(tmp_path):
    assert problem(tmp_path, "name: a\nprovider: gcp\n") == (
        "job.yaml: gcp: provider gcp needs a gcp section with at least project and zones")
    assert problem(tmp_path, "name: a\nprovider: gcp\ngcp: {project: p, zones: []}\n") == (
        "job.yaml: gcp.zones: List should have at least 1 item after validation, not 0")


def problems_of(data: dict) -> list[tuple[str, str]]:
    with pytest.raises(SpecError) as info:
        JobSpec.from_dict({"name": "a", **data})
    return info.value.problems


@pytest.mark.parametrize("data, expected", [
    ({"name": "tiny\n"}, ("name", "'tiny\\n' is not a valid job name: use 1 to 40 lowercase letters, digits and "
                                  "dashes, starting and ending with a letter or digit")),
    ({"workload": {"type": "entrypoint", "entrypoint": "pkg.mod:main\n"}},
     ("workload.entrypoint", "must look like 'package.module:function'")),
], ids=["name", "entrypoint"])
def test_patterns_match_the_whole_value(data, expected):
    """`re.match` with `$` lets a trailing newline through; a job name ends up in paths and labels."""
    assert problems_of(data) == [expected]


ABSOLUTE_RULE = "(in a job file, a relative path is taken from the file's folder)"


@pytest.mark.parametrize("directory, expected", [
    ("", "must not be empty; leave it out for the default"),
    ("   ", "must not be empty; leave it out for the default"),
    ("ckpt", f"must be an absolute path, got 'ckpt' {ABSOLUTE_RULE}"),
    ("./ckpt/../x", f"must be an absolute path, got './ckpt/../x' {ABSOLUTE_RULE}"),
    ("/tmp/a\0b", "must not contain NUL or line breaks, got '/tmp/a\\x00b'"),
    ("/tmp/a\nb", "must not contain NUL or line breaks, got '/tmp/a\\nb'"),
])
def test_checkpoint_directory_through_the_api(directory, expected):
    assert problems_of({"checkpoint": {"directory": directory}}) == [("checkpoint.directory", expected)]


def test_checkpoint_directory_in_a_file(tmp_path):
    assert JobSpec.from_yaml(write(tmp_path, "name: a\ncheckpoint: {directory: /abs/ckpt}\n")).checkpoint.directory \
        == "/abs/ckpt"
    assert problem(tmp_path, "name: a\ncheckpoint: {directory: ''}\n") == (
        "job.yaml: checkpoint.directory: must not be empty; leave it out for the default")
    assert problem(tmp_path, 'name: a\ncheckpoint: {directory: "ck\\0pt"}\n') == (
        "job.yaml: checkpoint.directory: must not contain NUL or line breaks, got 'ck\\x00pt'")


LE, GE = "Input should be less than or equal to", "Input should be greater than or equal to"
TOO_BIG = [  # (field path, a value just out of range, the message); the largest allowed ones pass below
    ("workload.seed", 2**32, f"{LE} 4294967295"),
    ("workload.steps", 10**9 + 1, f"{LE} 1000000000"),
    ("workload.seq_len", 2**17 + 1, f"{LE} 131072"),
    ("workload.global_batch_size", 2**20 + 1, f"{LE} 1048576"),
    ("workload.learning_rate.warmup_steps", 10**9 + 1, f"{LE} 1000000000"),
    ("workload.model.d_model", 2**16 + 1, f"{LE} 65536"),
    ("workload.model.d_ff", 2**18 + 1, f"{LE} 262144"),
    ("workload.model.n_layers", 1025, f"{LE} 1024"),
    ("workload.model.n_heads", 1025, f"{LE} 1024"),
    ("workload.model.n_kv_heads", 1025, f"{LE} 1024"),
    ("workload.model.vocab_size", 2**20 + 1, f"{LE} 1048576"),
    ("workload.model.moe_experts", 1025, f"{LE} 1024"),
    ("checkpoint.interval_steps", 10**9 + 1, f"{LE} 1000000000"),
    ("checkpoint.keep", 1001, f"{LE} 1000"),
    ("recovery.max_preemptions", 10**6 + 1, f"{LE} 1000000"),
    ("recovery.max_failures", 10**6 + 1, f"{LE} 1000000"),
    ("recovery.heartbeat_timeout_s", 30 * 86400 + 1, f"{LE} 2592000"),
    ("recovery.grace_period_s", 30 * 86400 + 1, f"{LE} 2592000"),
    ("recovery.start_timeout_s", 30 * 86400 + 1, f"{LE} 2592000"),
    ("priority", 1001, f"{LE} 1000"),
    ("priority", -1001, f"{GE} -1000"),
]


def nested(path: str, value) -> dict:
    """{"a": {"b": value}} for "a.b"; a workload also gets its type."""
    *parents, last = path.split(".")
    data: dict = {last: value}
    for key in reversed(parents):
        data = {key: data}
    if "workload" in data:
        data["workload"]["type"] = "lm"
    return data


@pytest.mark.parametrize("path, value, expected", TOO_BIG, ids=[f"{p}={v}" for p, v, _ in TOO_BIG])
def test_numbers_out_of_range_name_the_field_and_the_bound(path, value, expected):
    assert problems_of(nested(path, value)) == [(path, expected)]


@pytest.mark.parametrize("path, value", [
    ("workload.seed", 2**32 - 1), ("workload.steps", 10**9), ("checkpoint.keep", 1000),
    ("recovery.max_preemptions", 10**6), ("recovery.start_timeout_s", 30 * 86400), ("priority", -1000),
    ("priority", 1000), ("workload.model.vocab_size", 2**20),
])
def test_largest_values_allowed(path, value):
    JobSpec.from_dict({"name": "a", **nested(path, value)})


def test_tokens_a_step_must_fit_int32_indexing():
    (path, msg), = problems_of({"workload": {"type": "lm", "seq_len": 2**17, "global_batch_size": 2**14}})
    assert path == "workload.global_batch_size"
    assert msg == ("global_batch_size * (seq_len + 1) must be below 2**31 = 2,147,483,648 tokens a step "
                   "(int32 indexing), got 16384 * 131073 = 2,147,500,032")
    JobSpec.from_dict({"name": "a", "workload": {"type": "lm", "seq_len": 2**17, "global_batch_size": 2**13}})


def test_floats_must_be_finite():
    assert problems_of({"budget_usd": float("inf"), "recovery": {"grace_period_s": float("nan")}}) == [
        ("recovery.grace_period_s", "Input should be a finite number"),
        ("budget_usd", "Input should be a finite number")]


def test_queue_fields():
    spec = JobSpec.from_dict({"name": "a"})
    assert (spec.priority, spec.queue_timeout) == (0, None)
    spec = JobSpec.from_dict({"name": "a", "priority": 5, "queue_timeout": "PT30M"})
    assert (spec.priority, spec.queue_timeout.total_seconds()) == (5, 1800)
    assert JobSpec.from_dict(spec.model_dump(mode="json")) == spec  # as the controller receives it


@pytest.mark.parametrize("field", ["deadline", "queue_timeout"])
@pytest.mark.parametrize("value, shown", [("PT0S", "0:00:00"), ("-PT1H", "-1 day, 23:00:00")])
def test_durations_must_be_positive(field, value, shown):
    assert problems_of({field: value}) == [
        (field, f"must be a positive duration, e.g. 'PT12H' or '12:00:00', got {shown}")]


# -- training settings: precision, remat, gradient accumulation, kernel blocks -----------------------


def lm(**fields) -> dict:
    return {"workload": {"type": "lm", **fields}}


@pytest.mark.parametrize("kind", ["lm", "entrypoint"])
def test_training_settings_are_accepted_on_both_workloads(kind):
    extra = {"entrypoint": "pkg.mod:main"} if kind == "entrypoint" else {}
    w = JobSpec.from_dict({"name": "a", "workload": {
        "type": kind, **extra, "precision": {"compute": "bfloat16", "params": "float32"},
        "remat": "dots_with_no_batch_dims_saveable", "gradient_accumulation": 2,
        "kernel_blocks": {"attention": {"block_q": 512, "block_kv": 1024, "block_q_bwd": 256,
                                        "block_kv_bwd": 512}}}}).workload
    assert ((w.precision.compute, w.remat, w.gradient_accumulation)
            == ("bfloat16", "dots_with_no_batch_dims_saveable", 2))
    assert (w.kernel_blocks.attention.block_q, w.kernel_blocks.attention.block_kv_bwd) == (512, 512)
    assert JobSpec.from_dict({"name": "a", "workload": w.model_dump(mode="json")}).workload == w  # as stored


def test_kernel_blocks_are_what_the_kernels_take():
    from kernels.blocks import KernelBlocks

    w = JobSpec.from_dict({"name": "a", **lm(kernel_blocks={"attention": {"block_q": 1024, "block_kv_bwd": 256}})})
    blocks = KernelBlocks.from_mapping(w.workload.kernel_blocks.model_dump(exclude_none=True))
    assert (blocks.attention.block_q, blocks.attention.block_kv_bwd) == (1024, 256)


def test_training_settings_defaults():
    w = JobSpec.from_dict({"name": "a"}).workload
    assert (w.precision.compute, w.precision.params, w.remat, w.gradient_accumulation, w.kernel_blocks) == (
        "auto", "float32", "none", "auto", None)


@pytest.mark.parametrize("platform, dtype", [("cpu", "float32"), ("tpu", "bfloat16"), ("gpu", "bfloat16")])
def test_auto_precision_is_bfloat16_on_accelerators_and_float32_on_cpu(platform, dtype):
    assert JobSpec.from_dict({"name": "a"}).workload.precision.compute_dtype(platform) == dtype
    forced = JobSpec.from_dict({"name": "a", **lm(precision={"compute": "float32"})}).workload.precision
    assert forced.compute_dtype(platform) == "float32"


MICROBATCH_RULE = "must be a whole number of microbatches from 1 to 1,048,576, or 'auto', got"


@pytest.mark.parametrize("fields, expected", [
    ({"precision": {"params": "bfloat16"}},
     ("workload.precision.params", "must be float32, got 'bfloat16': master parameters and optimizer state stay "
      "float32 (bfloat16 ones drop updates smaller than 1/256 of a weight); compute: bfloat16 runs the matmuls in "
      "bfloat16")),
    ({"precision": {"compute": "float16"}},
     ("workload.precision.compute", "Input should be 'auto', 'bfloat16' or 'float32'")),
    ({"remat": "save_only_these_names"},
     ("workload.remat", "Input should be 'none', 'full', 'dots_saveable', 'dots_with_no_batch_dims_saveable', "
      "'checkpoint_dots', 'checkpoint_dots_with_no_batch_dims', 'nothing_saveable' or 'everything_saveable'")),
    ({"gradient_accumulation": 0}, ("workload.gradient_accumulation", f"{MICROBATCH_RULE} 0")),
    ({"gradient_accumulation": True}, ("workload.gradient_accumulation", f"{MICROBATCH_RULE} True")),
    ({"gradient_accumulation": "2"}, ("workload.gradient_accumulation", f"{MICROBATCH_RULE} '2'")),
    ({"gradient_accumulation": 1.5}, ("workload.gradient_accumulation", f"{MICROBATCH_RULE} 1.5")),
    ({"gradient_accumulation": 3},
     ("workload.gradient_accumulation", "3 microbatches do not divide the 4 rows each batch shard gets on v4-8 "
      "(global_batch_size 16 over data*fsdp=4); use a divisor of 4 or 'auto'")),
    ({"kernel_blocks": {"attention": {"block_q": 100}}},
     ("workload.kernel_blocks.attention.block_q", "Input should be a multiple of 8")),
    ({"kernel_blocks": {"attention": {"block_kv_bwd": 0}}},
     ("workload.kernel_blocks.attention.block_kv_bwd", "Input should be greater than 0")),
    ({"kernel_blocks": {"attention": {"block_size": 128}}},
     ("workload.kernel_blocks.attention.block_size", "unknown key")),
], ids=["params-bf16", "compute", "remat", "ga-0", "ga-bool", "ga-str", "ga-float", "ga-divides", "block-8",
        "block-0", "block-key"])
def test_training_settings_refused(fields, expected):
    (path, msg), = problems_of(lm(**fields))
    assert (path, msg.split("; allowed keys")[0]) == expected


def test_entrypoint_microbatches_must_divide_its_rows():
    assert problems_of({"workload": {"type": "entrypoint", "entrypoint": "m:f", "global_batch_size": 8,
                                     "gradient_accumulation": 4}}) == [
        ("workload.gradient_accumulation",
         "4 microbatches do not divide the 2 rows each batch shard gets on v4-8; use a divisor of 2 or 'auto'")]


# -- job-file hardening --------------------------------------------------------------------------------


@pytest.mark.parametrize("text, path, lines", [
    ("name: a\nname: b\n", "name", (1, 2)),
    ("name: a\nworkload:\n  type: lm\n  steps: 10\n  seq_len: 8\n  steps: 20\n", "workload.steps", (4, 6)),
    ("name: a\nworkload: {type: lm, model: {d_model: 64,\n  d_model: 32}}\n", "workload.model.d_model", (2, 3)),
    ("name: a\nworkload: {type: lm, mesh: {data: 1, data: 2}}\n", "workload.mesh.data", (2, 2)),
    ("name: a\nautoscaling:\n  tiers: [spot]\n  tiers: [on-demand]\n", "autoscaling.tiers", (3, 4)),
    ("name: a\ngcp: {project: p, zones: [{x: 1, x: 2}]}\n", "gcp.zones.0.x", (2, 2)),
], ids=["top", "nested", "flow", "same-line", "list-value", "in-a-list"])
def test_duplicate_keys_name_the_key_and_both_lines(tmp_path, text, path, lines):
    key = path.rsplit(".", 1)[-1]
    assert problem(tmp_path, text) == (
        f"job.yaml: {path}: duplicate key {key!r} at lines {lines[0]} and {lines[1]} (YAML would silently keep the "
        "last); give it once")


def test_merge_keys_and_anchors_still_load(tmp_path):
    """A merge key's mapping may be overridden (YAML's intent); an alias is walked once."""
    spec = JobSpec.from_yaml(write(tmp_path, "name: a\nrecovery: &r {max_failures: 3}\n"
                                             "checkpoint: {<<: {keep: 2, interval_steps: 5}, keep: 4}\n"))
    assert (spec.checkpoint.keep, spec.checkpoint.interval_steps, spec.recovery.max_failures) == (4, 5, 3)


@pytest.mark.parametrize("size", [2**20 + 1, 50 * 10**6])
def test_job_files_over_1_mib_are_refused_before_parsing(tmp_path, size):
    path = tmp_path / "job.yaml"
    with path.open("w") as f:
        f.write("name: a\n# ")
        f.truncate(size)  # a sparse file: its size without writing it all
    started = time.perf_counter()
    with pytest.raises(SpecError) as info:
        JobSpec.from_yaml(path)
    assert time.perf_counter() - started < 1.0
    assert str(info.value) == f"{path}: job file is {size:,} bytes; the limit is 1 MiB (1,048,576 bytes)"


def test_a_job_file_of_exactly_1_mib_loads(tmp_path):
    text = "name: a\n"
    path = write(tmp_path, text + "#" * (2**20 - len(text) - 1) + "\n")
    assert path.stat().st_size == 2**20 and JobSpec.from_yaml(path).name == "a"


def test_warmup_must_not_exceed_the_steps():
    assert problems_of(lm(steps=5, learning_rate={"warmup_steps": 6})) == [
        ("workload.learning_rate.warmup_steps", "must be at most workload.steps=5, got 6")]
    JobSpec.from_dict({"name": "a", **lm(steps=5, learning_rate={"warmup_steps": 5})})


def test_autoscaling_needs_a_deadline():
    assert problems_of({"autoscaling": {"accelerators": ["v4-8", "v4-16"]}}) == [
        ("deadline", "autoscaling needs a deadline (e.g. deadline: PT24H): the cost policy weighs each slice's "
                     "cost against the time left")]
    JobSpec.from_dict({"name": "a", "autoscaling": {"accelerators": ["v4-8", "v4-16"]}, "deadline": "PT2H"})


def duration_fields(model=JobSpec, prefix="") -> list[str]:
    """Every field of the spec that is a duration: a timedelta, or a number of seconds (`*_s`)."""
    found = []
    for name, field in model.model_fields.items():
        args = typing.get_args(field.annotation) or (field.annotation,)
        for arg in args:
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                found += duration_fields(arg, f"{prefix}{name}.")
        if dt.timedelta in args or name.endswith("_s"):
            found.append(prefix + name)
    return found


POSITIONS = {"capacity_trace.start_s"}  # a point in a trace, not a length of time: 0 is its start


@pytest.mark.parametrize("path", duration_fields())
@pytest.mark.parametrize("value", [-1, 0])
def test_every_duration_must_be_positive(path, value):
    """Whatever durations the spec has or gains: none may be zero or negative."""
    if value == 0 and path in POSITIONS:
        return
    data = nested(path, value)
    if path.startswith("capacity_trace."):
        data["capacity_trace"]["path"] = str(REPO / "policies/evaluation/traces/availability/1-node/aws-02-15-2023/"
                                             "us-west-2a_v100_1.json")
    problems = problems_of(data)
    assert [p for p, _ in problems] == [path], problems


def test_duration_fields_are_found():
    assert {"deadline", "queue_timeout", "recovery.heartbeat_timeout_s", "recovery.grace_period_s"} <= set(
        duration_fields())


@pytest.mark.parametrize("text", [
    "name: a\nworkload: {type: lm, seq_len: 1e11, global_batch_size: 1e9}\n",
    "name: a\nworkload: {type: lm, seq_len: 100000000000, global_batch_size: 1000000000}\n",
    "name: a\nworkload: {type: lm, seq_len: 1.0e+11, global_batch_size: 1.0e+9}\n",
])
def test_absurd_sequence_and_batch_fail_at_validation_at_once(tmp_path, text):
    started = time.perf_counter()
    msg = problem(tmp_path, text)
    assert time.perf_counter() - started < 1.0
    assert msg.splitlines()[0].startswith("job.yaml: workload.seq_len: ")
    assert msg.splitlines()[1].startswith("job.yaml: workload.global_batch_size: ")


# -- the memory-fit check -------------------------------------------------------------------------------

HUGE = {"d_model": 65536, "n_layers": 1024, "n_heads": 64, "d_ff": 262144, "vocab_size": 2**20}


def test_an_absurd_model_is_refused_with_the_figures_in_under_a_second():
    started = time.perf_counter()
    (path, msg), = problems_of({"accelerator": "v4-8", **lm(model=HUGE, seq_len=2**17, global_batch_size=4)})
    assert time.perf_counter() - started < 1.0
    assert path == "accelerator"
    assert re.fullmatch(
        r"v4-8: training needs [\d.]+ GiB per chip but 28\.8 GiB is usable \(90% of 32\.0 GiB HBM\), with 1 "
        r"microbatch of 131,072 tokens a chip; (\w| )+ dominate \(GiB: parameters [\d.]+, compute copy [\d.]+, "
        r"gradients [\d.]+, optimizer state [\d.]+, activations [\d.]+, logits [\d.]+\); alternatives: remat: full: "
        r"[\d.]+ GiB \(still too much\); mesh: \{data: 1, fsdp: 4\}: [\d.]+ GiB \(still too much\); remat: full and "
        r"mesh: \{data: 1, fsdp: 4\}: [\d.]+ GiB \(still too much\); a slice with more chips", msg), msg


def test_every_slice_autoscaling_may_choose_is_checked():
    """8.3B parameters, fully sharded: 16 bytes of model state a parameter (+2 for the bfloat16 copy) over 8
    chips fit a v4 chip's HBM, over 4 (a v4-8) they do not, whatever the microbatch count."""
    model = {"d_model": 4096, "n_layers": 40, "n_heads": 32, "d_ff": 16384, "vocab_size": 32000}
    job = {"accelerator": "v4-32", "deadline": "PT24H", **lm(model=model, seq_len=2048, global_batch_size=256,
                                                             mesh={"data": 1, "fsdp": -1}, remat="full")}
    JobSpec.from_dict({"name": "a", **job, "autoscaling": {"accelerators": ["v4-16", "v4-64"]}})
    problems = problems_of({**job, "autoscaling": {"accelerators": ["v4-8", "v4-16"]}})
    assert [(p, m.split(":")[0]) for p, m in problems] == [("autoscaling.accelerators", "v4-8")]
    assert problems[0][1].endswith("alternatives: a slice with more chips")  # remat, accumulation, fsdp: all in use


def test_remat_and_accumulation_change_the_verdict():
    model = {"d_model": 2048, "n_layers": 24, "n_heads": 16, "d_ff": 8192, "vocab_size": 32000}
    base = {"accelerator": "v4-32", **lm(model=model, seq_len=2048, global_batch_size=256,
                                         mesh={"data": 1, "fsdp": -1}, gradient_accumulation=1)}
    (path, msg), = problems_of(base)
    assert path == "accelerator" and "activations dominate" in msg
    for change in ({"remat": "full"}, {"gradient_accumulation": 8}, {"gradient_accumulation": "auto"}):
        JobSpec.from_dict({"name": "a", **{**base, "workload": {**base["workload"], **change}}})


def test_microbatches_resolved_per_slice():
    model = {"d_model": 2048, "n_layers": 24, "n_heads": 16, "d_ff": 8192, "vocab_size": 32000}
    spec = JobSpec.from_dict({"name": "a", "accelerator": "v4-16", **lm(model=model, seq_len=2048,
                                                                         global_batch_size=256,
                                                                         mesh={"data": 1, "fsdp": -1})})
    counts = {t: microbatches_for(spec, t) for t in ("v4-16", "v4-32", "v4-64")}
    assert counts["v4-16"] > counts["v4-32"] > counts["v4-64"] >= 1  # more chips: fewer rows each
    assert microbatches_for(JobSpec.from_dict({"name": "a"}), "v4-8") == 1
    assert microbatches_for(JobSpec.from_dict({"name": "a", **lm(gradient_accumulation=2)}), "v4-8") == 2


def test_a_vocabulary_below_the_default_bytes_is_refused():
    with pytest.raises(SpecError) as e:
        JobSpec.from_dict({"name": "v", "workload": {"type": "lm", "model": {"vocab_size": 100}}})
    assert "workload.model.vocab_size" in str(e.value) and "at least 256" in str(e.value)


# -- where a job's files are: local folders and Cloud Storage -------------------------------------------

GCP = {"provider": "gcp", "gcp": {"project": "p", "zones": ["z"]}}
BUCKET_RULE = ("use 3 to 63 lowercase letters, digits, dashes, underscores and dots (up to 222 with dots, at most 63 "
               "between two), starting and ending with a letter or digit")


def test_a_bucket_folder_is_a_checkpoint_directory_on_either_provider():
    local = JobSpec.from_dict({"name": "a", "checkpoint": {"directory": "gs://my-bucket/runs/a/"},
                               "storage": {"endpoint": "http://127.0.0.1:8471/"}})
    assert local.checkpoint.directory == "gs://my-bucket/runs/a" and local.storage.endpoint == "http://127.0.0.1:8471"
    gcp = JobSpec.from_dict({"name": "a", **GCP, "checkpoint": {"directory": "gs://my-bucket/runs/a"}})
    assert gcp.checkpoint.directory == "gs://my-bucket/runs/a" and gcp.storage.endpoint is None


def test_default_checkpoint_directory_per_provider(tmp_path):
    gcp = JobSpec.from_dict({"name": "tiny", **GCP, "gcp": {**GCP["gcp"], "bucket": "my-bucket"}})
    assert gcp.with_checkpoint_directory(tmp_path).checkpoint.directory == "gs://my-bucket/checkpoints/tiny"
    local = JobSpec.from_dict({"name": "tiny", "gcp": {**GCP["gcp"], "bucket": "my-bucket"}})
    assert local.with_checkpoint_directory(tmp_path / "tiny").checkpoint.directory == str(tmp_path / "tiny")
    given = JobSpec.from_dict({"name": "tiny", "checkpoint": {"directory": "gs://other/x"}})
    assert given.with_checkpoint_directory(tmp_path).checkpoint.directory == "gs://other/x"


@pytest.mark.parametrize("directory, expected", [
    ("gs://Bad_Bucket/x", f"'gs://Bad_Bucket/x': 'Bad_Bucket' is not a bucket name: {BUCKET_RULE}"),
    ("gs://ab/x", f"'gs://ab/x': 'ab' is not a bucket name: {BUCKET_RULE}"),
    ("gs://my-google-bucket/x", "'gs://my-google-bucket/x': 'my-google-bucket' is not a bucket name: it may not "
                                "start with 'goog' or contain 'google'"),
    ("gs://10.0.0.1/x", "'gs://10.0.0.1/x': '10.0.0.1' is not a bucket name: it may not be an IP address"),
    ("gs://my-bucket", "must name a folder inside the bucket, e.g. gs://my-bucket/checkpoints/my-job, got "
                       "'gs://my-bucket'"),
    ("gs://my-bucket/a/../b", "'gs://my-bucket/a/../b': no empty, '.' or '..' parts between slashes (a bucket "
                              "takes them literally)"),
    ("gs://my-bucket/a//b", "'gs://my-bucket/a//b': no empty, '.' or '..' parts between slashes (a bucket takes "
                            "them literally)"),
    ("gs://my-bucket/run*", "'gs://my-bucket/run*': a Cloud Storage folder here may not contain spaces, control "
                            "characters or * ? [ ] # \\ (got '*')"),
    ("s3://my-bucket/x", "must be an absolute path or a Cloud Storage URL gs://BUCKET/FOLDER, got 's3://my-bucket/x'"),
    ("file:///tmp/x", "must be an absolute path or a Cloud Storage URL gs://BUCKET/FOLDER, got 'file:///tmp/x'"),
])
def test_bad_bucket_folders_name_the_field(directory, expected):
    assert problems_of({"checkpoint": {"directory": directory}}) == [("checkpoint.directory", expected)]


def test_a_url_in_a_job_file_is_never_taken_as_a_relative_path(tmp_path):
    spec = JobSpec.from_yaml(write(tmp_path, "name: a\ncheckpoint: {directory: 'gs://my-bucket/ck'}\n"
                                             "workload: {type: lm, data: {path: 'gs://my-bucket/tokens'}}\n"))
    assert spec.checkpoint.directory == "gs://my-bucket/ck" and spec.workload.data.path == "gs://my-bucket/tokens"
    assert problem(tmp_path, "name: a\ncheckpoint: {directory: 'gs:/my-bucket/ck'}\n") == (
        "job.yaml: checkpoint.directory: must be an absolute path or a Cloud Storage URL gs://BUCKET/FOLDER, got "
        "'gs:/my-bucket/ck'")
    assert problem(tmp_path, "name: a\nworkload: {type: lm, data: {path: 'gs:my-bucket/tokens'}}\n") == (
        "job.yaml: workload.data.path: looks like a URL but has no '://' (e.g. gs://BUCKET/FOLDER), got "
        "'gs:my-bucket/tokens' (a relative path that starts with a word and a colon: write ./ in front)")
    spec = JobSpec.from_yaml(write(tmp_path, "name: a\ncheckpoint: {directory: './ck:1'}\n"))
    assert spec.checkpoint.directory == str((tmp_path / "ck:1").resolve())


def test_gcp_keeps_every_shared_file_in_a_bucket():
    no_disk = "TPU VMs share no disk with"
    assert problems_of({**GCP}) == [("checkpoint.directory", (
        "provider gcp keeps checkpoints in Cloud Storage (TPU VMs share no disk with this machine): set "
        "checkpoint.directory to gs://BUCKET/FOLDER, or gcp.bucket to a bucket for the default "
        "gs://BUCKET/checkpoints/a"))]
    assert problems_of({**GCP, "checkpoint": {"directory": "/data/ck"}}) == [("checkpoint.directory", (
        f"'/data/ck' is on this machine, and {no_disk} it; use gs://BUCKET/FOLDER (or leave it out and set "
        "gcp.bucket)"))]
    with_bucket = {**GCP, "gcp": {**GCP["gcp"], "bucket": "my-bucket"}}
    for path in ("/data/tokens", "memory://tokens", "file:///data/tokens"):
        assert problems_of({**with_bucket, "workload": {"type": "lm", "data": {"path": path}}}) == [(
            "workload.data.path", f"{path!r} is not in Cloud Storage, and {no_disk} this machine; put the token "
                                  "files in a bucket (orchestrator data prepare SRC -o gs://BUCKET/FOLDER) "
                                  "and name that")]
    JobSpec.from_dict({"name": "a", **with_bucket, "workload": {"type": "lm", "data": {"path": "gs://my-bucket/t"}}})


@pytest.mark.parametrize("data, field, expected", [
    ({"gcp": {"project": "p", "zones": ["z"], "bucket": "gs://my-bucket"}}, "gcp.bucket",
     "must be a bucket's name without gs://, got 'gs://my-bucket'"),
    ({"gcp": {"project": "p", "zones": ["z"], "bucket": "My-Bucket"}}, "gcp.bucket",
     f"'My-Bucket' is not a bucket name: {BUCKET_RULE}"),
    ({"storage": {"endpoint": "127.0.0.1:8471"}}, "storage.endpoint",
     "must be an http:// or https:// URL like http://127.0.0.1:8471, got '127.0.0.1:8471'"),
    ({"storage": {"endpoint": "http://127.0.0.1:8471/storage/v1"}}, "storage.endpoint",
     "must be a scheme, host and port only (no path, query or credentials), got 'http://127.0.0.1:8471/storage/v1'"),
    ({"storage": {"endpoint": "http://127.0.0.1:99999"}}, "storage.endpoint",
     "has a port that is not a number from 0 to 65535, got 'http://127.0.0.1:99999'"),
    ({"storage": {"bucket": "x"}}, "storage.bucket", "unknown key; allowed keys here: endpoint"),
])
def test_bad_storage_settings_name_the_field(data, field, expected):
    assert problems_of(data) == [(field, expected)]


def test_the_storage_endpoint_reaches_the_hosts():
    from orchestrator.control.launch import launch_order

    spec = JobSpec.from_dict({"name": "a", "checkpoint": {"directory": "gs://my-bucket/a"},
                              "storage": {"endpoint": "http://127.0.0.1:8471"}})
    order = launch_order(spec, 4, 1)
    assert (order.storage_endpoint, order.fence_dir, order.settings.checkpoint_dir) == (
        "http://127.0.0.1:8471", "gs://my-bucket/a", "gs://my-bucket/a")


def test_an_entrypoint_folders_requirements_are_checked_with_the_job_file(tmp_path):
    (tmp_path / "train.py").write_text("def main(ctx): pass\n")
    job = tmp_path / "job.yaml"
    job.write_text("name: a\nworkload: {type: entrypoint, entrypoint: 'train:main'}\n")
    (tmp_path / "requirements.txt").write_text("inflection==0.5.1\nflax>=0.12; python_version >= '3.10'\n")
    assert JobSpec.from_yaml(job).workdir == str(tmp_path)
    (tmp_path / "requirements.txt").write_text("inflection\n--extra-index-url https://example.com/simple\n")
    with pytest.raises(SpecError) as info:
        JobSpec.from_yaml(job)
    assert str(info.value) == (f"{job}: workdir requirements.txt: line 2: '--extra-index-url "
                               "https://example.com/simple' is a pip option; only packages by name are taken (the "
                               "hosts install from their package index, pinned to the project's versions)")
