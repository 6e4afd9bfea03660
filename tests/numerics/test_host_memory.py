"""The hosts' memory tier (`workers.memory`): a copy of a host's shards, restored onto the same
layout, refused (before any array is built) when it does not cover what the host needs, and the
copy interval chosen from its measured cost. Run in a subprocess with 4 CPU devices, on Ray's
local mode, keepers included."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO
from workers.memory import BUDGET, Cadence

SCRIPT = r"""
import os
os.environ["RAY_AUTH_MODE"] = "disabled"
import jax, jax.numpy as jnp, numpy as np, ray
jax.config.update("jax_num_cpu_devices", 4)
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from workers.memory import HostMemory, Keeping, MemoryMiss, recall

ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
try:
    keeper = ray.remote(HostMemory).remote()
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "fsdp"))
    def state(step, spec=P("fsdp")):
        w = jnp.arange(32.0).reshape(8, 4) * step
        return {"w": jax.device_put(w, NamedSharding(mesh, spec)), "step": jnp.int32(step)}
    keeping = Keeping(keeper)
    for step in (1, 2, 3):  # the keeper holds the last two
        keeping.after_step(step, state(step), 0.5)
    assert sorted(ray.get(keeper.steps.remote())) == [2, 3], ray.get(keeper.steps.remote())
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state(1))
    back = recall(keeper, 3, target)
    assert np.array_equal(np.asarray(back["w"]), np.asarray(state(3)["w"])) and int(back["step"]) == 3
    assert back["w"].sharding == target["w"].sharding
    misses = []
    for step, tgt in [(1, target),  # dropped
                      (3, {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=NamedSharding(mesh, P())),
                           "step": target["step"]}),  # the same shapes, another split: a shard it lacks
                      (3, {"w": target["w"]})]:  # another structure
        try:
            recall(keeper, step, tgt)
        except MemoryMiss as e:
            misses.append(str(e))
    assert len(misses) == 3, misses
    print("\n".join(misses))
finally:
    ray.shutdown()
"""


def test_a_copy_restores_onto_its_layout_and_anything_else_is_refused(tmp_path):
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    dropped, other_split, other_tree = out.stdout.strip().splitlines()[-3:]
    assert dropped == "no copy of step 1"
    assert other_split.startswith("no shard ((0, 8), (0, 4)) of an array of shape (8, 4)"), other_split
    assert other_tree == "no copy of step 3 in this shape"


def test_a_copy_every_step_while_it_costs_at_most_the_budget_else_every_k():
    assert Cadence.interval(copy_s=0.001, step_s=0.5) == 1  # 0.2% of a step
    assert Cadence.interval(copy_s=BUDGET * 0.5, step_s=0.5) == 1
    assert Cadence.interval(copy_s=0.05, step_s=0.5) == 5  # 10% of a step: every 5th step, 2% on average
    assert Cadence.interval(copy_s=0.05, step_s=0.0) == 1
