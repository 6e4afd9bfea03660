"""Kernel benchmarks: each op's dispatched path against independent baselines, in one run.

    python benchmarks/kernels.py            # about 4 minutes on a 2-core CPU
    python benchmarks/kernels.py --quick    # smaller shapes, under a minute
    python benchmarks/kernels.py --gpu      # on a GPU: bf16 attention at FlashAttention-3 shapes and a bf16 MoE

Baselines, each timed in the same run as the path it is compared with:

- attention: ``jax.nn.dot_product_attention`` with ``implementation="xla"`` (and
  ``"cudnn"`` on a GPU), and the naive reference (``[q_len, kv_len]`` logits, skipped
  where they would not fit or take minutes);
- MoE: a dropless MoE built on ``jax.lax.ragged_dot`` (sort by expert, two ragged
  products, unsort), and the naive reference that runs every expert on every token;
- norms, RoPE, scan: the naive reference (the norms and RoPE are their XLA expressions
  on every backend but TPU, so those two rows run the same program and their spread is
  the noise).

For every (op, shape, implementation, direction):

- ``seconds``: median wall time of up to three runs after a warm-up, compile excluded
  (null with ``error`` set where the program did not compile or run, e.g. out of memory).
- ``peak_bytes``: from the compiled executable's ``memory_analysis()``: arguments +
  outputs + temporaries - aliased bytes. Deterministic, unlike sampling RSS.
- ``direction``: ``"fwd"`` is the op; ``"bwd"`` is the gradient of a scalar of its
  output with respect to its float inputs, forward included (what training runs).
- ``tflops``: useful matmul FLOPs per second (the same count for every path, so the
  naive path gets no credit for the masked half of causal attention); null for the
  memory-bound ops.
- ``vs``: on the project's paths, seconds as a ratio of each baseline's in the same run
  (below 1: faster than the baseline).

Pallas kernels are not timed off TPU: on CPU they run in TPU interpret mode, a simulator.
Rows go to ``benchmarks/results/kernels.json``, replacing the rows of the same backend
and keeping the others (so the CPU and GPU runs sit side by side).
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
from kernels import moe as moe_routing
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
    baseline: bool
    direction: str
    seconds: float | None
    peak_bytes: int | None
    tflops: float | None
    vs: dict[str, float] | None
    error: str | None
    backend: str
    machine: str


@dataclasses.dataclass(frozen=True)
class Case:
    """One op at one shape: the project's paths and the baselines, their inputs, and the useful FLOPs."""

    op: str
    shape: str
    paths: dict[str, Callable]  # the project's implementations by name, the dispatched one first
    baselines: dict[str, Callable]
    args: tuple
    diff_argnums: tuple[int, ...]  # float inputs the backward differentiates
    fwd_flops: float | None = None
    bwd_flops: float | None = None


def dispatched_name(op_valid: tuple[str, ...] = ("pallas", "xla")) -> str:
    """The implementation ``implementation=None`` picks here: Pallas on TPU, else XLA."""
    return dispatch.resolve(None, valid=op_valid)


def machine() -> str:
    processor = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                 if line.startswith("model name")]
        processor = names[0] if names else processor
    load = os.getloadavg()[0]
    device = "" if dispatch.backend() == "cpu" else f"{jax.devices()[0].device_kind}, "
    return (f"{device}{processor}, {os.cpu_count()} CPUs, {dispatch.backend()} backend, jax {jax.__version__}, "
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
    measured = {}
    for baseline, programs in ((False, case.paths), (True, case.baselines)):
        for implementation, fn in programs.items():
            for direction, flops, program in (
                    ("fwd", case.fwd_flops, fn),
                    ("bwd", case.bwd_flops, jax.grad(_scalar(fn), argnums=case.diff_argnums))):
                seconds = peak = error = None
                try:
                    seconds, peak = measure(program, case.args, repeats=repeats)
                except Exception as exc:  # out of memory, or a path this backend lacks: recorded, not fatal
                    error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                measured[implementation, direction] = (baseline, seconds, peak, error, flops)
                shown = "failed: " + error if error else f"{seconds:8.4f} s  {peak / 2**20:9.1f} MiB"
                print(f"  {case.op:<11} {case.shape:<36} {implementation:<12} {direction}  {shown}", flush=True)
    rows = []
    for (implementation, direction), (baseline, seconds, peak, error, flops) in measured.items():
        vs = None
        if not baseline and seconds is not None:
            vs = {name: seconds / other[1] for (name, d), other in measured.items()
                  if other[0] and d == direction and other[1] is not None}
        rows.append(Row(case.op, case.shape, implementation, baseline, direction, seconds, peak,
                        None if flops is None or seconds is None else flops / seconds / 1e12, vs, error,
                        dispatch.backend(), host))
    return rows


# ----------------------------------------------------------------------------- cases


def _jax_nn_attention(implementation: str) -> Callable:
    return functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation=implementation)


def attention_cases(seq_lens, rng, *, batch=1, heads=4, kv_heads=2, head_dim=64, naive_up_to=8192) -> list[Case]:
    cases = []
    for seq in seq_lens:
        q = _rand(rng, (batch, seq, heads, head_dim))
        k = _rand(rng, (batch, seq, kv_heads, head_dim))
        v = _rand(rng, (batch, seq, kv_heads, head_dim))
        flops = 4 * batch * heads * seq * seq * head_dim / 2  # causal: half the QK^T and PV products
        baselines = {"jax.nn-xla": _jax_nn_attention("xla")}
        if seq <= naive_up_to:
            baselines["naive"] = functools.partial(kernels.reference_attention, causal=True)
        cases.append(Case(
            "attention", f"causal b{batch} s{seq} h{heads}/{kv_heads} d{head_dim}",
            {dispatched_name(): functools.partial(kernels.attention, causal=True)}, baselines,
            (q, k, v), (0, 1, 2), fwd_flops=flops, bwd_flops=3.5 * flops))  # backward: 5 products, + forward's 2
    return cases


def norm_and_rope_cases(rng, *, batch, seq, d_model, heads, head_dim) -> list[Case]:
    x = _rand(rng, (batch, seq, d_model))
    weight, bias = _rand(rng, (d_model,), scale=0.1) + 1.0, _rand(rng, (d_model,), scale=0.1)
    heads_x = _rand(rng, (batch, seq, heads, head_dim))
    positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
    shape, path = f"b{batch} s{seq} d{d_model}", dispatched_name()
    return [
        Case("rms_norm", shape, {path: kernels.rms_norm},
             {"naive": lambda x, w: reference_norm(x, w, None, eps=1e-6)}, (x, weight), (0, 1)),
        Case("layer_norm", shape, {path: kernels.layer_norm}, {"naive": functools.partial(reference_norm, eps=1e-5)},
             (x, weight, bias), (0, 1, 2)),
        Case("rope", f"b{batch} s{seq} h{heads} d{head_dim}", {path: kernels.apply_rope}, {"naive": reference_rope},
             (heads_x, positions), (0,)),
    ]


def ragged_dot_moe(x, router_w, w_in, w_out, *, top_k: int):
    """A dropless MoE on ``jax.lax.ragged_dot``: choices sorted by expert, two ragged products, unsorted, gated.

    The same routing, gates and aux loss as `kernels.moe_ffn` (`kernels.moe.route`), so the
    two compute the same function; only the grouped products differ.
    """
    tokens, d_model = x.shape
    num_experts = router_w.shape[1]
    gates, experts, probs = moe_routing.route(x, router_w, top_k)
    choices = experts.reshape(-1)  # [tokens * top_k]
    order = jnp.argsort(choices, stable=True)
    group_sizes = jnp.bincount(choices, length=num_experts).astype(jnp.int32)
    x_sorted = x[order // top_k]  # [tokens * top_k, d_model], grouped by expert
    h = jax.lax.ragged_dot(x_sorted, w_in, group_sizes, preferred_element_type=jnp.float32)
    h = jax.nn.gelu(h).astype(x.dtype)
    y_sorted = jax.lax.ragged_dot(h, w_out, group_sizes, preferred_element_type=jnp.float32)
    y_choices = jnp.zeros_like(y_sorted).at[order].set(y_sorted).reshape(tokens, top_k, d_model)
    y = jnp.einsum("tkd,tk->td", y_choices, gates).astype(x.dtype)
    return y, moe_routing.load_balancing_loss(probs, experts), {}


def moe_case(rng, *, tokens, d_model, d_ff, experts, top_k, dtype=jnp.float32, naive=True) -> Case:
    args = (_rand(rng, (tokens, d_model), dtype), _rand(rng, (d_model, experts)),
            _rand(rng, (experts, d_model, d_ff), dtype, scale=d_model ** -0.5),
            _rand(rng, (experts, d_ff, d_model), dtype, scale=d_ff ** -0.5))
    flops = 2 * tokens * top_k * 2 * d_model * d_ff  # the routed experts' two products
    baselines = {"ragged_dot": functools.partial(ragged_dot_moe, top_k=top_k)}
    if naive:
        baselines["naive"] = functools.partial(reference_moe_ffn, top_k=top_k)
    dtype_name = "" if dtype == jnp.float32 else f"{jnp.dtype(dtype).name} "
    return Case("moe_ffn", f"{dtype_name}t{tokens} d{d_model} f{d_ff} e{experts} k{top_k}",
                {dispatched_name(): functools.partial(kernels.moe_ffn, top_k=top_k)}, baselines,
                args, (0, 1, 2, 3), fwd_flops=flops, bwd_flops=3 * flops)


def scan_case(rng, *, batch, time_steps, dim) -> Case:
    a = jnp.asarray(rng.uniform(0.5, 1.0, (batch, time_steps, dim)).astype(np.float32))
    b = _rand(rng, (batch, time_steps, dim))
    return Case("linear_scan", f"b{batch} t{time_steps} d{dim}", {dispatched_name(): kernels.linear_scan},
                {"naive": reference_linear_scan}, (a, b), (0, 1))


def gpu_attention_cases(rng) -> list[Case]:
    """bf16 causal attention at FlashAttention-3's benchmark shapes (head_dim 128, 16 heads, 16k tokens a batch).

    The project's default on a GPU is cuDNN through ``jax.nn`` (so it should match the
    ``jax.nn-cudnn`` baseline); its chunked XLA path is timed too.
    """
    cases = []
    for seq in (2048, 4096, 8192, 16384):
        batch, heads, head_dim = 16384 // seq, 16, 128
        q, k, v = (_rand(rng, (batch, seq, heads, head_dim), jnp.bfloat16) for _ in range(3))
        flops = 4 * batch * heads * seq * seq * head_dim / 2
        paths = {"cudnn": functools.partial(kernels.attention, causal=True),
                 "xla": functools.partial(kernels.attention, causal=True, implementation="xla")}
        baselines = {"jax.nn-cudnn": _jax_nn_attention("cudnn"), "jax.nn-xla": _jax_nn_attention("xla")}
        if seq <= 4096:
            baselines["naive"] = functools.partial(kernels.reference_attention, causal=True)
        cases.append(Case("attention", f"causal bf16 b{batch} s{seq} h{heads} d{head_dim}", paths, baselines,
                          (q, k, v), (0, 1, 2), fwd_flops=flops, bwd_flops=3.5 * flops))
    return cases


def check_ragged_dot_baseline(rng) -> None:
    """The ragged_dot MoE computes what `kernels.moe_ffn` does (else its timings would compare other work)."""
    case = moe_case(rng, tokens=64, d_model=32, d_ff=64, experts=4, top_k=2)
    want = reference_moe_ffn(*case.args, top_k=2)[0]
    got = jax.jit(functools.partial(ragged_dot_moe, top_k=2))(*case.args)[0]
    error = float(jnp.abs(got - want).max())
    if error > 1e-4:
        raise AssertionError(f"the ragged_dot MoE baseline differs from the reference by {error}")


# ----------------------------------------------------------------------------- report


def print_ratios(rows: list[Row]) -> None:
    print(f"\n{'op':<11} {'shape':<36} {'path':<7} {'dir':<4} {'seconds':>9}  time as a ratio of each baseline")
    for r in rows:
        if r.baseline or r.vs is None:
            continue
        ratios = "  ".join(f"{name} {ratio:.2f}x" for name, ratio in r.vs.items())
        print(f"{r.op:<11} {r.shape:<36} {r.implementation:<7} {r.direction:<4} {r.seconds:9.4f}  {ratios}")


def write_rows(path: Path, rows: list[Row], ops: list[str] | None = None) -> None:
    """``rows`` into ``path``, replacing the rows of their backend (and of ``ops``, if given), keeping the others."""
    backends = {r.backend for r in rows}
    kept = []
    if path.exists():
        kept = [r for r in json.loads(path.read_text())
                if r.get("backend", "cpu") not in backends or (ops and r["op"] not in ops)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(kept + [dataclasses.asdict(r) for r in rows], indent=1) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller shapes and fewer repeats")
    parser.add_argument("--gpu", action="store_true", help="bf16 attention at FA3 shapes and a bf16 MoE (GPU only)")
    parser.add_argument("--ops", nargs="+", help="only these ops (their rows replace only theirs)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    rng = np.random.default_rng(0)
    host = machine()
    repeats = 2 if args.quick else 3
    check_ragged_dot_baseline(rng)
    if args.gpu:
        if dispatch.backend() != "gpu":
            parser.error(f"--gpu needs a GPU backend; this one is {dispatch.backend()!r}")
        cases = gpu_attention_cases(rng) + [
            moe_case(rng, tokens=16384, d_model=1024, d_ff=4096, experts=8, top_k=2, dtype=jnp.bfloat16,
                     naive=False),
            moe_case(rng, tokens=4096, d_model=512, d_ff=1024, experts=8, top_k=2)]
    elif args.quick:
        cases = attention_cases((1024, 2048), rng) + norm_and_rope_cases(
            rng, batch=2, seq=1024, d_model=512, heads=8, head_dim=64) + [
            moe_case(rng, tokens=1024, d_model=256, d_ff=512, experts=8, top_k=2),
            scan_case(rng, batch=2, time_steps=1024, dim=256)]
    else:
        cases = attention_cases((1024, 2048, 4096, 8192), rng, naive_up_to=4096) + norm_and_rope_cases(
            rng, batch=4, seq=2048, d_model=1024, heads=16, head_dim=64) + [
            moe_case(rng, tokens=4096, d_model=512, d_ff=1024, experts=8, top_k=2),
            scan_case(rng, batch=4, time_steps=4096, dim=512)]

    if args.ops:
        cases = [case for case in cases if case.op in args.ops]
    print(f"{host}\n", flush=True)
    start = time.perf_counter()
    rows = []
    for case in cases:
        rows += run_case(case, repeats=repeats, host=host)
        write_rows(args.out, rows, args.ops)  # after every case, so a run cut short keeps what it measured
    print_ratios(rows)
    print(f"\n{len(rows)} rows in {time.perf_counter() - start:.0f} s -> {args.out}")


if __name__ == "__main__":
    main()
