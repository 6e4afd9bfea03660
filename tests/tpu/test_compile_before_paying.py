"""Compile before paying, as a user meets it: `orchestrator validate|plan|submit --compile`.

XLA's TPU compiler answers for every slice the job may use whether its step compiles and fits,
and how fast it could go; a job that does not fit is refused with the compiler's figure (exit 2)
before anything is created, and a second look at the same job reads the kept reports.
"""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from orchestrator.state.store import Store
from orchestrator.user.cli import app

SMALL = """\
name: small
accelerator: v4-16
workload:
  type: lm
  model: {d_model: 256, n_layers: 2, n_heads: 4, d_ff: 512}
  seq_len: 256
  global_batch_size: 32
  steps: 100
  precision: {compute: auto}
autoscaling: {accelerators: [v4-16, v4-32], max_slices: 2}
deadline: PT4H
"""

# One layer whose embeddings alone (2 x 131072 x 8192 float32 parameters, with AdamW's moments, about 32 GiB)
# are beyond a v4 chip's HBM on every chip of a data-parallel mesh; quick to compile.
TOO_BIG = """\
name: too-big
accelerator: v4-8
workload:
  type: lm
  model: {d_model: 8192, n_layers: 1, n_heads: 64, d_ff: 8192, vocab_size: 131072}
  seq_len: 128
  global_batch_size: 8
  steps: 10
  mesh: {data: -1, fsdp: 1, model: 1}
"""


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("ORCHESTRATOR_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("COLUMNS", "160")
    return tmp_path / "home"


def job_file(tmp_path, text: str):
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return path


def rows(output: str) -> dict[str, list[str]]:
    """The compiler's table: slice label -> its cells."""
    found = {}
    for line in output.splitlines():
        cells = [c.strip() for c in re.split(r"[│┃]", line)[1:-1]]
        if cells and re.fullmatch(r"(\d x )?v4-\d+", cells[0]):
            found[cells[0]] = cells[1:]
    return found


def test_validate_compiles_every_option_and_a_second_look_reads_the_kept_reports(tmp_path, home):
    path = job_file(tmp_path, SMALL)
    first = CliRunner().invoke(app, ["validate", str(path), "--compile"])
    assert first.exit_code == 0, first.output
    table = rows(first.stdout)
    assert set(table) == {"v4-16", "v4-32", "2 x v4-16", "2 x v4-32"}, first.stdout
    for label, (compiles, hbm, usable, fits, compile_s, step_ms, tokens_s, mfu) in table.items():
        assert (compiles, fits, usable) == ("yes", "yes", "28.8"), (label, table[label])
        assert 0 < float(hbm) < 1 and float(compile_s) > 0 and float(step_ms) > 0
        assert float(tokens_s.replace(",", "")) > 0 and 0 < int(mfu.rstrip("%")) <= 100
    assert "[4/4] compiling the train step for 2 x v4-32" in first.stderr
    assert "valid (v4-16: 8 chips on 2 hosts, spot)" in first.stdout

    again = CliRunner().invoke(app, ["validate", str(path), "--compile"])
    assert again.exit_code == 0, again.output
    kept = rows(again.stdout)
    assert all(cells[4] == "kept" for cells in kept.values()), again.stdout
    assert {k: v[:4] for k, v in kept.items()} == {k: v[:4] for k, v in table.items()}


def test_submit_refuses_a_job_the_compiler_says_does_not_fit_and_creates_nothing(tmp_path, home):
    r = CliRunner().invoke(app, ["submit", str(job_file(tmp_path, TOO_BIG)), "--compile"])
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, r.stderr
    # The compiler plans every buffer of the step and stops when they exceed the chip's HBM.
    found = re.search(r"accelerator: v4-8: training does not fit: the TPU compiler says: Ran out of memory on HBM.*"
                      r"\(([\d.]+)G\) exceeds available HBM \(([\d.]+)G\)", errors[0])
    assert found, errors[0]
    assert float(found.group(1)) > float(found.group(2)) > 28
    assert not (home / "cluster.json").exists()
    assert not (home / "state.db").exists() or Store(home / "state.db").jobs() == []


def test_a_program_of_the_user_s_own_is_told_why_it_cannot_be_compiled_ahead(tmp_path, home):
    text = "name: mine\nworkload: {type: entrypoint, entrypoint: 'train:main'}\n"
    r = CliRunner().invoke(app, ["validate", str(job_file(tmp_path, text)), "--compile"])
    assert r.exit_code == 2, r.output
    assert "runs its own program, whose step is not known before it runs" in r.stderr
