"""The trainer's model runs on the project's kernels: Pallas (TPU interpret mode) and XLA give the same training.

Both runs train the same model, with a mixture-of-experts feed-forward and a
linear-recurrence layer switched on, for a few steps in one process: on one device,
and with the Pallas kernels run per device under `shard_map` on a 2x2 mesh (batch
rows over data, heads over model) against the unsharded XLA run. Tolerance: 2e-5
relative per step, f32 everywhere; the kernels compute the same sums in another order
(blocked, online softmax), and the differences grow a little as the runs' parameters
drift apart step by step.
"""

from __future__ import annotations

import dataclasses

from kernels.dispatch import INTERPRET_ENV
from tests.conftest import Reference, assert_losses_close, start_workload
from workers.model import ModelShape
from workers.order import BuiltInTrainer, LaunchOrder
from workers.settings import LmSettings, TrainingSettings

SETTINGS = TrainingSettings(seq_len=32, global_batch_size=2, steps=3, seed=0, mesh_shape=(1, 1, 1))
LM = LmSettings(model=ModelShape(d_model=64, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=128, vocab_size=256,
                                 moe_experts=4, moe_top_k=2, scan_layer=True),
                lr_peak=3e-3, lr_end=3e-4, warmup_steps=1, weight_decay=0.01)


def train(settings: TrainingSettings, lm: LmSettings, implementation: str, devices: int, tmp_path,
          env: dict | None = None) -> Reference:
    """The built-in trainer on `implementation`'s kernels in one process (`workers.reference`), started now:
    two such runs train side by side (the Pallas interpreter keeps one core busy), `.result()` waits."""
    order = LaunchOrder(settings, BuiltInTrainer(dataclasses.replace(lm, implementation=implementation)))
    return start_workload(order, devices, tmp_path, env=env)


def test_pallas_and_xla_kernels_train_alike(tmp_path):
    xla_run, pallas_run = (train(SETTINGS, LM, "xla", devices=1, tmp_path=tmp_path / "x"),
                           train(SETTINGS, LM, "pallas", devices=1, tmp_path=tmp_path / "p"))
    xla, pallas = xla_run.result(), pallas_run.result()
    assert len(xla["losses"]) == 3
    assert xla["losses"][-1] < xla["losses"][0]
    assert_losses_close(pallas["losses"], xla["losses"], rtol=2e-5)


SHARDED = dataclasses.replace(SETTINGS, mesh_shape=(2, 1, 2))
SHARDED_LM = dataclasses.replace(LM, model=dataclasses.replace(LM.model, n_kv_heads=2))


def _shard_maps(implementation: str) -> int:
    """How many kernel calls of one training loss run per device under `shard_map` on a 2x1x2 mesh."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import AbstractMesh

    from policies.model.sharding import AXES
    from workers.model import init_params, loss_fn

    model = SHARDED_LM.model
    params = jax.eval_shape(lambda: init_params(jax.random.key(0), model))
    batch = jax.ShapeDtypeStruct((SHARDED.global_batch_size, SHARDED.seq_len + 1), jnp.int32)
    mesh = AbstractMesh(SHARDED.mesh_shape, AXES)
    jaxpr = jax.make_jaxpr(lambda p, b: loss_fn(p, b, model, implementation=implementation, mesh=mesh))(
        params, batch)
    return str(jaxpr).count("shard_map[")


def test_pallas_kernels_run_per_shard_on_a_multi_device_mesh():
    # Per layer: 3 norms, 2 RoPE, attention, the scan, the experts; and the final norm.
    assert _shard_maps("pallas") == 3 + 2 + 1 + 1 + 1 + 1
    assert _shard_maps("xla") == 0  # XLA's partitioner handles the XLA paths itself


def test_sharded_pallas_training_equals_unsharded_xla(tmp_path):
    """4 devices (data 2 x model 2), each Pallas kernel on its device's shard: the losses of unsharded XLA.

    The kernels run in Pallas's generic interpreter here: TPU interpret mode runs a mesh's
    devices in lockstep and stalls on a 2-core CPU with 4 devices (the single-device test
    above covers the kernels in TPU interpret mode).
    """
    xla_run, pallas_run = (train(SETTINGS, SHARDED_LM, "xla", devices=1, tmp_path=tmp_path / "x"),
                           train(SHARDED, SHARDED_LM, "pallas", devices=4, tmp_path=tmp_path / "p",
                                 env={INTERPRET_ENV: "generic"}))
    xla, pallas = xla_run.result(), pallas_run.result()
    assert len(pallas["losses"]) == SHARDED.steps
    assert_losses_close(pallas["losses"], xla["losses"], rtol=2e-5)


ODD_SHAPES = dataclasses.replace(
    SETTINGS, seq_len=200, steps=2,
    kernel_blocks={"attention": {"block_q": 128, "block_kv": 128, "block_q_bwd": 64, "block_kv_bwd": 64},
                   "norm": {"block_rows": 256}, "rope": {"block_seq": 128},
                   "scan": {"block_time": 128, "block_dim": 128}})


def test_lengths_the_blocks_do_not_divide_train_alike_on_pallas_and_xla(tmp_path):
    """seq_len 200 with 128-blocks (attention, RoPE, scan: fitted and padded) and 400 rows with block_rows 256."""
    xla_run, pallas_run = (train(ODD_SHAPES, LM, "xla", devices=1, tmp_path=tmp_path / "x"),
                           train(ODD_SHAPES, LM, "pallas", devices=1, tmp_path=tmp_path / "p"))
    xla, pallas = xla_run.result(), pallas_run.result()
    assert len(pallas["losses"]) == ODD_SHAPES.steps
    assert_losses_close(pallas["losses"], xla["losses"], rtol=2e-5)


def test_the_job_s_kernel_blocks_reach_the_kernels_fitted_to_the_lengths():
    """Traced only: the Pallas calls of one training gradient use the blocks fitted from ODD_SHAPES's settings."""
    import jax
    import jax.numpy as jnp

    from kernels import KernelBlocks
    from workers.model import Numerics, init_params, loss_fn

    s, model = ODD_SHAPES, LM.model
    params = jax.eval_shape(lambda: init_params(jax.random.key(0), model))
    batch = jax.ShapeDtypeStruct((s.global_batch_size, s.seq_len + 1), jnp.int32)
    numerics = Numerics(blocks=KernelBlocks.from_mapping(s.kernel_blocks))
    grad = jax.grad(lambda p, b: loss_fn(p, b, model, implementation="pallas", numerics=numerics))

    def calls(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                yield eqn.params["grid_mapping"]
            for param in eqn.params.values():
                for inner in (param if isinstance(param, (tuple, list)) else (param,)):
                    inner = getattr(inner, "jaxpr", None)
                    if inner is not None:
                        yield from calls(getattr(inner, "jaxpr", inner))

    first_blocks = {tuple(getattr(b, "block_size", None) for b in m.block_mappings[0].block_shape)
                    for m in calls(jax.make_jaxpr(grad)(params, batch).jaxpr)}
    head_dim = model.d_model // model.n_heads
    assert (None, None, 104, head_dim) in first_blocks  # attention forward: 200 queries as 2 x 104 (padded to 208)
    assert (None, None, 40, head_dim) in first_blocks  # attention backward: 64 asked, 200 = 5 x 40
    assert (200, model.d_model) in first_blocks  # the norm: 2 x 200 = 400 rows, 256 asked -> 200
    assert (None, 104, 1) in first_blocks  # RoPE's positions: 104 of 208
