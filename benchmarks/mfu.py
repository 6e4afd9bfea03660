"""Model FLOPs utilisation of the built-in trainer on this machine's accelerator, float32 vs bf16.

The built-in trainer (`workers.train`, on the training API) trains a model of the
built-in kind for `--steps` steps with each precision (and bf16 with full remat), and
the loop reports model TFLOP/s per chip and MFU. The FLOPs are the stated count,
6 x parameters + 12 x layers x d_model x seq_len per token (`policies.model.shape`:
remat's recomputation is not counted, as MFU is usually defined); the peak is the
device's dense bf16 peak (a TPU's from `kernels.hardware`, a GPU's from the table below). The float32 run
is the baseline measured in the same run: bf16's ratio to it is the speed-up.

Each configuration runs in a process of its own, so no compiled program, allocator pool or
cache of one run carries over to the next, and its memory is read from the compiled train
step itself (XLA's memory analysis: arguments, outputs, temporaries, aliased bytes), beside the
device's peak as the loop reports it. The JAX and jaxlib versions go into the results.

    python benchmarks/mfu.py                 # the accelerator here (a GPU: the ~100M model)
    python benchmarks/mfu.py --preset tiny   # a quick CPU check of the harness

Writes `benchmarks/results/mfu.json` (`--out` elsewhere): per run `device`, `params`,
`precision`, `remat`, `tokens_per_s`, `tflops_per_chip`, `mfu`, `compiled_memory`.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kernels import hardware

# Dense bf16 peak per GPU, FLOP/s: NVIDIA H100 SXM and H200 data sheets (989.4 TFLOP/s without
# sparsity), A100 (312), L4 (121). A CPU has none stated.
GPU_PEAKS = {"H100": 989.4e12, "H200": 989.4e12, "A100": 312e12, "L4": 121e12}

PRESETS = {  # the built-in model's shape, seq_len, global batch
    "100m": (dict(d_model=768, n_layers=14, n_heads=12, n_kv_heads=12, d_ff=3072, vocab_size=256), 2048, 16),
    "tiny": (dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, d_ff=128, vocab_size=256), 64, 8),
}


def peak_for(device_kind: str) -> float | None:
    chip = hardware.from_device_kind(device_kind)
    if chip is not None:
        return chip.peak_bf16_tflops * 1e12
    return next((v for k, v in GPU_PEAKS.items() if k.lower() in device_kind.lower()), None)


def run(preset: str, precision: str, remat: str, steps: int, skip: int) -> dict:
    import jax

    from policies.model.shape import ModelShape
    from workers import api
    from workers.protocol import StepDone
    from workers.settings import LmSettings, TrainingSettings
    from workers.train import Trainer

    shape, seq_len, batch = PRESETS[preset]
    model = ModelShape(**shape)
    device = jax.devices()[0]
    settings = TrainingSettings(steps=steps, seq_len=seq_len, global_batch_size=batch, seed=0,
                                mesh_shape=(len(jax.devices()), 1, 1), precision=precision, remat=remat,
                                peak_flops_per_chip=peak_for(device.device_kind))
    lm = LmSettings(model=model, lr_peak=3e-4, lr_end=3e-5, warmup_steps=2, weight_decay=0.01)
    reports: list[StepDone] = []
    ctx = api.Context(settings=settings, send=lambda r: reports.append(r) if isinstance(r, StepDone) else None)
    t0 = time.perf_counter()
    trainer = Trainer(lm, ctx)
    trainer.run()
    memory = compiled_memory(trainer.compile())  # the program just run (kept by programs.compile_keyed)
    steady = reports[skip:]
    seconds = sum(r.step_time_s for r in steady)
    tokens_per_s = settings.tokens_per_step * len(steady) / seconds
    flops = model.flops_per_token(seq_len) * settings.tokens_per_step
    per_chip = flops * len(steady) / seconds / len(jax.devices())
    peak = peak_for(device.device_kind)
    hbm = [r.metrics.get("hbm_peak_gib") for r in reports if "hbm_peak_gib" in r.metrics]
    return {"device": f"{device.platform}: {device.device_kind}", "devices": len(jax.devices()),
            "params": model.num_params(), "precision": precision, "remat": remat, "seq_len": seq_len,
            "global_batch_size": batch, "steps": steps, "skip": skip, "tokens_per_s": tokens_per_s,
            "tflops_per_chip": per_chip / 1e12, "mfu": per_chip / peak if peak else None,
            "peak_tflops_per_chip": peak / 1e12 if peak else None, "hbm_peak_gib": max(hbm) if hbm else None,
            "compiled_memory": memory,
            "first_loss": reports[0].loss, "last_loss": reports[-1].loss, "wall_s": time.perf_counter() - t0,
            "attention": "cudnn" if device.platform == "gpu" else "xla" if device.platform == "cpu" else "pallas"}


def compiled_memory(compiled) -> dict | None:
    """Bytes the compiled program needs per device, by kind (None where the backend does not say)."""
    analysis = compiled.memory_analysis()
    if analysis is None:
        return None
    kinds = ("argument", "output", "temp", "alias", "generated_code")
    return {kind: getattr(analysis, f"{kind}_size_in_bytes", None) for kind in kinds}


CONFIGS = (("float32", "none"), ("bfloat16", "none"), ("bfloat16", "full"))


def run_alone(preset: str, precision: str, remat: str, steps: int, skip: int) -> dict:
    """`run` in a fresh Python process: nothing compiled, allocated or cached by another run is there."""
    cmd = [sys.executable, __file__, "--one", precision, remat, "--preset", preset, "--steps", str(steps),
           "--skip", str(skip)]
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise SystemExit(f"{precision}/{remat} failed (exit {r.returncode}):\n{r.stderr[-4000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="default: 100m on an accelerator, tiny on CPU")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--skip", type=int, default=5, help="warm-up steps left out of the figures")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "mfu.json"))
    p.add_argument("--one", nargs=2, metavar=("PRECISION", "REMAT"), help=argparse.SUPPRESS)  # a child's run
    args = p.parse_args()
    import jax
    import jaxlib

    preset = args.preset or ("tiny" if jax.default_backend() == "cpu" else "100m")
    if args.one:
        print(json.dumps(run(preset, *args.one, args.steps, args.skip)), flush=True)
        return
    runs = []
    for precision, remat in CONFIGS:
        runs.append(run_alone(preset, precision, remat, args.steps, args.skip))
        print(json.dumps(runs[-1]), flush=True)
    base = runs[0]["tokens_per_s"]
    for r in runs:
        r["speedup_vs_float32"] = r["tokens_per_s"] / base
    out = {"preset": preset, "runs": runs, "machine": f"{platform.machine()}, {jax.default_backend()}",
           "jax": jax.__version__, "jaxlib": jaxlib.__version__, "each_run": "a fresh process",
           "flops": "6 x params + 12 x layers x d_model x seq_len per token (policies.model.shape)"}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
