"""The hosts' memory tier (`workers.memory`), two of its promises: a state that holds typed PRNG keys
(`jax.random.key`, dtype ``key<impl>``) is kept and restored from memory bit for bit, on its shardings,
not sent to storage; and the keeper holds the shards it is handed as they arrive, without copying the
state a second time, and that copy outlives the worker that sent it. Each runs in a subprocess on Ray's
local mode with real keepers, the first with 4 CPU devices."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO

TYPED_KEYS = r"""
import os
os.environ["RAY_AUTH_MODE"] = "disabled"
import jax, jax.numpy as jnp, numpy as np, ray
jax.config.update("jax_num_cpu_devices", 4)
from workers.api import Context
from workers.memory import HostMemory
from workers.settings import TrainingSettings

def init(key):  # a state as programs hold it: parameters, a key to go on from, a batch of keys, another impl's key
    return {"w": jax.random.normal(key, (8, 4)), "rng": key, "keys": jax.random.split(key, 8),
            "rbg": jax.random.key(jax.random.bits(key, dtype=jnp.uint32), impl="rbg"), "step": jnp.int32(0)}

ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
try:
    keeper = ray.remote(HostMemory).remote()
    settings = TrainingSettings(mesh_shape=(2, 2, 1), slices=2, memory_interval=1)
    ctx = Context(settings=settings, keeper=keeper)
    shardings = ctx.shardings(jax.eval_shape(init, jax.random.key(0)))
    kept = {}
    for step in (1, 2):  # states no fresh start gives: restored from memory or not at all
        kept[step] = jax.jit(init, out_shardings=shardings)(jax.random.key(100 + step))
        ctx.keeping.after_step(step, kept[step], 0.5)
    assert not ctx.keeping.broken, "the copy failed: a lost slice would restore from storage"
    assert sorted(ray.get(keeper.steps.remote())) == [1, 2], ray.get(keeper.steps.remote())

    survivor = Context(settings=TrainingSettings(mesh_shape=(2, 2, 1), slices=2, memory_step=2), keeper=keeper)
    back = survivor.restore_or_init(init, shardings)
    print("restored_from", survivor.restored_from, survivor.restored_step, survivor.memory_miss)
    for name in ("rng", "keys", "rbg"):
        want, got = kept[2][name], back[name]
        assert got.dtype == want.dtype and jax.random.key_impl(got) == jax.random.key_impl(want), (name, got.dtype)
        assert got.sharding == want.sharding, (name, got.sharding, want.sharding)
        assert np.array_equal(np.asarray(jax.random.key_data(got)), np.asarray(jax.random.key_data(want))), name
        draw = jnp.vectorize(lambda k: jax.random.bits(k, (3,)), signature="()->(n)")  # what the keys give
        assert np.array_equal(np.asarray(draw(got)), np.asarray(draw(want))), name
    assert np.array_equal(np.asarray(back["w"]), np.asarray(kept[2]["w"])) and back["w"].sharding == shardings["w"]
    print("keys", back["keys"].sharding.spec, back["rng"].sharding.spec)
finally:
    ray.shutdown()
"""


def test_a_state_with_typed_keys_restores_from_memory_bit_for_bit(tmp_path):
    out = subprocess.run([sys.executable, "-c", TYPED_KEYS], cwd=REPO, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert "restored_from memory 2 None" in lines, lines
    assert "keys P('fsdp',) P()" in lines, lines  # a batch of keys split, one replicated


ONE_COPY = r"""
import os, time, tracemalloc
os.environ["RAY_AUTH_MODE"] = "disabled"
import jax, numpy as np, ray
from workers.memory import HostMemory, recall

MB = 2**20
SHAPE = (1024, 4096)  # 16 MiB of float32: far above what Ray inlines in a call, so through the object store

def values(step):
    return np.random.default_rng(step).standard_normal(SHAPE, dtype=np.float32)

class Measured(HostMemory):
    # The real keeper, with the bytes its `keep` allocates counted (NumPy reports its buffers to tracemalloc).
    def __init__(self):
        super().__init__()
        self.allocated = {}

    def keep(self, step, table, layout):
        tracemalloc.start()
        try:
            super().keep(step, table, layout)
            self.allocated[step] = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    def measured(self):
        return self.allocated

@ray.remote(num_cpus=1)
class Worker:  # a training host's worker: a process of its own, which the loss of its slice ends
    def keep(self, keeper, steps):
        import jax.numpy as jnp
        from workers.memory import Keeping

        keeping = Keeping(keeper, every=1)
        for step in steps:
            keeping.after_step(step, {"w": jnp.asarray(values(step)), "step": jnp.int32(step)}, 0.5)
        assert not keeping.broken
        return ray.get(keeper.steps.remote())  # after its keeps: one caller's calls run in order

ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False, object_store_memory=200 * MB)
try:
    keeper = ray.remote(Measured).options(num_cpus=0).remote()
    worker = Worker.remote()
    assert sorted(ray.get(worker.keep.remote(keeper, [1, 2, 3]))) == [2, 3]
    ray.kill(worker)  # the sender goes, as with its slice's runtime
    time.sleep(1)
    churn = []  # the store's space reused: a copy it had let go would be overwritten
    for i in range(20):
        churn = churn[-5:] + [ray.put(np.full(SHAPE, i, dtype=np.float32))]
    del churn
    allocated = ray.get(keeper.measured.remote())
    print("allocated", ", ".join(f"{s}:{b}" for s, b in sorted(allocated.items())))
    assert all(b < values(0).nbytes // 100 for b in allocated.values()), allocated  # one copy, not two
    device = jax.devices()[0]
    target = {"w": jax.ShapeDtypeStruct(SHAPE, np.float32, sharding=jax.sharding.SingleDeviceSharding(device)),
              "step": jax.ShapeDtypeStruct((), np.int32, sharding=jax.sharding.SingleDeviceSharding(device))}
    back = recall(keeper, 3, target)
    assert np.array_equal(np.asarray(back["w"]), values(3)) and int(back["step"]) == 3
    print("restored after the sender's end")
finally:
    ray.shutdown()
"""


def test_the_keeper_holds_one_copy_that_outlives_its_sender():
    out = subprocess.run([sys.executable, "-c", ONE_COPY], cwd=REPO, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-1000:] + out.stderr[-3000:]
    assert "restored after the sender's end" in out.stdout.splitlines(), out.stdout
