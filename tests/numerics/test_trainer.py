"""The built-in trainer's numerics: bf16 mixed precision, remat, gradient accumulation, MFU.

One process, the devices it has (the XLA kernels: fast on a CPU). Orchestrated runs of
the same trainer are compared with such runs in the integration and chaos suites.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from policies.model.shape import ModelShape
from workers import api
from workers.protocol import StepDone
from workers.settings import LmSettings, TrainingSettings
from workers.train import Trainer

SHAPE = ModelShape(d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, d_ff=128, vocab_size=256)
LM = LmSettings(model=SHAPE, lr_peak=3e-3, lr_end=3e-4, warmup_steps=2, weight_decay=0.01, implementation="xla")


def settings(**changes) -> TrainingSettings:
    """The runs' settings (on a 1 TFLOP/s chip, for MFU), with `changes`."""
    base = TrainingSettings(seq_len=32, global_batch_size=8, steps=24, seed=0, mesh_shape=(len(jax.devices()), 1, 1),
                            peak_flops_per_chip=1e12)
    return dataclasses.replace(base, **changes)


def train(s: TrainingSettings, lm: LmSettings = LM, *, stop_after: int | None = None) -> tuple[list[StepDone], dict]:
    reports: list[StepDone] = []
    asked = [0]

    def stop():
        asked[0] += 1
        return stop_after is not None and asked[0] >= stop_after

    ctx = api.Context(settings=s, send=lambda r: reports.append(r) if isinstance(r, StepDone) else None,
                      stop_requested=stop)
    state, _ = Trainer(lm, ctx).run()
    return reports, state


@pytest.fixture(scope="module")
def fp32_run():
    return train(settings())[0]


def test_bf16_training_falls_and_tracks_float32(fp32_run):
    bf16 = [r.loss for r in train(settings(precision="bfloat16"))[0]]
    fp32 = [r.loss for r in fp32_run]
    assert bf16[-1] < 0.8 * bf16[0], bf16  # it learns
    relative = np.abs(np.array(bf16) - np.array(fp32)) / np.array(fp32)
    # Stated tolerance: bfloat16 keeps 8 bits of mantissa (3e-3 relative a rounding); over 24 steps of
    # AdamW the curves stay within 2% of each other on average and 5% at any step.
    assert relative.mean() < 0.02 and relative.max() < 0.05, relative


def test_bf16_master_weights_stay_float32():
    _, state = train(settings(precision="bfloat16", steps=2))
    dtypes = {x.dtype for x in jax.tree.leaves(state["params"])}
    assert dtypes == {jnp.dtype(jnp.float32)}


def test_a_resumed_bf16_run_equals_the_uninterrupted_one(tmp_path):
    whole = [r.loss for r in train(settings(precision="bfloat16", steps=8))[0]]
    saving = settings(precision="bfloat16", steps=8, checkpoint_dir=str(tmp_path / "b"))
    first, _ = train(saving, stop_after=5)
    assert len(first) == 5
    rest, _ = train(saving)
    assert rest[0].step == 5
    assert [r.loss for r in first + rest] == whole  # bit for bit


def gradients(s: TrainingSettings):
    trainer = Trainer(LM, api.Context(settings=s))
    state = trainer.init_state()
    batch = trainer.ctx.batch(3)
    return jax.jit(trainer.gradients)(state["params"], batch)


@pytest.fixture(scope="module")
def full_batch_gradients():
    return gradients(settings())


@pytest.mark.parametrize("remat", ["full", "dots_with_no_batch_dims_saveable"])
def test_remat_gives_the_same_gradients(remat, full_batch_gradients):
    loss, grads = full_batch_gradients
    loss_r, grads_r = gradients(settings(remat=remat))
    assert float(loss_r) == pytest.approx(float(loss), rel=1e-6)
    for g, g_r in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_r), strict=True):
        np.testing.assert_allclose(np.asarray(g_r), np.asarray(g), rtol=1e-5, atol=1e-7)


def test_two_microbatches_equal_the_full_batch(full_batch_gradients):
    loss, grads = full_batch_gradients
    loss_2, grads_2 = gradients(settings(microbatches=2))
    assert float(loss_2) == pytest.approx(float(loss), rel=1e-5)
    worst = max(float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(a)) + 1e-12))
                for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_2), strict=True))
    assert worst < 1e-5, worst


def test_mfu_is_the_stated_flops_over_the_peak(fp32_run):
    s = settings()
    flops = (6 * SHAPE.active_params() + 12 * SHAPE.n_layers * SHAPE.d_model * s.seq_len) * s.tokens_per_step
    chips = len(jax.devices())
    for r in fp32_run[1:]:
        per_chip = flops / r.step_time_s / chips
        assert r.metrics["tflops_per_chip"] == pytest.approx(per_chip / 1e12, rel=1e-9)
        assert r.metrics["mfu"] == pytest.approx(per_chip / 1e12, rel=1e-9)  # the context's peak: 1 TFLOP/s


def test_a_non_finite_loss_stops_training_with_the_step():
    diverging = dataclasses.replace(LM, lr_peak=1e6, lr_end=1e6, warmup_steps=0)  # within a few steps
    with pytest.raises(FloatingPointError, match=r"step \d+: the loss is (nan|inf)"):
        train(settings(steps=40), diverging)
