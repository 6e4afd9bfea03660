"""Compile before paying, as a user meets it: `orchestrator validate|plan|submit --compile`.

XLA's TPU compiler answers for every slice the job may use whether its step compiles and fits,
and how fast it could go; a job that does not fit is refused with the compiler's figure (exit 2)
before anything is created, and a second look at the same job reads the kept reports.
"""

from __future__ import annotations

import re
from pathlib import Path

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


# A user's own program: the example's (examples/user-train/train.py), small.
USER_JOB = """\
name: mine
accelerator: v4-16
workload:
  type: entrypoint
  entrypoint: train:main
  args: {d_model: 128, n_layers: 2, n_heads: 4, max_len: 256}
  steps: 1000
  seq_len: 256
  global_batch_size: 32
autoscaling: {accelerators: [v4-16], max_slices: 2}
deadline: PT2H
"""
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "user-train" / "train.py"


def user_job(tmp_path, text: str = USER_JOB, *, program: str | None = None):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "train.py").write_text(program if program is not None else EXAMPLE.read_text())
    return job_file(folder, text)


def test_plan_compiles_the_step_a_user_s_program_declares_and_prices_it(tmp_path, home):
    path = user_job(tmp_path)
    r = CliRunner().invoke(app, ["plan", str(path), "--compile"])
    assert r.exit_code == 0, r.output
    table = rows(r.stdout)
    assert set(table) == {"v4-16", "2 x v4-16"}, r.stdout
    for label, (compiles, hbm, usable, fits, _compile_s, step_ms, _tokens_s, mfu) in table.items():
        assert (compiles, fits, usable) == ("yes", "yes", "28.8"), (label, table[label])
        assert 0 < float(hbm) < 1 and float(step_ms) > 0 and 0 < int(mfu.rstrip("%")) <= 100
    assert "MFU: model FLOPs from the program's flops_per_step" in r.stdout
    assert "[2/2] compiling the train step for 2 x v4-16" in r.stderr
    assert "spot" in r.stdout and "$" in r.stdout  # the cost plan, priced by the compiled step's FLOPs
    assert "speeds before measuring: 55% of the TPU compiler's roofline" in " ".join(r.stdout.split())

    # What was compiled is the program's own step: the compiler's count of its FLOPs is the program's formula
    # (6 per parameter per token, plus attention), within what the formula leaves out (norms, softmax, AdamW).
    from orchestrator import catalog
    from orchestrator.control.tpu_compile import step_report
    from orchestrator.domain.spec import JobSpec

    spec = JobSpec.from_yaml(path)
    report, kept = step_report(spec, catalog.lookup("v4-16"), cache_dir=home / "tpu-programs")
    assert kept, "plan kept the report under the program's key"
    assert report.model_flops_per_step is not None
    assert 0.9 < report.flops / report.model_flops_per_step < 1.15, (report.flops, report.model_flops_per_step)

    # The same from Python, with no cluster: the kept reports, and the plan priced by them.
    from orchestrator import Client

    plan = Client(home=home).plan(spec, compile=True)
    assert plan.compiled is not None and [r.label for r in plan.compiled] == ["v4-16", "2 x v4-16"]
    assert all(r.kept and r.fits for r in plan.compiled) and plan.refusals == []
    assert {o.label for o in plan.costs.options} >= {"v4-16 spot", "v4-16 on-demand"}
    assert plan.costs.policy.expected_cost_usd > 0
    assert plan.costs.priors == {"v4-16": "compiled", "2xv4-16": "compiled"}  # both compiled: the policy starts there
    with pytest.raises(ValueError, match="plan --compile takes them from the TPU compiler"):
        Client(home=home).plan(spec)  # without the compiler, nothing says how big the program's step is


def test_a_changed_program_is_compiled_again(tmp_path, home):
    path = user_job(tmp_path, USER_JOB.replace("max_slices: 2", "max_slices: 1"))
    first = CliRunner().invoke(app, ["validate", str(path), "--compile"])
    assert first.exit_code == 0, first.output
    again = CliRunner().invoke(app, ["validate", str(path), "--compile"])
    assert rows(again.stdout)["v4-16"][4] == "kept", again.stdout
    program = path.parent / "train.py"
    program.write_text(program.read_text().replace("n_heads: int = 4", "n_heads: int = 2"))
    changed = CliRunner().invoke(app, ["validate", str(path), "--compile"])
    assert changed.exit_code == 0, changed.output
    assert rows(changed.stdout)["v4-16"][4] != "kept", changed.stdout


def test_a_user_s_program_that_does_not_fit_is_refused_by_submit_with_nothing_created(tmp_path, home):
    big = USER_JOB.replace("d_model: 128, n_layers: 2, n_heads: 4", "d_model: 8192, n_layers: 3, n_heads: 64")
    r = CliRunner().invoke(app, ["submit", str(user_job(tmp_path, big.replace("max_slices: 2", "max_slices: 1"))),
                                 "--compile"])
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output
    assert re.search(r"error: .*accelerator: v4-16: (training does not fit|the TPU compiler needs [\d.]+ GiB)",
                     r.stderr), r.stderr
    assert not (home / "cluster.json").exists()
    assert not (home / "state.db").exists() or Store(home / "state.db").jobs() == []


def test_a_program_that_does_not_declare_its_step_is_told_why_and_checked_without_the_compiler(tmp_path, home):
    undeclared = EXAMPLE.read_text().replace("ctx.loop(state, step=train_step, ", "ctx.loop(state, ")
    assert undeclared != EXAMPLE.read_text()
    r = CliRunner().invoke(app, ["validate", str(user_job(tmp_path, program=undeclared)), "--compile"])
    assert r.exit_code == 0, r.output
    assert "warning:" in r.stderr and "does not declare its step" in r.stderr and "step=" in r.stderr, r.stderr
    assert "valid (v4-16" in r.stdout


def test_a_program_that_cannot_be_traced_gets_its_own_error_per_option(tmp_path, home):
    restored = "    state = ctx.restore_or_init(init)"
    concrete = EXAMPLE.read_text().replace(restored, restored + "\n    float(state['params']['tokens'][0, 0])")
    r = CliRunner().invoke(app, ["validate", str(user_job(tmp_path, program=concrete)), "--compile"])
    assert r.exit_code == 2, r.output
    assert "the program could not be traced" in r.stderr, r.stderr


def test_an_entrypoint_that_cannot_be_imported_is_named(tmp_path, home):
    r = CliRunner().invoke(app, ["validate", str(user_job(tmp_path, program="import no_such_module\n")), "--compile"])
    assert r.exit_code == 2, r.output
    assert "cannot import the entrypoint train:main" in r.stderr and "no_such_module" in r.stderr, r.stderr


def test_a_program_s_key_is_what_it_computes_not_where_its_state_is_kept():
    """The CLI compiles before the job has its checkpoint folder; its controller finds the report by the same key."""
    import dataclasses

    from orchestrator import catalog
    from orchestrator.control.tpu_compile import topology
    from policies.model.shape import ModelShape
    from workers.settings import LmSettings, TrainingSettings
    from workers.tpu_target import program_key

    shape = ModelShape(d_model=64, n_layers=1, n_heads=4, n_kv_heads=4, d_ff=128, vocab_size=256)
    lm = LmSettings(model=shape, lr_peak=3e-4, lr_end=3e-5, warmup_steps=10, weight_decay=0.1)
    s = TrainingSettings(steps=100, seq_len=256, global_batch_size=32)
    target = topology(catalog.lookup("v4-16"))
    key = program_key(lm, s, target)
    assert key == program_key(lm, dataclasses.replace(s, checkpoint_dir="/x/ckpt", checkpoint_interval=7,
                                                      checkpoint_keep=9, memory_interval=3), target)
    assert key != program_key(lm, dataclasses.replace(s, seq_len=512), target)
    assert key != program_key(lm, s, topology(catalog.lookup("v4-32")))
