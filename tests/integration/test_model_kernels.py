"""The trainer's model runs on the project's kernels: Pallas (TPU interpret mode) and XLA give the same training.

Both runs train the same model, with a mixture-of-experts feed-forward and a
linear-recurrence layer switched on, for a few steps in one process on one device
(the Pallas kernels need `shard_map` on a multi-device mesh; here the point is the
numerics). Tolerance: 2e-5 relative per step, f32 everywhere; the kernels compute the
same sums in another order (blocked, online softmax), and the differences grow a
little as the runs' parameters drift apart step by step.
"""

from __future__ import annotations

import dataclasses

from tests.conftest import assert_losses_close, run_reference
from workers.model import ModelShape
from workers.train import TrainConfig

CFG = TrainConfig(
    model=ModelShape(d_model=64, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=128, vocab_size=256,
                     moe_experts=4, moe_top_k=2, scan_layer=True),
    seq_len=32, global_batch_size=2, steps=3, seed=0, lr_peak=3e-3, lr_end=3e-4, warmup_steps=1,
    weight_decay=0.01, mesh_shape=(1, 1, 1))


def test_pallas_and_xla_kernels_train_alike(tmp_path):
    xla = run_reference(dataclasses.replace(CFG, implementation="xla"), devices=1, tmp_path=tmp_path / "x")
    pallas = run_reference(dataclasses.replace(CFG, implementation="pallas"), devices=1, tmp_path=tmp_path / "p")
    assert len(xla["losses"]) == 3
    assert xla["losses"][-1] < xla["losses"][0]
    assert_losses_close(pallas["losses"], xla["losses"], rtol=2e-5)
