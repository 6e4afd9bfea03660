"""The storage hand-off of a program compiled ahead, end to end with CPU executables (no TPU here).

The controller's compile-ahead process (`orchestrator.control.compile_ahead.compile_in_process`,
the CPU path: a rehearsal of the survivors' runtime) compiles the step a two-slice job's
survivors need and stores it in the job's folder, sealed with the job's key, before any slice
is lost. Then a plain JAX process stands for the survivors' host: it selects the program of its
own shape at launch (`workers.stored_programs.take`) and its trainer loads it without tracing,
and runs a step with it. A host of another shape does not select it, and says why.
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO

SPEC = r"""
from orchestrator import JobSpec
spec = JobSpec.from_dict({"name": "ahead", "accelerator": "v4-8", "slices": 2,
                          "checkpoint": {"directory": DIRECTORY},
                          "workload": {"type": "lm", "steps": 10, "global_batch_size": 8, "seq_len": 16,
                                       "model": {"d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64}}})
"""

SURVIVOR = r"""
import json, sys
from workers import api, runtime
DIRECTORY, cache, key = sys.argv[1], sys.argv[2], sys.argv[3]
runtime.configure(platform="cpu", devices_per_host=4, compile_cache_dir=cache)
""" + SPEC + r"""
import jax, jax.numpy as jnp
from orchestrator import catalog
from orchestrator.control.compile_ahead import targets
from orchestrator.control.launch import launch_order
from workers import stored_programs
from workers.order import StoredPrograms
from workers.train import Trainer, program_config
order = launch_order(spec, 4, 1, slices=1, memory_step=5)  # as the survivors' launch gives it
programs = StoredPrograms(DIRECTORY, bytes.fromhex(key), targets(catalog.lookup("v4-8"), 1))
trainer = Trainer(order.program.lm, api.Context(settings=order.settings))
found = stored_programs.take(programs, endpoint=order.storage_endpoint, platform="cpu", name="train_step",
                             config=program_config(trainer.lm, trainer.settings),
                             program_id=trainer.program_id("train_step"))
def no_trace():
    raise AssertionError("traced: the stored program was not loaded")
traced = trainer.lower_step
trainer.lower_step = no_trace
step = trainer.compile()
state = trainer.init_state()
batch = jax.device_put(jnp.ones((8, 17), jnp.int32), trainer.batch_sharding)
state, loss = step(state, batch)
print(json.dumps({"used": found.used, "reason": found.reason, "target": found.target, "loss": float(loss)}))
"""


def test_the_survivors_program_is_in_the_job_s_storage_before_the_loss_and_their_host_loads_it(tmp_path):
    from orchestrator import JobSpec, catalog
    from orchestrator.cluster.home import Home
    from orchestrator.control.compile_ahead import NextShape, compile_in_process, job_key, option_for, targets
    from workers import stored_programs
    from workers.train import program_config

    directory = str(tmp_path / "checkpoints")
    scope: dict = {"DIRECTORY": directory}
    exec(SPEC, scope)
    spec: JobSpec = scope["spec"]
    home = Home(tmp_path / "state")
    key = job_key(home, "job-1")
    survivors = option_for(spec, NextShape("v4-8", 1, "the survivors of a lost slice"), "cpu")

    answer = compile_in_process([survivors], directory=directory, endpoint=None,
                                key_file=home.job_dir("job-1") / "programs.key")

    [result] = answer["options"]
    assert result["ok"] and result["target"] == "cpu:4/1h/1s", result
    sid = stored_programs.stored_id("train_step", program_config(survivors.lm, survivors.settings))
    stored = tmp_path / "checkpoints" / "programs" / sid / "cpu-4-1h-1s.sealed"
    assert stored.exists() and stored.stat().st_size > result["size"]  # the header and the seal beside it
    assert answer["cpu_s"] > 0 and answer["peak_rss_mib"] > 50

    host = subprocess.run([sys.executable, "-c", SURVIVOR, directory, str(tmp_path / "host-cache"), key.hex()],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert host.returncode == 0, host.stderr[-3000:]
    said = json.loads(host.stdout.strip().splitlines()[-1])
    assert said["used"] and said["target"] == "cpu:4/1h/1s" and said["reason"].startswith("stored ahead for")
    assert said["loss"] > 0

    # A host of another shape: the same program on TPU chips, or the job's own two slices.
    on_tpu = stored_programs.select(directory, sid, targets(catalog.lookup("v4-8"), 1)["tpu"], key)
    assert not on_tpu.used and on_tpu.reason.startswith("stored only for other shapes (cpu-4-1h-1s)")
    two = option_for(spec, NextShape("v4-8", 2, "as it runs"), "cpu")
    two_sid = stored_programs.stored_id("train_step", program_config(two.lm, two.settings))
    assert two_sid != sid
    assert not stored_programs.select(directory, two_sid, two.target, key).used


UNLOADABLE = r"""
import json, sys
from workers import api, runtime
DIRECTORY, cache, key = sys.argv[1], sys.argv[2], sys.argv[3]
runtime.configure(platform="cpu", devices_per_host=4, compile_cache_dir=cache)
""" + SPEC + r"""
from orchestrator import catalog
from orchestrator.control.compile_ahead import targets
from orchestrator.control.launch import launch_order
from workers import stored_programs
from workers.order import StoredPrograms
from workers.train import Trainer, program_config
order = launch_order(spec, 4, 1, slices=1)
programs = StoredPrograms(DIRECTORY, bytes.fromhex(key), targets(catalog.lookup("v4-8"), 1))
trainer = Trainer(order.program.lm, api.Context(settings=order.settings))
config = program_config(trainer.lm, trainer.settings)
stored_programs.write(DIRECTORY, stored_programs.stored_id("train_step", config), "cpu:4/1h/1s", b"garbage",
                      bytes.fromhex(key))  # sealed with the job's key, by this build: only the bytes are wrong
program_id = trainer.program_id("train_step")
found = stored_programs.take(programs, endpoint=order.storage_endpoint, platform="cpu", name="train_step",
                             config=config, program_id=program_id)
trainer.compile()  # traces and compiles: the kept bytes do not load
after = stored_programs.loaded(found, program_id)
print(json.dumps({"taken": found.used, "used": after.used, "reason": after.reason}))
"""


def test_a_stored_executable_that_does_not_load_is_compiled_and_says_so(tmp_path):
    host = subprocess.run([sys.executable, "-c", UNLOADABLE, str(tmp_path / "ckpt"), str(tmp_path / "cache"),
                           "ab" * 32], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert host.returncode == 0, host.stderr[-3000:]
    said = json.loads(host.stdout.strip().splitlines()[-1])
    assert said == {"taken": True, "used": False,
                    "reason": "the stored executable did not load here (this host's log says why)"}
    assert "unreadable" in host.stderr  # runtime's warning: the program from program-<id>.pkl is unreadable
