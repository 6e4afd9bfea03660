"""Job spec validation: valid files load; every kind of bad input gets one exact message."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.errors import SpecError
from orchestrator.user.spec import JobSpec, LmWorkload, json_schema

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
