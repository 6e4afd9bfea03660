"""Bad job files as a user meets them: `orchestrator submit bad.yaml` prints one `error:` line naming the file
and the field, exits 2 and creates nothing; `orchestrator plan` shows the memory each slice would need."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from orchestrator.state.store import Store
from orchestrator.user.cli import app

HUGE_MODEL = "{d_model: 65536, n_layers: 1024, n_heads: 64, d_ff: 262144, vocab_size: 1048576}"
CASES = {  # job file -> (field, the message's start)
    "duplicate key": ("name: a\nworkload:\n  type: lm\n  steps: 10\n  steps: 20\n",
                      "workload.steps", "duplicate key 'steps' at lines 4 and 5"),
    "negative deadline": ("name: a\ndeadline: -PT1H\n", "deadline", "must be a positive duration"),
    "negative deadline in seconds": ("name: a\ndeadline: -3600\n", "deadline", "must be a positive duration"),
    "warmup beyond steps": ("name: a\nworkload: {type: lm, steps: 10, learning_rate: {warmup_steps: 11}}\n",
                            "workload.learning_rate.warmup_steps", "must be at most workload.steps=10, got 11"),
    "autoscaling without deadline": ("name: a\nautoscaling: {accelerators: [v4-8, v4-16]}\n",
                                     "deadline", "autoscaling needs a deadline"),
    "absurd model": (f"name: a\nworkload: {{type: lm, model: {HUGE_MODEL}, seq_len: 131072, global_batch_size: 4}}\n",
                     "accelerator", "v4-8: training needs "),
    "bf16 master weights": ("name: a\nworkload: {type: lm, precision: {params: bfloat16}}\n",
                            "workload.precision.params", "must be float32, got 'bfloat16'"),
    "unknown remat": ("name: a\nworkload: {type: lm, remat: sometimes}\n", "workload.remat", "Input should be 'none'"),
}


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("ORCHESTRATOR_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def assert_nothing_created(home):
    assert not (home / "state.db").exists() or Store(home / "state.db").jobs() == []
    assert not (home / "cluster.json").exists()


@pytest.mark.parametrize("case", list(CASES))
def test_submit_of_a_bad_job_file_is_one_error_line_and_exit_2(tmp_path, home, case):
    text, field, start = CASES[case]
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    r = CliRunner().invoke(app, ["submit", str(path)])
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output and r.stdout == ""
    lines = [line for line in r.stderr.splitlines() if line]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"error: {path}: {field}: {start}"), lines[0]
    assert_nothing_created(home)


def test_submit_of_a_job_file_over_1_mib_is_refused_before_reading_it(tmp_path, home):
    path = tmp_path / "big.yaml"
    with path.open("w") as f:
        f.write("name: a\n# ")
        f.truncate(50 * 10**6)
    r = CliRunner().invoke(app, ["submit", str(path)])
    assert r.exit_code == 2
    assert r.stderr.splitlines() == [f"error: {path}: job file is 50,000,000 bytes; "
                                     "the limit is 1 MiB (1,048,576 bytes)"]
    assert_nothing_created(home)


def test_plan_shows_the_memory_each_candidate_slice_needs(tmp_path, home):
    path = tmp_path / "job.yaml"
    path.write_text("name: big\naccelerator: v4-32\ndeadline: PT36H\n"
                    "workload: {type: lm, steps: 100, seq_len: 2048, global_batch_size: 256, mesh: {data: 1, fsdp: -1},"
                    " model: {d_model: 2048, n_layers: 24, n_heads: 16, d_ff: 8192, vocab_size: 32000}}\n"
                    "autoscaling: {accelerators: [v4-16, v4-32, v4-64], tiers: [spot]}\n")
    r = CliRunner().invoke(app, ["plan", str(path)], terminal_width=160)
    assert r.exit_code == 0, r.output
    rows = {line.split()[1]: line.split() for line in r.stdout.splitlines()
            if line.startswith("│ v4-") and "x" in line.split()[3]}
    assert set(rows) == {"v4-16", "v4-32", "v4-64"}
    assert [rows[t][3] for t in ("v4-16", "v4-32", "v4-64")] == ["1x8x1", "1x16x1", "1x32x1"]  # data x fsdp x model
    needs = [float(rows[t][7]) for t in ("v4-16", "v4-32", "v4-64")]
    assert needs[0] > needs[1] > needs[2] and all(float(rows[t][9]) == 28.8 for t in rows)
    assert all(rows[t][-2] == "yes" for t in rows)
    assert_nothing_created(home)


def test_plan_with_max_slices_prices_several_slices_of_each_type(tmp_path, home):
    path = tmp_path / "job.yaml"
    path.write_text("name: many\naccelerator: v4-16\ndeadline: PT36H\n"
                    "workload: {type: lm, steps: 2000, seq_len: 2048, global_batch_size: 256,"
                    " mesh: {data: 1, fsdp: -1},"
                    " model: {d_model: 2048, n_layers: 24, n_heads: 16, d_ff: 8192, vocab_size: 32000}}\n"
                    "autoscaling: {accelerators: [v4-16, v4-32], tiers: [spot], max_slices: 2}\n")
    r = CliRunner().invoke(app, ["plan", str(path)], terminal_width=160)
    assert r.exit_code == 0, r.output
    options = [line.split()[1] for line in r.stdout.splitlines() if line.startswith("│ ") and " spot " in line]
    assert options[:4] == ["v4-16", "v4-32", "2xv4-16", "2xv4-32"], r.stdout  # 2 x v4-32: 32 chips, the most
    assert_nothing_created(home)


# -- an entrypoint that cannot be imported: refused at submit, before any slice -----------------

ENTRYPOINTS = {  # files in the job's folder, the entrypoint -> the problem
    "no module": ({}, "train:main", "no module 'train' in the job's folder {folder} (neither train.py nor "
                                    "train/__init__.py)"),
    "no package": ({}, "pkg.train:main", "no module 'pkg.train' in the job's folder {folder} (neither "
                                         "pkg/train.py nor pkg/train/__init__.py)"),
    "no function": ({"train.py": "def mian(ctx):\n    pass\n"}, "train:main",
                    "module 'train' ({folder}/train.py) defines no 'main'"),
    "syntax error": ({"train.py": "def main(ctx)\n    pass\n"}, "train:main",
                     "{folder}/train.py, line 1: expected ':'"),
}


@pytest.mark.parametrize("case", list(ENTRYPOINTS))
def test_submit_refuses_an_entrypoint_that_cannot_be_imported(tmp_path, home, case):
    files, entrypoint, problem = ENTRYPOINTS[case]
    folder = tmp_path / "job"
    folder.mkdir()
    for name, text in files.items():
        (folder / name).write_text(text)
    path = folder / "job.yaml"
    path.write_text(f"name: a\nworkload: {{type: entrypoint, entrypoint: '{entrypoint}', steps: 5}}\n")
    r = CliRunner().invoke(app, ["submit", str(path)])
    assert (r.exit_code, r.stdout) == (2, ""), r.output
    assert r.stderr.splitlines() == [f"error: {path}: workload.entrypoint: {entrypoint}: "
                                     f"{problem.format(folder=folder)}"]
    assert_nothing_created(home)


@pytest.mark.parametrize("files, entrypoint", [
    ({"train.py": "from helpers import *\n"}, "train:main"),  # names a parse cannot see: left to the hosts
    ({"train.py": "import sys\nif sys.version_info >= (3,):\n    def main(ctx): pass\n"}, "train:main"),
    ({"train.py": "main = lambda ctx: None\n"}, "train:main"),
    ({"pkg/__init__.py": "", "pkg/train.py": "from .impl import main\n"}, "pkg.train:main"),
    ({"pkg/train.py": "def main(ctx): pass\n"}, "pkg.train:main"),  # a namespace package
    ({}, "json:loads"),  # installed here (the standard library)
])
def test_an_entrypoint_found_or_not_knowable_here_passes(tmp_path, files, entrypoint):
    from orchestrator.user.entrypoint import entrypoint_problem

    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert entrypoint_problem(tmp_path, entrypoint) is None
    assert entrypoint_problem(tmp_path / "not-on-this-machine", "train:main") is None


def test_the_examples_entrypoint_passes():
    from pathlib import Path

    from orchestrator.domain.spec import JobSpec
    from orchestrator.user.entrypoint import check_entrypoint

    check_entrypoint(JobSpec.from_yaml(Path(__file__).resolve().parents[2] / "examples" / "user-train" / "job.yaml"))
