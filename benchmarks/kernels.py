"""Kernel benchmarks: each op's dispatched path against its naive reference, in one run.

    python benchmarks/kernels.py            # about 8 minutes on a 2-core CPU
    python benchmarks/kernels.py --quick    # smaller shapes, about a minute
    python benchmarks/kernels.py --gpu      # adds cuDNN attention at FlashAttention-3 shapes (GPU only)

For every (op, shape) it times the path ``implementation=None`` picks on this backend
(on CPU: the chunked XLA attention, the grouped XLA MoE, the sequential XLA scan with its
own backward; norms and RoPE are their XLA expressions, the same program as the reference) and the naive
reference, forward and backward:

- ``seconds``: median wall time of up to three runs after a warm-up, compile excluded.
  On a shared machine these move with the load (the norms' and RoPE's two rows run the
  same program, so their spread is the noise); the memory figures do not.
- ``peak_bytes``: from the compiled executable's ``memory_analysis()``: arguments +
  outputs + temporaries - aliased bytes. Deterministic, unlike sampling RSS.
- ``direction``: ``"fwd"`` is the op; ``"bwd"`` is the gradient of a scalar of its
  output with respect to its float inputs, forward included (what training runs).
- ``tflops``: useful matmul FLOPs per second (the same count for both paths, so the
  naive path gets no credit for the masked half of causal attention); null for the
  memory-bound ops.

Pallas kernels are not timed: on CPU they run in TPU interpret mode, a simulator. Rows go
to ``benchmarks/results/kernels.json``; the table printed at the end gives each dispatched
path's time and peak memory as a ratio of the naive path measured in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if sys.path[0] == str(Path(__file__).resolve().parent):
    sys.path[0] = str(REPO)  # run as a script: `import kernels` must find the package, not this file

import jax
import jax.numpy as jnp
import numpy as np

import kernels
from kernels import dispatch
from kernels.linear_scan import reference_linear_scan
from kernels.moe import reference_moe_ffn
from kernels.norm import reference_norm
from kernels.rope import reference_rope

RESULTS = REPO / "benchmarks" / "results" / "kernels.json"


@dataclasses.dataclass(frozen=True)
class Row:
    op: str
    shape: str
    implementation: str
    direction: str
    seconds: float
    peak_bytes: int
    tflops: float | None
    machine: str


@dataclasses.dataclass(frozen=True)
class Case:
    """One op at one shape: the two paths to compare, their inputs, and the useful FLOPs."""

    op: str
    shape: str
    dispatched: Callable  # the backend's default path
    naive: Callable
    args: tuple
    diff_argnums: tuple[int, ...]  # float inputs the backward differentiates
    fwd_flops: float | None = None
    bwd_flops: float | None = None
    # The dispatched path's name. The default path: Pallas on TPU, else XLA (f32 attention
    # on a GPU falls back to XLA too, cuDNN taking bf16/fp16 only).
    implementation: str = dataclasses.field(default_factory=lambda: dispatch.resolve(None, valid=("pallas", "xla")))


def machine() -> str:
    processor = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                 if line.startswith("model name")]
        processor = names[0] if names else processor
    load = os.getloadavg()[0]
    return (f"{processor}, {os.cpu_count()} CPUs, {dispatch.backend()} backend, jax {jax.__version__}, "
            f"load average {load:.1f} at start")


def _rand(rng: np.random.Generator, shape, dtype=jnp.float32, scale: float = 1.0) -> jax.Array:
    return jnp.asarray((scale * rng.standard_normal(shape)).astype(np.float32)).astype(dtype)


def _scalar(fn: Callable) -> Callable:
    """A scalar of the op's output(s), for the backward: sum of its first output (plus MoE's aux loss)."""
    def loss(*args):
        out = fn(*args)
        if isinstance(out, tuple):  # moe_ffn: (y, aux_loss, stats)
            return jnp.sum(out[0].astype(jnp.float32)) + out[1]
        return jnp.sum(out.astype(jnp.float32))

    return loss


def measure(fn: Callable, args: tuple, *, repeats: int, budget_s: float = 12.0) -> tuple[float, int]:
    """(median seconds, peak bytes) of ``jit(fn)(*args)``, compile and a warm-up run excluded.

    Stops repeating once the timed runs add up to ``budget_s`` (the naive attention
    backward at 8k takes about a minute a run here), after at least one.
    """
    compiled = jax.jit(fn).lower(*args).compile()
    memory = compiled.memory_analysis()
    peak = (memory.argument_size_in_bytes + memory.output_size_in_bytes + memory.temp_size_in_bytes
            - memory.alias_size_in_bytes)
    jax.block_until_ready(compiled(*args))  # warm-up
    times = []
    while len(times) < repeats and sum(times) < budget_s:
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times), int(peak)


def run_case(case: Case, *, repeats: int, host: str) -> list[Row]:
    rows = []
    for implementation, fn in ((case.implementation, case.dispatched), ("naive", case.naive)):
        for direction, flops, program in (
                ("fwd", case.fwd_flops, fn),
                ("bwd", case.bwd_flops, jax.grad(_scalar(fn), argnums=case.diff_argnums))):
            seconds, peak = measure(program, case.args, repeats=repeats)
            rows.append(Row(case.op, case.shape, implementation, direction, seconds, peak,
                            None if flops is None else flops / seconds / 1e12, host))
            print(f"  {case.op:<12} {case.shape:<34} {implementation:<7} {direction}  {seconds:8.4f} s  "
                  f"{peak / 2**20:9.1f} MiB", flush=True)
    return rows


# ----------------------------------------------------------------------------- cases


def attention_cases(seq_lens, rng, *, batch=1, heads=4, kv_heads=2, head_dim=64) -> list[Case]:
    cases = []
    for seq in seq_lens:
        q = _rand(rng, (batch, seq, heads, head_dim))
        k = _rand(rng, (batch, seq, kv_heads, head_dim))
        v = _rand(rng, (batch, seq, kv_heads, head_dim))
        flops = 4 * batch * heads * seq * seq * head_dim / 2  # causal: half the QK^T and PV products
        cases.append(Case(
            "attention", f"causal b{batch} s{seq} h{heads}/{kv_heads} d{head_dim}",
            functools.partial(kernels.attention, causal=True), functools.partial(kernels.reference_attention, causal=True),
            (q, k, v), (0, 1, 2), fwd_flops=flops, bwd_flops=3.5 * flops))  # backward: 5 products, + forward's 2
    return cases


def norm_and_rope_cases(rng, *, batch, seq, d_model, heads, head_dim) -> list[Case]:
    x = _rand(rng, (batch, seq, d_model))
    weight, bias = _rand(rng, (d_model,), scale=0.1) + 1.0, _rand(rng, (d_model,), scale=0.1)
    heads_x = _rand(rng, (batch, seq, heads, head_dim))
    positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
    shape = f"b{batch} s{seq} d{d_model}"
    return [
        Case("rms_norm", shape, kernels.rms_norm, lambda x, w: reference_norm(x, w, None, eps=1e-6),
             (x, weight), (0, 1)),
        Case("layer_norm", shape, kernels.layer_norm, functools.partial(reference_norm, eps=1e-5),
             (x, weight, bias), (0, 1, 2)),
        Case("rope", f"b{batch} s{seq} h{heads} d{head_dim}", kernels.apply_rope, reference_rope,
             (heads_x, positions), (0,)),
    ]


def moe_case(rng, *, tokens, d_model, d_ff, experts, top_k) -> Case:
    args = (_rand(rng, (tokens, d_model)), _rand(rng, (d_model, experts)),
            _rand(rng, (experts, d_model, d_ff), scale=d_model ** -0.5),
            _rand(rng, (experts, d_ff, d_model), scale=d_ff ** -0.5))
    flops = 2 * tokens * top_k * 2 * d_model * d_ff  # the routed experts' two products
    return Case("moe_ffn", f"t{tokens} d{d_model} f{d_ff} e{experts} k{top_k}",
                functools.partial(kernels.moe_ffn, top_k=top_k), functools.partial(reference_moe_ffn, top_k=top_k),
                args, (0, 1, 2, 3), fwd_flops=flops, bwd_flops=3 * flops)


def scan_case(rng, *, batch, time_steps, dim) -> Case:
    a = jnp.asarray(rng.uniform(0.5, 1.0, (batch, time_steps, dim)).astype(np.float32))
    b = _rand(rng, (batch, time_steps, dim))
    return Case("linear_scan", f"b{batch} t{time_steps} d{dim}", kernels.linear_scan, reference_linear_scan,
                (a, b), (0, 1))


def gpu_attention_cases(rng) -> list[Case]:
    """cuDNN flash attention at FlashAttention-3's benchmark shapes (bf16, head_dim 128, 16k tokens per batch)."""
    cases = []
    for seq in (2048, 4096, 8192, 16384):
        batch, heads, head_dim = 16384 // seq, 16, 128
        q, k, v = (_rand(rng, (batch, seq, heads, head_dim), jnp.bfloat16) for _ in range(3))
        flops = 4 * batch * heads * seq * seq * head_dim / 2
        cases.append(Case(
            "attention", f"causal bf16 b{batch} s{seq} h{heads} d{head_dim}",
            functools.partial(kernels.attention, causal=True, implementation="cudnn"),
            functools.partial(kernels.reference_attention, causal=True),
            (q, k, v), (0, 1, 2), fwd_flops=flops, bwd_flops=3.5 * flops, implementation="cudnn"))
    return cases


# ----------------------------------------------------------------------------- report


def print_ratios(rows: list[Row]) -> None:
    print(f"\n{'op':<12} {'shape':<34} {'path':<7} {'dir':<4} {'seconds':>9} {'naive s':>9} {'time x':>7} "
          f"{'memory x':>9}")
    naive = {(r.op, r.shape, r.direction): r for r in rows if r.implementation == "naive"}
    for r in rows:
        base = naive.get((r.op, r.shape, r.direction))
        if base is None or r is base:
            continue
        print(f"{r.op:<12} {r.shape:<34} {r.implementation:<7} {r.direction:<4} {r.seconds:9.4f} {base.seconds:9.4f} "
              f"{r.seconds / base.seconds:7.2f} {r.peak_bytes / base.peak_bytes:9.3f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller shapes and fewer repeats")
    parser.add_argument("--gpu", action="store_true", help="also cuDNN attention at FA3 shapes (GPU backend only)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    rng = np.random.default_rng(0)
    host = machine()
    repeats = 2 if args.quick else 3
    if args.quick:
        cases = attention_cases((1024, 2048), rng) + norm_and_rope_cases(
            rng, batch=2, seq=1024, d_model=512, heads=8, head_dim=64) + [
            moe_case(rng, tokens=1024, d_model=256, d_ff=512, experts=8, top_k=2),
            scan_case(rng, batch=2, time_steps=1024, dim=256)]
    else:
        cases = attention_cases((1024, 2048, 4096, 8192), rng) + norm_and_rope_cases(
            rng, batch=4, seq=2048, d_model=1024, heads=16, head_dim=64) + [
            moe_case(rng, tokens=4096, d_model=512, d_ff=1024, experts=8, top_k=2),
            scan_case(rng, batch=4, time_steps=4096, dim=512)]
    if args.gpu:
        if dispatch.backend() == "gpu":
            cases += gpu_attention_cases(rng)
        else:
            print(f"--gpu: skipped, the backend is {dispatch.backend()!r}", flush=True)

    print(f"{host}\n", flush=True)
    start = time.perf_counter()
    rows = [row for case in cases for row in run_case(case, repeats=repeats, host=host)]
    print_ratios(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps([dataclasses.asdict(r) for r in rows], indent=1) + "\n")
    print(f"\n{len(rows)} rows in {time.perf_counter() - start:.0f} s -> {args.out}")


if __name__ == "__main__":
    main()
