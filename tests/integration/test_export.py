"""Weights out: a real orbax checkpoint written by a 4-device mesh, exported to safetensors and loaded back bitwise."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from typer.testing import CliRunner

from orchestrator import cluster
from orchestrator.domain.workload import ModelConfig
from orchestrator.state.states import JobState
from orchestrator.state.store import Store
from orchestrator.user.cli import app
from workers import export

REPO = Path(__file__).resolve().parents[2]


def make_state(step: int) -> dict:
    """A training state like a user's: params (bfloat16 and float32, nested dicts and a list), optimizer, step."""
    rng = np.random.default_rng(step)

    def arr(*shape, dtype=np.float32):
        return rng.standard_normal(shape).astype(dtype)

    params = {"embed": arr(16, 8, dtype=jnp.bfloat16),
              "layers": [{"wq": arr(8, 8, dtype=jnp.bfloat16), "norm": arr(8)} for _ in range(2)],
              "head": {"w": arr(8, 16), "scale": arr()}}
    return {"params": params, "opt_state": {"mu": arr(16, 8), "count": np.int32(step)}, "step": np.int32(step)}


WRITER = """
import sys
import jax
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 4)
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from tests.integration.test_export import make_state

mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
def place(x):
    spec = P("data", "model") if x.ndim == 2 else P()
    return jax.device_put(x, NamedSharding(mesh, spec))
mngr = ocp.CheckpointManager(sys.argv[1], options=ocp.CheckpointManagerOptions(max_to_keep=3, create=True))
for step in (3, 6):
    state = jax.tree.map(place, make_state(step))
    mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                            meta=ocp.args.JsonSave({"step": step, "data": "fp-123"})))
mngr.wait_until_finished()
mngr.close()
"""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """Steps 3 and 6 in the workers' layout (items `state` and `meta`), saved sharded over a 2x2 mesh."""
    path = tmp_path_factory.mktemp("ckpt") / "job"
    subprocess.run([sys.executable, "-c", WRITER, str(path)], check=True, cwd=REPO, timeout=300,
                   env={**os.environ, "PYTHONPATH": str(REPO)})
    (path / "9.orbax-checkpoint-tmp-1234").mkdir()  # a save cut short: not a step
    return path


def assert_same_tree(got, want) -> None:
    """Equal structure (dicts and lists), dtypes, shapes and bytes."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and sorted(got) == sorted(want)  # JAX orders dict keys itself
        for k in want:
            assert_same_tree(got[k], want[k])
    elif isinstance(want, (list, tuple)):
        assert isinstance(got, list) and len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert_same_tree(g, w)
    else:
        want = np.asarray(want)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert got.tobytes() == want.tobytes()


def test_export_of_the_newest_step_loads_back_bitwise(checkpoint, tmp_path):
    assert export.checkpoint_steps(checkpoint) == [3, 6]
    done = export.export_checkpoint(checkpoint, tmp_path / "w", config={"job": {"id": "j-1"}})
    assert (done.step, done.tensors) == (6, 7)
    assert done.parameters == 16 * 8 + 2 * (64 + 8) + 8 * 16 + 1
    params, config = export.load(tmp_path / "w")
    assert_same_tree(params, make_state(6)["params"])
    assert config["step"] == 6 and config["subtree"] == "params" and config["job"] == {"id": "j-1"}
    assert config["meta"] == {"step": 6, "data": "fp-123"}
    from safetensors import safe_open

    with safe_open(str(tmp_path / "w" / "model.safetensors"), "np") as f:  # what other frameworks see
        assert sorted(f.keys()) == ["embed", "head/scale", "head/w", "layers/0/norm", "layers/0/wq",
                                    "layers/1/norm", "layers/1/wq"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w"]


def test_a_given_step_and_a_missing_one(checkpoint, tmp_path):
    export.export_checkpoint(checkpoint, tmp_path / "w3", step=3)
    assert_same_tree(export.load(tmp_path / "w3")[0], make_state(3)["params"])
    with pytest.raises(export.ExportError) as e:
        export.export_checkpoint(checkpoint, tmp_path / "w9", step=9)
    assert str(e.value) == f"{checkpoint}: has no committed checkpoint of step 9; it has 3, 6"
    assert not (tmp_path / "w9").exists()


def test_another_subtree_or_the_whole_state(checkpoint, tmp_path):
    export.export_checkpoint(checkpoint, tmp_path / "mu", subtree="opt_state/mu")
    mu, config = export.load(tmp_path / "mu")
    assert_same_tree(mu, make_state(6)["opt_state"]["mu"])
    assert config["subtree"] == "opt_state/mu"
    export.export_checkpoint(checkpoint, tmp_path / "layer", subtree="/params/layers/1/")
    assert_same_tree(export.load(tmp_path / "layer")[0], make_state(6)["params"]["layers"][1])
    export.export_checkpoint(checkpoint, tmp_path / "all", subtree="/")
    whole, config = export.load(tmp_path / "all")
    assert_same_tree(whole, make_state(6)) and config["subtree"] == ""
    with pytest.raises(export.ExportError) as e:
        export.export_checkpoint(checkpoint, tmp_path / "ema", subtree="ema")
    assert str(e.value) == f"{checkpoint} (step 6): --subtree ema: the state has no 'ema'; it has opt_state, " \
                           "params, step"
    with pytest.raises(export.ExportError, match="params/layers has no '2'; it has indices 0 to 1"):
        export.export_checkpoint(checkpoint, tmp_path / "l2", subtree="params/layers/2")
    assert not (tmp_path / "ema").exists() and not (tmp_path / "l2").exists()


def test_a_state_without_params_in_the_older_single_item_layout(tmp_path):
    import orbax.checkpoint as ocp

    state = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": [np.ones(2, np.int32), np.zeros(3, np.float32)]}
    mngr = ocp.CheckpointManager(tmp_path / "ckpt")
    mngr.save(4, args=ocp.args.StandardSave(state))
    mngr.wait_until_finished()
    mngr.close()
    done = export.export_checkpoint(tmp_path / "ckpt", tmp_path / "w")
    params, config = export.load(tmp_path / "w")
    assert done.step == 4 and config["subtree"] == "" and config["meta"] == {}
    assert_same_tree(params, state)


def test_names_that_cannot_be_tensor_names_are_refused(tmp_path):
    with pytest.raises(export.ExportError, match=r"layers: key 'a/b'"):
        export.save({"layers": {"a/b": np.ones(2)}}, tmp_path / "w", config={})
    assert not (tmp_path / "w").exists()


# -- the command ----------------------------------------------------------------------


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("ORCHESTRATOR_HOME", str(tmp_path / "home"))
    return cluster.Home(tmp_path / "home").ensure()


def job(home, job_id: str, directory: Path, *states: JobState) -> str:
    store = Store(home.db)
    store.create_job(job_id, job_id.rsplit("-", 1)[0], {
        "name": job_id.rsplit("-", 1)[0], "accelerator": "v4-8", "tier": "spot",
        "workload": {"type": "lm", "steps": 6, "model": {"d_model": 8, "n_layers": 2}},
        "checkpoint": {"directory": str(directory)}})
    for state in states:
        store.transition(job_id, state, "test")
    return job_id


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


RUN = (JobState.PROVISIONING, JobState.STARTING, JobState.RUNNING)


def test_export_command_of_a_succeeded_job(checkpoint, home, tmp_path):
    job(home, "tiny-abc123", checkpoint, *RUN, JobState.SUCCEEDED)
    r = run("export", "tiny", "-o", tmp_path / "out")
    assert r.exit_code == 0, r.output
    assert r.stdout.strip().startswith(f"wrote {tmp_path / 'out'}: step 6, 7 tensors, 401 parameters (")
    params, config = export.load(tmp_path / "out")
    assert_same_tree(params, make_state(6)["params"])
    assert config["job"] == {"id": "tiny-abc123", "name": "tiny", "state": "SUCCEEDED"}
    # The model's whole config (what the job file left out, at its defaults): enough to build it again.
    assert config["model"]["d_model"] == 8 and config["model"]["n_layers"] == 2 and config["workload"] == "lm"
    assert config["model"] == ModelConfig(d_model=8, n_layers=2).model_dump(mode="json")
    r = run("export", "tiny", "-o", tmp_path / "out")
    assert r.exit_code == 2 and r.stderr.strip() == (
        f"error: {tmp_path / 'out'}: exists and is not empty (--force replaces it)")
    assert run("export", "tiny", "-o", tmp_path / "out", "--force", "--step", 3).exit_code == 0
    assert_same_tree(export.load(tmp_path / "out")[0], make_state(3)["params"])


def test_export_command_refuses_a_job_that_did_not_succeed_unless_asked(checkpoint, home, tmp_path):
    job(home, "cut-abc123", checkpoint, *RUN, JobState.FAILED)
    r = run("export", "cut", "-o", tmp_path / "out")
    assert r.exit_code == 2
    assert r.stderr.strip() == ("error: job cut-abc123 is FAILED: its final weights are those of a SUCCEEDED job; "
                                "--latest exports its newest committed checkpoint, --step N a given one")
    assert not (tmp_path / "out").exists()
    r = run("export", "cut", "-o", tmp_path / "out", "--latest")
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "out" / "config.json").read_text())["step"] == 6


def test_export_command_without_checkpoints_is_one_line(home, tmp_path):
    job(home, "none-abc123", tmp_path / "nowhere", *RUN, JobState.SUCCEEDED)
    r = run("export", "none", "-o", tmp_path / "out")
    assert r.exit_code == 2 and r.stderr.strip() == f"error: {tmp_path / 'nowhere'}: no such checkpoint folder"
    (tmp_path / "empty").mkdir()
    job(home, "empty-abc123", tmp_path / "empty", *RUN, JobState.SUCCEEDED)
    r = run("export", "empty", "-o", tmp_path / "out")
    assert r.exit_code == 2 and r.stderr.strip() == f"error: {tmp_path / 'empty'}: holds no committed checkpoint"
    r = run("export", "no-such-job", "-o", tmp_path / "out")
    assert r.exit_code == 2 and r.stderr.strip() == "error: no job 'no-such-job'"


def test_export_onto_a_symbolic_link_is_one_line_and_its_target_untouched(checkpoint, home, tmp_path):
    job(home, "tiny-abc123", checkpoint, *RUN, JobState.SUCCEEDED)
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    r = run("export", "tiny", "-o", dangling)
    assert (r.exit_code, r.stderr) == (2, f"error: {dangling}: is a symbolic link; give the path of a folder (its "
                                          "target is left alone)\n")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "keep.txt").write_text("keep me")
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "mine")
    r = run("export", "tiny", "-o", link, "--force")
    assert r.exit_code == 2 and r.stderr.startswith(f"error: {link}: is a symbolic link")
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["keep.txt"] and link.is_symlink()
    assert not (tmp_path / "nowhere").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling", "home", "link", "mine"]  # nothing half-written


def test_export_into_a_jobs_checkpoint_folder_is_refused(checkpoint, home, tmp_path):
    """A step-named folder there broke that job's next export ("holds neither a 'state' nor a 'default' item")."""
    import shutil

    other = tmp_path / "other-ckpt"
    shutil.copytree(checkpoint, other)
    job(home, "tiny-abc123", checkpoint, *RUN, JobState.SUCCEEDED)
    job(home, "other-def456", other, *RUN, JobState.SUCCEEDED)
    for out, says in [(other / "7", f"is inside the checkpoint folder of job other-def456 ({other})"),
                      (other / "weights", f"is inside the checkpoint folder of job other-def456 ({other})"),
                      (other, f"is inside the checkpoint folder of job other-def456 ({other})"),
                      (checkpoint / "w", f"is inside the checkpoint folder of job tiny-abc123 ({checkpoint})"),
                      (tmp_path, f"holds the checkpoint folder of job other-def456 ({other})")]:
        r = run("export", "tiny", "-o", out, "--force")
        assert (r.exit_code, r.stderr) == (2, f"error: {out}: {says}; write the export elsewhere\n"), out
    assert sorted(p.name for p in other.iterdir()) == sorted(p.name for p in checkpoint.iterdir())
    r = run("export", "other", "-o", tmp_path / "out")  # the other job still exports
    assert r.exit_code == 0, r.output


# -- back into the program's own pytree: load(..., like=) ----------------------------------


def save_like_a_worker(directory: Path, step: int, state) -> None:
    """The workers' layout (`workers.checkpoints`): items `state` and `meta`."""
    import orbax.checkpoint as ocp

    mngr = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(create=True))
    mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave({"step": step})))
    mngr.wait_until_finished()
    mngr.close()


def test_an_nnx_state_loads_back_as_an_nnx_state(tmp_path):
    """Without `like` an nnx.State comes back as {'value': array} leaves under string keys, which
    nnx.replace_by_pure_dict refuses; with `like` it is the program's own State, or its pure dict."""
    import jax
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(16, 8, rngs=rngs)
            self.layers = nnx.List([nnx.Linear(8, 8, rngs=rngs) for _ in range(2)])
            self.norm = nnx.LayerNorm(8, rngs=rngs)

        def __call__(self, x):
            h = self.embed(x)
            for layer in self.layers:
                h = layer(h)
            return self.norm(h)

    trained = Model(nnx.Rngs(0))
    save_like_a_worker(tmp_path / "ckpt", 5, {"params": nnx.state(trained, nnx.Param), "step": np.int32(5)})
    export.export_checkpoint(tmp_path / "ckpt", tmp_path / "w")
    raw, _ = export.load(tmp_path / "w")
    assert set(raw["layers"]) == {"0", "1"} and set(raw["layers"]["0"]["kernel"]) == {"value"}
    with pytest.raises(ValueError):
        nnx.replace_by_pure_dict(nnx.state(Model(nnx.Rngs(1)), nnx.Param), raw)

    fresh = Model(nnx.Rngs(1))
    params, config = export.load(tmp_path / "w", like=nnx.state(fresh, nnx.Param))
    assert isinstance(params, nnx.State) and config["step"] == 5
    nnx.update(fresh, params)
    x = np.arange(6).reshape(2, 3)
    assert np.array_equal(np.asarray(fresh(x)), np.asarray(trained(x)))  # the very model that was trained
    pure, _ = export.load(tmp_path / "w", like=nnx.state(Model(nnx.Rngs(2)), nnx.Param).to_pure_dict())
    assert set(pure["layers"]) == {0, 1} and isinstance(pure["layers"][1]["kernel"], jax.Array)
    other = Model(nnx.Rngs(3))
    state = nnx.state(other, nnx.Param)
    nnx.replace_by_pure_dict(state, pure)  # what flax's own docs do with a pure dict, no glue
    nnx.update(other, state)
    assert np.array_equal(np.asarray(other(x)), np.asarray(trained(x)))


def test_like_gives_back_any_registered_pytree_and_names_what_does_not_fit(checkpoint, tmp_path):
    import dataclasses

    import jax

    @dataclasses.dataclass
    class Head:
        w: object
        scale: object

    jax.tree_util.register_dataclass(Head, data_fields=["w", "scale"], meta_fields=[])
    export.export_checkpoint(checkpoint, tmp_path / "w")
    want = make_state(6)["params"]
    like = {"embed": jax.ShapeDtypeStruct((16, 8), jnp.bfloat16), "layers": [{"wq": 0, "norm": 0}] * 2,
            "head": Head(w=np.zeros((8, 16)), scale=np.zeros(()))}
    got, _ = export.load(tmp_path / "w", like=like)
    assert isinstance(got["head"], Head) and isinstance(got["layers"], list)
    assert_same_tree(got["head"].w, want["head"]["w"]) and got["embed"].dtype == jnp.bfloat16
    assert_same_tree(got["layers"], want["layers"])

    like["head"] = Head(w=np.zeros((8, 8)), scale=np.zeros(()))
    like["extra"] = np.zeros(3)
    del like["embed"]
    with pytest.raises(export.ExportError) as e:
        export.load(tmp_path / "w", like=like)
    assert str(e.value) == (f"{tmp_path / 'w'}: does not fit `like`: has no tensor for 1 leaf(s) of `like`: extra; "
                            "has 1 tensor(s) that `like` has no leaf for: embed; head/w: shape (8, 16) in the export, "
                            "(8, 8) in `like`")
