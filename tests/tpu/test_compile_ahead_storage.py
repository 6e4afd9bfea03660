"""The survivors' train step compiled ahead by XLA's TPU compiler, as far as this machine can take it.

The controller's compile-ahead process (`orchestrator.control.compile_ahead`, TPU path) compiles a
two-slice v4-16 job's step for one v4-16 (topology v4:2x2x2, 2 hosts), serializes it and stores
it sealed in the job's folder under its stored id and target. Read back, it is a TPU executable
for that target, selected by a TPU host of that shape only. No TPU loads it here: that a v4-16
host runs it is what a real TPU still has to show.
"""

from __future__ import annotations

import pickle

from orchestrator import JobSpec, catalog
from orchestrator.cluster.home import Home
from orchestrator.control.compile_ahead import NextShape, compile_in_process, job_key, option_for, targets
from workers import stored_programs
from workers.order import StoredPrograms
from workers.train import program_config


def test_the_tpu_executable_is_serialized_stored_and_keyed_by_its_topology(tmp_path, monkeypatch):
    from workers import programs as executables

    directory = str(tmp_path / "checkpoints")
    spec = JobSpec.from_dict({"name": "ahead", "accelerator": "v4-16", "slices": 2,
                              "checkpoint": {"directory": directory},
                              "workload": {"type": "lm", "steps": 10, "global_batch_size": 32, "seq_len": 128,
                                           "model": {"d_model": 128, "n_layers": 1, "n_heads": 2, "d_ff": 256}}})
    home = Home(tmp_path / "state")
    key = job_key(home, "job-1")
    survivors = option_for(spec, NextShape("v4-16", 1, "the survivors of a lost slice"), "tpu")
    assert survivors.target == "v4:2x2x2/2h/1s"

    answer = compile_in_process([survivors], directory=directory, endpoint=None,
                                key_file=home.job_dir("job-1") / "programs.key")

    [result] = answer["options"]
    assert result["ok"], result
    sid = stored_programs.stored_id("train_step", program_config(survivors.lm, survivors.settings))
    found = stored_programs.select(directory, sid, survivors.target, key)
    assert found.used and found.kept is not None
    payload, in_tree, out_tree = pickle.loads(found.kept)  # as `programs.keep_program` keeps an executable
    assert len(payload) > 10_000 and in_tree.num_leaves > 0 and out_tree.num_leaves > 0

    # A TPU host of that shape takes it into its executable cache; a CPU stand-in of the same shape, or a
    # TPU host of a v4-32, does not.
    monkeypatch.setattr(executables, "kept_program_path", lambda k: tmp_path / "cache" / f"program-{k}.pkl")
    programs = StoredPrograms(directory, key, targets(catalog.lookup("v4-16"), 1))
    config = program_config(survivors.lm, survivors.settings)
    took = stored_programs.take(programs, endpoint=None, platform="tpu", name="train_step", config=config,
                                program_id="host")
    assert took is not None and took.used and (tmp_path / "cache" / "program-host.pkl").read_bytes() == found.kept
    stand_in = stored_programs.take(programs, endpoint=None, platform="cpu", name="train_step", config=config,
                                    program_id="cpu")
    assert stand_in is not None and not stand_in.used and "stored only for other shapes" in stand_in.reason
    v4_32 = stored_programs.select(directory, sid, targets(catalog.lookup("v4-32"), 1)["tpu"], key)
    assert not v4_32.used
