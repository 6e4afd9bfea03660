"""A multi-host runtime compiles its step once, and reuses it after a restart.

Two real JAX processes over gloo compile a sharded program twice (a "restart") with
the same cache directory: process 0 compiles and hands the executable to process 1, the
second time both load it from the cache, and every copy computes the same result.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys

from tests.conftest import REPO

CHILD = r"""
import json, sys
from workers import runtime
rank, port, cache = int(sys.argv[1]), sys.argv[2], sys.argv[3]
runtime.configure(platform="cpu", devices_per_host=2, compile_cache_dir=cache)
runtime.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=rank, timeout_s=60)
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
mesh = Mesh(np.array(jax.devices()).reshape(4), ("data",))
row = NamedSharding(mesh, P("data"))
fn = jax.jit(lambda x: (x * 2.0).sum(), in_shardings=row, out_shardings=NamedSharding(mesh, P()))
lowered = fn.lower(jax.ShapeDtypeStruct((8, 3), jnp.float32, sharding=row))
path = runtime.executable_path(lowered)
hit = path.exists()
compiled = runtime.compile_cached(lowered)
x = jax.make_array_from_callback((8, 3), row, lambda idx: np.arange(24, dtype=np.float32).reshape(8, 3)[idx])
print(json.dumps({"rank": rank, "hit": hit, "cached": path.exists(), "value": float(compiled(x))}))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_pair(cache) -> list[dict]:
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(r), port, str(cache)], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=240)
        assert p.returncode == 0, stderr[-3000:]
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return sorted(out, key=lambda r: r["rank"])


def test_one_process_compiles_and_the_cache_serves_every_process_later(tmp_path):
    first = run_pair(tmp_path / "cache")
    assert [r["hit"] for r in first] == [False, False]
    assert all(r["cached"] for r in first)
    second = run_pair(tmp_path / "cache")
    assert [r["hit"] for r in second] == [True, True]  # process 1 included: JAX's own cache never serves it
    expected = float(sum(2.0 * v for v in range(24)))
    assert [r["value"] for r in first + second] == [expected] * 4
    assert len(list((tmp_path / "cache" / "executables").iterdir())) == 1  # one program, one file


def test_an_unreadable_executable_is_compiled_again(tmp_path):
    run_pair(tmp_path / "cache")
    (stored,) = (tmp_path / "cache" / "executables").iterdir()
    stored.write_bytes(b"truncated")
    expected = float(sum(2.0 * v for v in range(24)))
    again = run_pair(tmp_path / "cache")
    assert [r["value"] for r in again] == [expected] * 2
    assert stored.stat().st_size > 100  # compiled and written anew
    assert [(r["hit"], r["value"]) for r in run_pair(tmp_path / "cache")] == [(True, expected)] * 2
