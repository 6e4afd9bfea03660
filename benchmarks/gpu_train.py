"""Training throughput of the built-in model on one GPU: about 100M parameters, bf16 compute against float32.

    python benchmarks/gpu_train.py --out benchmarks/results/gpu_train.json   # GPU backend only, about 2 minutes

One training step is the trainer's: `workers.model.loss_fn` (float32 master parameters,
the compute dtype of `workers.model.Numerics`; with bf16 the attention dispatches to cuDNN,
with float32 to the chunked XLA path, cuDNN taking bf16/fp16 only), its gradient, and
AdamW with gradient clipping (optax, as `workers.train`), jitted with the parameters and
optimizer state donated. Timed: the median of the steps after three warm-ups, each
ended by fetching the loss.

Model FLOPs per token are `ModelShape.flops_per_token` (6 x active parameters + 12 x
layers x d_model x seq_len, the standard count with attention); MFU is the achieved
model FLOP/s over the GPU's dense bf16 peak (H100 SXM: 989 TFLOP/s, NVIDIA's figure
without sparsity), for both runs, so the float32 row shows what bf16 buys.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if sys.path[0] == str(Path(__file__).resolve().parent):
    sys.path[0] = str(REPO)

import jax
import jax.numpy as jnp
import numpy as np
import optax

from policies.model.shape import ModelShape
from workers.model import Numerics, init_params, loss_fn

PEAK_BF16 = {"NVIDIA H100 80GB HBM3": 989e12, "NVIDIA H100": 989e12, "NVIDIA H200": 989e12}
SHAPE = ModelShape(d_model=768, n_layers=14, n_heads=12, n_kv_heads=12, d_ff=3072, vocab_size=256)


def measure(dtype: str, *, batch: int, seq_len: int, steps: int) -> dict:
    params = init_params(jax.random.key(0), SHAPE)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-4, b1=0.9, b2=0.95, weight_decay=0.01))
    opt_state = optimizer.init(params)
    numerics = Numerics(compute_dtype=dtype)

    def step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(p, tokens, SHAPE, numerics=numerics))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    step = jax.jit(step, donate_argnums=(0, 1))
    rng = np.random.default_rng(0)
    times, losses = [], []
    for i in range(steps + 3):
        tokens = jnp.asarray(rng.integers(0, SHAPE.vocab_size, (batch, seq_len + 1)), jnp.int32)
        start = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, tokens)
        losses.append(float(loss))  # waits for the step
        if i >= 3:
            times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    device = jax.devices()[0].device_kind
    tokens_per_s = batch * seq_len / seconds
    flops_per_token = SHAPE.flops_per_token(seq_len)
    tflops = tokens_per_s * flops_per_token / 1e12
    peak = PEAK_BF16.get(device)
    return {"device": device, "compute_dtype": dtype, "params": SHAPE.num_params(), "batch": batch,
            "seq_len": seq_len, "step_seconds": seconds, "tokens_per_s": tokens_per_s,
            "flops_per_token": flops_per_token, "tflops_per_chip": tflops,
            "mfu": None if peak is None else tflops * 1e12 / peak, "peak_bf16_flops": peak,
            "first_loss": losses[0], "last_loss": losses[-1], "jax": jax.__version__}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "gpu_train.json")
    args = parser.parse_args(argv)
    if jax.default_backend() not in ("gpu", "cuda", "rocm"):
        parser.error(f"needs a GPU backend; this one is {jax.default_backend()!r}")
    rows = []
    for dtype in ("bfloat16", "float32"):
        rows.append(measure(dtype, batch=args.batch, seq_len=args.seq_len, steps=args.steps))
        print(json.dumps(rows[-1]), flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
