"""A multi-host runtime compiles its step once, and reuses it after a restart.

Two real JAX processes over gloo compile a sharded program twice (a "restart") with
the same cache directory: process 0 compiles and hands the executable to process 1, the
second time both load it from the cache, and every copy computes the same result.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys

from tests.conftest import REPO

# What every child process does first: join a 2-process runtime over gloo, 2 CPU devices each,
# with this launch's share key (SHARE_KEY), and a 4-device data mesh.
PREAMBLE = r"""
import hashlib, hmac, json, os, pickle, sys
from workers import programs, runtime
rank, port, cache = int(sys.argv[1]), sys.argv[2], sys.argv[3]
runtime.configure(platform="cpu", devices_per_host=2, compile_cache_dir=cache)
runtime.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=rank, timeout_s=60,
                   share_key=bytes.fromhex(os.environ["SHARE_KEY"]))
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
mesh = Mesh(np.array(jax.devices()).reshape(4), ("data",))
row = NamedSharding(mesh, P("data"))
"""

CHILD = PREAMBLE + r"""
fn = jax.jit(lambda x: (x * 2.0).sum(), in_shardings=row, out_shardings=NamedSharding(mesh, P()))
lowered = fn.lower(jax.ShapeDtypeStruct((8, 3), jnp.float32, sharding=row))
path = programs.executable_path(lowered)
hit = path.exists()
from jax._src import distributed  # both look before either compiles: else process 1 may see process 0's fresh file
distributed.global_state.client.wait_at_barrier("looked", 60_000)
compiled = programs.compile_cached(lowered)
x = jax.make_array_from_callback((8, 3), row, lambda idx: np.arange(24, dtype=np.float32).reshape(8, 3)[idx])
print(json.dumps({"rank": rank, "hit": hit, "cached": path.exists(), "value": float(compiled(x))}))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_pair(cache, *, per_host: bool = False, child: str = CHILD, extra: tuple[str, ...] = (),
             keys: tuple[str, str] | None = None) -> list[dict]:
    """Two processes running `child`; `per_host`: each with a cache directory of its own, as TPU hosts' local disks.

    `keys`: each process's share key (hex); default one fresh key for both, as a launch hands them.
    """
    port = str(free_port())
    keys = keys or (secrets.token_hex(32),) * 2
    procs = [subprocess.Popen([sys.executable, "-c", child, str(r), port,
                               str(cache / f"host{r}" if per_host else cache), *extra],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "SHARE_KEY": keys[r]})
             for r in range(2)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=240)
        assert p.returncode == 0, stderr[-3000:]
        out.append({**json.loads(stdout.strip().splitlines()[-1]), "refused": "refused executable/" in stderr})
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


KEYED_CHILD = PREAMBLE + r"""
scale = float(sys.argv[4])
from jax.experimental import multihost_utils
traced = []

def lower():
    traced.append(1)
    fn = jax.jit(lambda x: {"sum": (x * scale).sum(), "rows": x.sum(1)}, in_shardings=row)
    return fn.lower(jax.ShapeDtypeStruct((8, 3), jnp.float32, sharding=row))

key = programs.program_id("test", {"scale": scale})
compiled = programs.compile_keyed(key, lower)
x = jax.make_array_from_callback((8, 3), row, lambda idx: np.arange(24, dtype=np.float32).reshape(8, 3)[idx])
out = compiled(x)
rows = np.asarray(multihost_utils.process_allgather(out["rows"], tiled=True)).tolist()
from jax._src import distributed
try:  # whether process 0 sent its bytes of the program through the key-value store
    distributed.global_state.client.key_value_try_get_bytes(f"program-bytes/{key}")
    sent = True
except Exception:
    sent = False
print(json.dumps({"rank": rank, "traced": len(traced), "value": float(out["sum"]), "rows": rows, "sent": sent}))
"""


def run_keyed_pair(cache, scale: float, *, per_host: bool = False) -> list[dict]:
    return run_pair(cache, per_host=per_host, child=KEYED_CHILD, extra=(str(scale),))


def test_a_kept_program_is_loaded_after_a_restart_without_tracing_it(tmp_path):
    cache = tmp_path / "cache"
    expected = {"value": float(sum(2.0 * v for v in range(24))), "rows": [float(3 * r * 3 + 3) for r in range(8)]}
    first = run_keyed_pair(cache, 2.0)
    assert [r["traced"] for r in first] == [1, 1]
    kept = list((cache / "executables").glob("program-*.pkl"))
    assert len(kept) == 1
    second = run_keyed_pair(cache, 2.0)
    assert [r["traced"] for r in second] == [0, 0]  # neither process traced the program again
    assert [r["sent"] for r in first + second] == [False] * 4  # both hosts keep it: no bytes go between them
    for r in first + second:
        assert {"value": r["value"], "rows": r["rows"]} == expected

    other = run_keyed_pair(cache, 3.0)  # another config is another program: traced, and kept beside
    assert [r["traced"] for r in other] == [1, 1]
    assert [r["value"] for r in other] == [float(sum(3.0 * v for v in range(24)))] * 2
    assert len(list((cache / "executables").glob("program-*.pkl"))) == 2


def test_an_unreadable_kept_program_is_traced_again(tmp_path):
    cache = tmp_path / "cache"
    run_keyed_pair(cache, 2.0)
    (kept,) = (cache / "executables").glob("program-*.pkl")
    kept.write_bytes(b"truncated")
    again = run_keyed_pair(cache, 2.0)
    assert [r["traced"] for r in again] == [1, 1]
    assert [r["value"] for r in again] == [float(sum(2.0 * v for v in range(24)))] * 2
    assert kept.stat().st_size > 100  # kept anew
    assert [r["traced"] for r in run_keyed_pair(cache, 2.0)] == [0, 0]


def test_hosts_with_their_own_disks_get_the_kept_executable_from_process_0(tmp_path):
    """Process 0 passes on the bytes it read: an executable loaded from disk cannot be
    serialized again on CPU (its copy fails to run), so re-serializing would break process 1.
    Both processes also name the kept program alike although their cache directories differ."""
    expected = float(sum(2.0 * v for v in range(24)))
    for _ in range(2):  # compiled, then loaded by process 0 alone
        assert [r["value"] for r in run_pair(tmp_path / "plain", per_host=True)] == [expected] * 2
    assert not (tmp_path / "plain" / "host1" / "executables").exists()  # process 1 never had it on disk
    runs = [run_keyed_pair(tmp_path / "keyed", 2.0, per_host=True) for _ in range(2)]
    assert [[r["traced"] for r in run] for run in runs] == [[1, 1], [0, 0]]  # process 1's copy came from process 0
    assert [r["sent"] for r in runs[1]] == [True, True]  # because process 1 asked for it
    assert [r["value"] for run in runs for r in run] == [expected] * 4


def test_the_program_key_changes_with_what_shapes_the_program_and_nothing_else(monkeypatch):
    import jax

    from workers import programs

    base = programs.program_id("step", {"d_model": 128})
    assert programs.program_id("step", {"d_model": 128}) == base
    assert programs.program_id("step", {"d_model": 256}) != base
    assert programs.program_id("init", {"d_model": 128}) != base
    with monkeypatch.context() as m:  # each variable back as it was after (the suite sets XLA_FLAGS)
        m.setenv("KERNELS_PALLAS_INTERPRET", "generic")
        assert programs.program_id("step", {"d_model": 128}) != base
    with monkeypatch.context() as m:
        m.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=true")
        assert programs.program_id("step", {"d_model": 128}) != base
    with jax.default_matmul_precision("highest"):
        assert programs.program_id("step", {"d_model": 128}) != base
    dir_before = jax.config.jax_compilation_cache_dir
    try:  # where executables are kept is not part of the program
        jax.config.update("jax_compilation_cache_dir", "/elsewhere")
        assert programs.program_id("step", {"d_model": 128}) == base
    finally:
        jax.config.update("jax_compilation_cache_dir", dir_before)


FORGING_CHILD = PREAMBLE + r"""
marker = sys.argv[4]
from jax._src import distributed
fn = jax.jit(lambda x: (x * 2.0).sum(), in_shardings=row, out_shardings=NamedSharding(mesh, P()))
lowered = fn.lower(jax.ShapeDtypeStruct((8, 3), jnp.float32, sharding=row))


class Payload:  # what an intruder would put in the store: unpickling it creates the marker file
    def __reduce__(self):
        return (open, (marker, "w"))


if rank == 0:  # stands in for anyone who can reach the coordinator's port but lacks this launch's key
    name = f"executable/{programs.program_key(lowered)}"
    evil = pickle.dumps(Payload())
    guessed = hmac.new(b"a guessed key", name.encode() + b"\0" + evil, hashlib.sha256).digest()
    distributed.global_state.client.key_value_set_bytes(name, guessed + evil, allow_overwrite=True)
    compiled = lowered.compile()
else:
    compiled = programs.compile_cached(lowered, share_timeout_s=60)
x = jax.make_array_from_callback((8, 3), row, lambda idx: np.arange(24, dtype=np.float32).reshape(8, 3)[idx])
print(json.dumps({"rank": rank, "value": float(compiled(x))}))
"""


def test_a_forged_executable_in_the_coordination_store_is_refused(tmp_path):
    """Hosts load executables that process 0 publishes through the runtime's key-value
    store, and loading unpickles: bytes not sealed with the launch's key must never be
    loaded. The host refuses them and compiles the program itself."""
    marker = tmp_path / "unpickled"
    out = run_pair(tmp_path / "cache", per_host=True, child=FORGING_CHILD, extra=(str(marker),))
    assert not marker.exists(), "a forged pickle from the coordination store was loaded"
    assert [r["refused"] for r in out] == [False, True]
    assert [r["value"] for r in out] == [float(sum(2.0 * v for v in range(24)))] * 2


def test_bytes_sealed_under_another_launchs_key_are_refused(tmp_path):
    """A host of one launch takes nothing another launch (another key) published: it compiles for itself."""
    expected = float(sum(2.0 * v for v in range(24)))
    out = run_pair(tmp_path / "cache", per_host=True, keys=(secrets.token_hex(32), secrets.token_hex(32)))
    assert [r["value"] for r in out] == [expected] * 2
    assert [r["refused"] for r in out] == [False, True]  # process 1 compiled on its own
    same = run_pair(tmp_path / "cache2", per_host=True)  # the same key: taken, as usual
    assert [(r["refused"], r["value"]) for r in same] == [(False, expected)] * 2


def test_a_seal_opens_only_with_its_key_name_and_bytes():
    from workers import runtime

    runtime._share_key = b"k" * 32
    try:
        sealed = runtime._seal("executable/abc", b"payload")
        assert runtime.open_sealed("executable/abc", sealed) == b"payload"
        assert runtime.open_sealed("executable/other", sealed) is None  # replayed under another name
        assert runtime.open_sealed("executable/abc", sealed[:-1] + b"X") is None  # bytes changed
        assert runtime.open_sealed("executable/abc", b"short") is None
        runtime._share_key = b"j" * 32
        assert runtime.open_sealed("executable/abc", sealed) is None  # another launch's key
    finally:
        runtime._share_key = None


# A user's own program (a plain `jax.jit`) in the same runtime.
USER_CHILD = PREAMBLE + r"""
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # whatever it takes to compile, it would be kept
fn = jax.jit(lambda x: jnp.sin(x @ x.T).sum(), in_shardings=row)
x = jax.make_array_from_callback((8, 3), row, lambda idx: np.arange(24, dtype=np.float32).reshape(8, 3)[idx])
value = float(fn(x))
entries = [p.name for p in os.scandir(cache) if p.name != "executables"] if os.path.isdir(cache) else []
print(json.dumps({"rank": rank, "value": value, "jax_cache": bool(jax.config.jax_enable_compilation_cache),
                  "entries": entries}))
"""


def test_a_user_s_program_never_goes_through_jax_s_own_cache_in_a_multi_process_cpu_runtime(tmp_path):
    """JAX's persistent cache keys a program differently on each CPU process: process 0 could load one the
    others compile afresh, and their collectives need not agree (gloo aborts under load). It is off there."""
    for _ in range(2):  # a restart would find nothing to load
        pair = run_pair(tmp_path / "cache", child=USER_CHILD)
        assert [r["jax_cache"] for r in pair] == [False, False]
        assert [r["entries"] for r in pair] == [[], []]
        assert pair[0]["value"] == pair[1]["value"]
