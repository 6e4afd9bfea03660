"""A multi-slice job's survivors load the program for one slice fewer, compiled while it trained.

Two real JAX processes over gloo stand for a job on two one-host slices (v4-8 x 2), each host
with a cache directory of its own, as TPU VMs' disks. Host 0 rehearses the one-slice runtime
(`workers.ahead.rehearse`: its own processes, on its own address) and keeps that program;
slice 1's host takes it through the live runtime's key-value store. Then a plain process
stands for slice 1's host after slice 0 is lost: the program it would compile is the one it
keeps, named alike (the rehearsal's key is the survivors' key).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys

from tests.conftest import REPO
from tests.numerics.test_executable_cache import free_port

SPEC = r"""
from orchestrator import JobSpec
from orchestrator.control.launch import launch_order
spec = JobSpec.from_dict({"name": "ahead", "accelerator": "v4-8", "slices": 2,
                          "workload": {"type": "lm", "steps": 10, "global_batch_size": 8, "seq_len": 16,
                                       "model": {"d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64}}})
"""

HOST = r"""
import json, os, sys, time
from workers import runtime
rank, port, cache = int(sys.argv[1]), sys.argv[2], sys.argv[3]
runtime.configure(platform="cpu", devices_per_host=4, compile_cache_dir=cache)
runtime.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=rank, timeout_s=60,
                   share_key=bytes.fromhex(os.environ["SHARE_KEY"]))
""" + SPEC + r"""
from jax._src import distributed
from workers.ahead import CompileAhead
ahead = CompileAhead.for_host(launch_order(spec, 4, 1, slices=2), rank=rank, num_hosts=2, devices_per_host=4,
                              platform="cpu", cache=cache)
deadline = time.monotonic() + 180
while not ahead.settled and time.monotonic() < deadline:  # the training loop's steps
    ahead.after_step()
    time.sleep(0.1)
distributed.global_state.client.wait_at_barrier("handed", 60_000)
print(json.dumps({"rank": rank, "settled": ahead.settled, "kept": sorted(os.listdir(f"{cache}/executables"))}))
"""

SURVIVOR = r"""
import json, sys
from workers import api, programs, runtime
runtime.configure(platform="cpu", devices_per_host=4, compile_cache_dir=sys.argv[1])
""" + SPEC + r"""
from workers.train import Trainer
order = launch_order(spec, 4, 1, slices=1, memory_step=5)
key = Trainer(order.program.lm, api.Context(settings=order.settings)).program_id("train_step")
print(json.dumps({"kept": programs.kept_program_path(key).exists(), "name": programs.kept_program_path(key).name}))
"""


def test_slice_1s_host_keeps_the_program_host_0_compiled_ahead_and_loads_it_as_the_survivor(tmp_path):
    port, key = str(free_port()), secrets.token_hex(32)
    procs = [subprocess.Popen([sys.executable, "-c", HOST, str(rank), port, str(tmp_path / f"host{rank}")],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "SHARE_KEY": key})
             for rank in range(2)]
    hosts = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr[-3000:]
        hosts.append(json.loads(stdout.strip().splitlines()[-1]))
    host0, host1 = sorted(hosts, key=lambda h: h["rank"])
    assert host0["settled"] and host1["settled"]
    assert len(host0["kept"]) == 1 and host0["kept"][0].startswith("program-")  # the one-slice train step
    assert host1["kept"] == host0["kept"]  # taken from host 0: it compiled nothing
    assert (tmp_path / "host1" / "executables" / host1["kept"][0]).read_bytes() == \
        (tmp_path / "host0" / "executables" / host0["kept"][0]).read_bytes()

    survivor = subprocess.run([sys.executable, "-c", SURVIVOR, str(tmp_path / "host1")], cwd=REPO,
                              capture_output=True, text=True, timeout=300)
    assert survivor.returncode == 0, survivor.stderr[-3000:]
    answer = json.loads(survivor.stdout.strip().splitlines()[-1])
    assert answer == {"kept": True, "name": host1["kept"][0]}


def test_only_a_multi_slice_lm_jobs_first_hosts_of_slices_0_and_1_take_part():
    from orchestrator import JobSpec
    from orchestrator.control.launch import launch_order
    from workers.ahead import CompileAhead

    def spec(slices: int, accelerator: str = "v4-16") -> JobSpec:
        return JobSpec.from_dict({"name": "a", "accelerator": accelerator, "slices": slices,
                                  "workload": {"type": "lm", "steps": 40, "global_batch_size": 48, "seq_len": 16}})

    three = launch_order(spec(3), 8, 2, slices=3)
    ahead = three.program.ahead
    assert ahead.slices == 2 and ahead.mesh_shape[0] * 3 == three.settings.mesh_shape[0] * 2
    parts = {rank: CompileAhead.for_host(three, rank=rank, num_hosts=6, devices_per_host=4, platform="cpu",
                                         cache="/cache") for rank in range(6)}
    assert [r for r, p in parts.items() if p is not None] == [0, 2]  # the survivors' process 0 is one of them
    assert parts[0].rehearsal.processes == 4  # two slices of two hosts
    assert CompileAhead.for_host(three, rank=0, num_hosts=6, devices_per_host=4, platform="cpu", cache=None) is None
    assert CompileAhead.for_host(three, rank=0, num_hosts=6, devices_per_host=4, platform="tpu", cache="/c") is None
    assert launch_order(spec(1), 8, 2).program.ahead is None
    # 72 rows: 24 a slice on 3 slices, 36 on 2, which 8 chips do not split
    odd = JobSpec.from_dict({"name": "a", "accelerator": "v4-16", "slices": 3,
                             "workload": {"type": "lm", "steps": 40, "global_batch_size": 72, "seq_len": 16}})
    assert launch_order(odd, 8, 2, slices=3).program.ahead is None
