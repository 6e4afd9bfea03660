"""A job's files in a bucket: real orbax (tensorstore) checkpoints, exports and token files on the local GCS emulator.

Every test talks HTTP to the emulator process through the clients a TPU VM uses (orbax's
tensorstore for arrays, gcsfs for folders and token files, google-cloud-storage for the
fence). Resharded restores run in real multi-process JAX runtimes (gloo over loopback),
each process pointing itself at the emulator as a host does (`workers.storage.configure`).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import REPO
from tests.integration.test_export import assert_same_tree, make_state
from workers import export, storage
from workers.checkpoints import Checkpoints

# One process of a runtime of `nproc` processes with `devices` CPU devices each, pointed at the
# emulator, on a mesh of `shape` ("data", "model"): saves `steps`, or restores the newest step.
HOST = r"""
import json, os, sys
from workers import runtime, storage
rank, nproc, devices, port, url, folder, shape, mode, steps = sys.argv[1:]
rank, nproc, devices, shape, steps = int(rank), int(nproc), int(devices), json.loads(shape), json.loads(steps)
runtime.configure(platform="cpu", devices_per_host=devices)
storage.configure(url)
runtime.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=nproc, process_id=rank, timeout_s=90)
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from workers.checkpoints import Checkpoints

mesh = Mesh(np.array(jax.devices()).reshape(shape), ("data", "model"))

def values(step):
    return {"params": {"w": np.arange(16 * 8, dtype=np.float32).reshape(16, 8) * step,
                       "b": np.arange(8, dtype=np.float32) + step},
            "step": np.int32(step)}

def sharding(x):
    return NamedSharding(mesh, P("data", "model") if x.ndim == 2 else P("model") if x.ndim == 1 else P())

ckpts = Checkpoints(folder, keep=3)
out = {"rank": rank}
if mode == "save":
    for step in steps:
        state = jax.tree.map(lambda x: jax.make_array_from_callback(x.shape, sharding(x), lambda i: x[i]),
                             values(step))
        assert ckpts.save(step, state, {"seed": 0})  # asynchronous: returns before the commit
    ckpts.close()
    out["steps"] = Checkpoints(folder).steps()
else:
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding(x)), values(0))
    found, unreadable = ckpts.restore_newest(abstract)
    want = values(found.step)
    ok = all(np.array_equal(np.asarray(s.data), w[s.index])
             for got, w in zip(jax.tree.leaves(found.state), jax.tree.leaves(want)) for s in got.addressable_shards)
    out.update(step=found.step, meta=found.meta, unreadable=unreadable, equal=ok,
               shards=[list(s.data.shape) for s in found.state["params"]["w"].addressable_shards])
    ckpts.close()
print(json.dumps(out))
"""


def run_hosts(url: str, folder: str, *, nproc: int, devices: int, shape: tuple[int, int], mode: str,
              steps: tuple[int, ...] = ()) -> list[dict]:
    from orchestrator.cluster import free_port

    port = str(free_port())
    env = {k: v for k, v in os.environ.items() if k not in storage.endpoint_env("x")}  # each configures itself
    procs = [subprocess.Popen([sys.executable, "-c", HOST, str(r), str(nproc), str(devices), port, url, folder,
                               json.dumps(shape), mode, json.dumps(steps)],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for r in range(nproc)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr[-3000:]
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return sorted(out, key=lambda r: r["rank"])


def test_checkpoints_in_a_bucket_restore_resharded_onto_other_process_counts(gcs_emulator, request):
    """1 process of 4 devices saves; 2 processes of 2 restore onto a 2x2 mesh and save; 1 device restores that."""
    from tests.storage_fixture import unique_folder

    folder = unique_folder(request)
    saved = run_hosts(gcs_emulator.url, folder, nproc=1, devices=4, shape=(4, 1), mode="save", steps=(2, 4))
    assert saved[0]["steps"] == [2, 4]
    two = run_hosts(gcs_emulator.url, folder, nproc=2, devices=2, shape=(2, 2), mode="restore")
    assert [(r["step"], r["equal"], r["unreadable"]) for r in two] == [(4, True, [])] * 2
    assert two[0]["meta"] == {"seed": 0, "step": 4} and two[0]["shards"] == [[8, 4], [8, 4]]
    run_hosts(gcs_emulator.url, folder, nproc=2, devices=2, shape=(2, 2), mode="save", steps=(6,))
    one = run_hosts(gcs_emulator.url, folder, nproc=1, devices=1, shape=(1, 1), mode="restore")
    assert (one[0]["step"], one[0]["equal"], one[0]["shards"]) == (6, True, [[16, 8]])
    assert storage.listdir(folder, endpoint=gcs_emulator.url) == ["2", "4", "6"]


def small_state(step: int) -> dict:
    return {"params": {"w": np.full((4, 4), float(step), np.float32)}, "step": np.int32(step)}


def abstract_of(state):
    import jax

    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), state)


def save_steps(folder: str, steps: tuple[int, ...]) -> None:
    ckpts = Checkpoints(folder, keep=5)
    for s in steps:
        ckpts.save(s, small_state(s), {"seed": 0})
    ckpts.close()


def test_a_save_cut_short_in_a_bucket_is_never_restored(gcs):
    """On GCS orbax commits a step with a marker written last (no rename): a step without it is no step."""
    save_steps(gcs.folder, (1, 2))
    fs, root = storage.filesystem(gcs.folder)
    for name in fs.find(f"{root}/2"):  # step 3: all of a save but its commit markers, as a crash leaves it
        if not name.endswith("commit_success.txt"):
            fs.copy(name, name.replace(f"{root}/2/", f"{root}/3/", 1))
    assert "3" in storage.listdir(gcs.folder)
    ckpts = Checkpoints(gcs.folder, keep=5)
    assert ckpts.steps() == [1, 2]
    found, unreadable = ckpts.restore_newest(abstract_of(small_state(0)))
    assert (found.step, unreadable) == (2, []) and float(found.state["params"]["w"][0, 0]) == 2.0
    assert "3" not in storage.listdir(gcs.folder)  # what the cut save left is removed
    assert ckpts.save(3, small_state(3), {"seed": 0})  # and the step can be saved again
    ckpts.close()
    assert Checkpoints(gcs.folder).steps() == [1, 2, 3]


def test_an_unreadable_checkpoint_in_a_bucket_is_set_aside_without_rename(gcs):
    save_steps(gcs.folder, (1, 2))
    fs, root = storage.filesystem(gcs.folder)
    for name in fs.find(f"{root}/2/state"):  # committed, but its data is garbage
        fs.pipe_file(name, b"\0garbage")
    ckpts = Checkpoints(gcs.folder, keep=5)
    found, unreadable = ckpts.restore_newest(abstract_of(small_state(0)))
    assert (found.step, unreadable) == (1, [2])
    names = storage.listdir(gcs.folder)
    aside = [n for n in names if n.startswith("2.unreadable-")]
    assert "2" not in names and len(aside) == 1, names
    assert storage.exists(storage.join(gcs.folder, aside[0], "commit_success.txt"))  # kept whole for a look
    assert ckpts.steps() == [1]
    assert ckpts.save(2, small_state(2), {"seed": 0})
    ckpts.close()
    assert Checkpoints(gcs.folder).steps() == [1, 2]


@pytest.fixture
def bucket_checkpoint(gcs) -> str:
    """Steps 3 and 6 of `test_export.make_state` in the workers' layout, in a bucket."""
    import orbax.checkpoint as ocp

    mngr = ocp.CheckpointManager(gcs.folder, options=ocp.CheckpointManagerOptions(max_to_keep=3, create=True))
    for step in (3, 6):
        mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(make_state(step)),
                                                meta=ocp.args.JsonSave({"step": step})))
    mngr.wait_until_finished()
    mngr.close()
    return gcs.folder


def test_export_from_a_bucket_to_a_bucket_and_to_disk(bucket_checkpoint, gcs, tmp_path):
    assert export.checkpoint_steps(bucket_checkpoint) == [3, 6]
    out = f"gs://test-bucket/exports-{secrets.token_hex(3)}/w"
    done = export.export_checkpoint(bucket_checkpoint, out, config={"job": {"id": "j-1"}})
    assert (done.out, done.step, done.tensors) == (out, 6, 7) and done.bytes > 0
    assert storage.listdir(out) == ["config.json", "model.safetensors"]
    params, config = export.load(out)
    assert_same_tree(params, make_state(6)["params"])
    assert config["checkpoint"] == bucket_checkpoint and config["meta"] == {"step": 6}
    with pytest.raises(export.ExportError, match="exists and is not empty"):
        export.export_checkpoint(bucket_checkpoint, out, step=3)
    export.export_checkpoint(bucket_checkpoint, out, step=3, force=True)
    assert_same_tree(export.load(out)[0], make_state(3)["params"])
    export.export_checkpoint(bucket_checkpoint, tmp_path / "local", step=6)
    assert_same_tree(export.load(tmp_path / "local")[0], make_state(6)["params"])
    with pytest.raises(export.ExportError, match="missing: not an export folder"):
        export.load(storage.join(gcs.folder, "nothing"))


def test_export_reads_a_bucket_that_only_storage_emulator_host_names(bucket_checkpoint, gcs):
    """A fresh process with STORAGE_EMULATOR_HOST set and nothing configured (as a user's script): orbax's
    reads go through tensorstore, which does not read that variable (it used to wait on Google's servers)."""
    code = ("import sys; from workers import export; from tests.integration.test_export import make_state\n"
            "state, meta = export.restore(sys.argv[1], 6)\n"
            "assert (state['params']['head']['w'] == make_state(6)['params']['head']['w']).all()\n"
            "print(export.checkpoint_steps(sys.argv[1]), meta)")
    unset = ("TENSORSTORE_GCS_HTTP_URL", "GOOGLE_AUTH_TOKEN_FOR_TESTING")  # what `storage.configure` sets here
    env = {k: v for k, v in os.environ.items() if k not in unset}
    r = subprocess.run([sys.executable, "-c", code, bucket_checkpoint], cwd=REPO, capture_output=True, text=True,
                       timeout=120, env={**env, "STORAGE_EMULATOR_HOST": gcs.url, "PYTHONPATH": str(REPO),
                                         "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "[3, 6] {'step': 6}", r.stdout


def test_export_from_disk_to_a_bucket(gcs, tmp_path):
    import orbax.checkpoint as ocp

    mngr = ocp.CheckpointManager(tmp_path / "ckpt", options=ocp.CheckpointManagerOptions(create=True))
    mngr.save(2, args=ocp.args.Composite(state=ocp.args.StandardSave(make_state(2)), meta=ocp.args.JsonSave({})))
    mngr.wait_until_finished()
    mngr.close()
    export.export_checkpoint(tmp_path / "ckpt", gcs.folder)
    assert_same_tree(export.load(gcs.folder)[0], make_state(2)["params"])


CORPUS = {"a.txt": "the quick brown fox jumps over the lazy dog\n" * 40, "b/c.txt": "def f(x):\n    return x\n" * 30}


def test_token_files_prepared_into_a_bucket_read_back_as_on_disk(gcs, tmp_path):
    from orchestrator.user.data_prepare import prepare
    from workers.data import open_dataset
    from workers.tokens import DataError, check

    src = tmp_path / "corpus"
    for name, text in CORPUS.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_text(text)
    url = storage.join(gcs.folder, "tokens")
    remote = prepare(src, url, vocab_size=300)
    local = prepare(src, tmp_path / "tokens", vocab_size=300)
    assert remote.out == url and remote.tokens == local.tokens
    assert storage.listdir(url) == sorted(p.name for p in (tmp_path / "tokens").iterdir())
    check(url, vocab_size=300, seq_len=16, checksums=True)
    a, b = open_dataset(url), open_dataset(str(tmp_path / "tokens"))
    assert a.fingerprint == b.fingerprint
    for step in (0, 7):
        rows = dict(seed=3, step=step, global_batch_size=4, seq_len=16, rows=slice(0, 4))
        assert np.array_equal(a.rows(**rows), b.rows(**rows))
    with pytest.raises(DataError, match="exists and is not empty"):
        prepare(src, url, vocab_size=300)
    prepare(src, url, vocab_size=280, force=True)
    assert open_dataset(url).vocab_size == 280


def test_the_data_prepare_command_writes_to_a_bucket(gcs_emulator, request, tmp_path):
    from tests.storage_fixture import unique_folder

    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text(CORPUS["a.txt"])
    url = unique_folder(request)
    env = {**{k: v for k, v in os.environ.items() if k not in storage.endpoint_env("x")},
           "STORAGE_EMULATOR_HOST": gcs_emulator.url}  # what a user sets for an emulator; nothing else
    r = subprocess.run([sys.executable, "-m", "orchestrator.user.cli", "data", "prepare", str(tmp_path / "corpus"),
                        "-o", url, "--vocab-size", "300"], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith(f"wrote {url}: 1 file(s), 1 document(s)")
    assert storage.listdir(url, endpoint=gcs_emulator.url) == ["index.json", "tokenizer.json", "tokens-00000.bin"]
