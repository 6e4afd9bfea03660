"""Job spec validation: valid files load; every kind of bad input gets one exact message."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.errors import SpecError
from orchestrator.spec import JobSpec, LmWorkload, json_schema

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
                    "job.yaml: bogus: unknown key; allowed keys here: name, accelerator, tier, provider, zone, gcp, "
                    "workload, checkpoint, recovery, autoscaling, budget_usd, deadline"),
    "nested unknown key": ("name: a\nworkload: {type: lm, modle: {}}\n",
                           "job.yaml: workload.modle: unknown key; allowed keys here: type, model, seq_len, "
                           "global_batch_size, steps, learning_rate, seed, mesh, kernels"),
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
