"""A checkpoint save compiles no program to cut the small replicated arrays of a state among their
replicas (`workers.checkpoints._small_arrays_whole`), and still splits a large one; either restores
to the same values. Run in a subprocess with 4 CPU devices, one replicated copy on each."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO
from workers.checkpoints import REPLICA_PARALLEL_MIN_BYTES

SCRIPT = r"""
import json, logging, sys
import jax, jax.numpy as jnp, numpy as np
jax.config.update("jax_num_cpu_devices", 4)
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from workers.checkpoints import Checkpoints

compiled = []
class Seen(logging.Handler):
    def emit(self, record):
        msg = record.getMessage()
        if msg.startswith("Compiling "):
            compiled.append(msg.split()[1])
logging.getLogger("jax").addHandler(Seen())

mesh = Mesh(np.array(jax.devices()), ("data",))
whole = NamedSharding(mesh, P())  # every device holds all of it: 4 replicas
small = {"w": jax.device_put(jnp.arange(4096.0).reshape(64, 64), whole),
         "b": jax.device_put(jnp.arange(64, dtype=jnp.bfloat16), whole)}
rows = int(sys.argv[2]) // (4 * 1024) * 4  # each of the 4 replicas' quarter at least the threshold
big = {"w": jax.device_put(jnp.arange(rows * 1024.0).reshape(rows, 1024), whole)}
out = {}
for name, state in (("small", small), ("big", big)):
    ck = Checkpoints(f"{sys.argv[1]}/{name}")
    state = jax.block_until_ready(state)
    with jax.log_compiles():
        del compiled[:]
        ck.save(1, state, {})
        ck.close()
    slices = compiled.count("jit(slice)")
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)
    restored, unreadable = Checkpoints(f"{sys.argv[1]}/{name}").restore_newest(abstract)
    same = all(bool(jnp.array_equal(restored.state[k], state[k])) for k in state)
    out[name] = {"slice_programs": slices, "same": same, "step": restored.step, "unreadable": unreadable}
print(json.dumps(out))
"""


def test_small_replicated_arrays_are_saved_whole_and_large_ones_split_among_their_replicas(tmp_path):
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), str(REPLICA_PARALLEL_MIN_BYTES)], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    # Saved whole by one replica: no program cuts them (orbax's default compiled one per array and device).
    assert out["small"] == {"slice_programs": 0, "same": True, "step": 1, "unreadable": []}
    # At the threshold each replica writes its quarter, cut on its own device.
    assert out["big"]["slice_programs"] == 4 and out["big"]["same"] and out["big"]["step"] == 1
