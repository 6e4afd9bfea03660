"""The built-in trainer's step compiled by XLA's TPU compiler for each slice option, against our own models.

    python benchmarks/tpu_compile.py [--models 100m,1b] [--targets v4-16,v4-32,v4-64,2xv4-16,4xv4-16,2xv4-32]

For each model x target the step is compiled as the job's hosts would compile it
(`orchestrator.control.tpu_compile.compile_step`: the job spec's settings resolved for that slice
type and count, mesh, microbatches from ``gradient_accumulation: auto``, precision, remat, the
Pallas kernels) on this machine, which has no TPU: libtpu's compiler compiles for a topology
(`workers.tpu_target`), and nothing runs. Each compile runs in a process of its own (no cache or
compiled program carries over). The jobs:

- ``1b``: ``examples/plan-1b.yaml`` as it is (24 layers, d_model 2048, vocab 32,000, mesh
  ``{data: 1, fsdp: -1}``, 256 x 2048 tokens a step), what ``benchmarks/cost.py`` prices;
- ``100m``: the same file with the ~100M model of ``benchmarks/mfu.py`` (14 layers, d_model 768,
  12 heads, d_ff 3072, vocab 256) and the default mesh ``{data: -1}`` (plain data parallel: its
  model state is 1.6 GB a chip), the same 256 x 2048-token global batch.

Per row:

- ``compile_s``: the compile's wall seconds on this machine (2 cores, shared with other work:
  indicative only);
- memory: the compiler's HBM per chip (`ProgramReport.hbm_bytes_per_chip`: live arguments and
  outputs, temporaries, code) against `policies.model.memory_fit.estimate` for the same mesh and
  microbatch count, and the usable HBM the fit check plans against (90% of the chip's);
- FLOPs per step over all chips: the compiled program's, counted by `workers.program_counts`
  (dots and convolutions, and the FLOPs the Pallas kernels declare with ``pl.CostEstimate``,
  each loop body times its trip count), against the formula MFU uses
  (`ModelShape.flops_per_token` x tokens a step); this is the count `--compile` reports
  (`workers.tpu_target.report`). XLA's own cost analysis counts every loop body once: the
  layers' scan and the microbatches' here, and the loops the compiler itself makes (fsdp's
  all-gathered matmuls become 2- to 8-trip loops of collective permutes and partial matmuls
  on the 1B job). The benchmark keeps XLA's figure (``xla_flops``) beside this count taken
  the same way, each body once (``hlo_flops_once``: within 1%, XLA adds elementwise arithmetic),
  which checks the reading of the program. Attention is in the figure as far as its kernels
  declare a cost (the flash kernel's band of visited blocks: the causal mask's skipped blocks
  are not counted, where the formula counts the full ``12 L d s``);
- a step time: XLA's ``optimal_seconds`` where it gives one for the whole step (it does not: its
  cost model also counts loop bodies once, and for these programs answers negative, unknown),
  else a roofline from the program's own counts per chip, max(FLOPs / peak bf16 FLOP/s, HBM
  bytes / HBM bandwidth) (`kernels.hardware`), the bytes those of arrays in the default memory
  space (the compiler's other spaces, on-chip or scratch, left out: the time stays a lower
  bound). A lower bound on the step time, not a measured time and not calibrated against
  hardware: it leaves out collectives over ICI and DCN, kernel launches and pipeline bubbles,
  and any compute below peak. The tokens/s and MFU it implies are upper bounds (an MFU above 1
  says the formula counts FLOPs the program does not do: causal attention's skipped blocks);
  beside them the a-priori tokens/s of the cost policy's `ScalingModel` for the job's own
  FLOPs a token (with `dcn_efficiency` for several slices), as the autoscaler prices the
  option before the job has measured it (143k tokens/s on v4-16 in ``benchmarks/cost.py`` is
  for its default ~1.0B-parameter model; plan-1b.yaml's model has 1.34B with its
  embeddings, hence 112k).

Writes `benchmarks/results/tpu_compile.json` (`--out` elsewhere).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.mfu import PRESETS  # noqa: E402

GIB = 2**30
MODELS = ("100m", "1b")
TARGETS = ("v4-16", "v4-32", "v4-64", "2xv4-16", "4xv4-16", "2xv4-32")
SPEC_1B = ROOT / "examples" / "plan-1b.yaml"


def job_spec(model: str):
    """The job file of `model` (module docstring)."""
    from orchestrator.domain.spec import JobSpec

    spec = JobSpec.from_yaml(SPEC_1B)
    if model == "1b":
        return spec
    shape, seq_len, _ = PRESETS["100m"]
    data = spec.model_dump(mode="json", exclude_none=True)
    data["name"] = "lm-100m"
    data["workload"].update(model=dict(shape), seq_len=seq_len, mesh={"data": -1})
    return JobSpec.from_dict(data, source="benchmarks/tpu_compile.py:100m")


def parse_target(target: str) -> tuple[str, int]:
    """"2xv4-16" -> ("v4-16", 2); "v4-32" -> ("v4-32", 1)."""
    count, sep, name = target.partition("x")
    return (name, int(count)) if sep and count.isdigit() else (target, 1)


def compile_row(model: str, target: str, *, keep_hlo: str | None = None) -> dict:
    """One model x target: compile, then set the compiler's figures beside ours (runs in a child process)."""
    from orchestrator import catalog
    from orchestrator.control import tpu_compile
    from orchestrator.domain.fit import training_job
    from policies.model.memory_fit import USABLE_FRACTION, estimate
    from policies.model.sharding import MeshPlan
    from workers import program_counts as hlo_counts

    spec = job_spec(model)
    name, slices = parse_target(target)
    t = catalog.lookup(name)
    kept: list = []  # compile_step returns the compiler's report; the program and its settings are kept here
    real = tpu_compile.compile_train_step

    def compile_and_keep(lm, settings, topology, **kwargs):
        compiled, report = real(lm, settings, topology, **kwargs)
        kept.append((compiled, settings))
        return compiled, report

    with mock.patch.object(tpu_compile, "compile_train_step", compile_and_keep):
        report = tpu_compile.compile_step(spec, t, slices)
    assert len(kept) == 1, "compile_step compiles the step through workers.tpu_target.compile_train_step"
    compiled, settings = kept[0]

    w, chips = spec.workload, report.chips
    data, fsdp, model_axis = settings.mesh_shape  # data spans every slice
    mesh = MeshPlan(data, fsdp, model_axis, num_hosts=t.hosts * slices, global_batch_size=settings.global_batch_size)
    est = estimate(training_job(w), mesh, settings.microbatches)
    usable = t.hbm_bytes_per_chip * USABLE_FRACTION

    text = compiled.as_text()
    if keep_hlo:
        Path(keep_hlo).mkdir(parents=True, exist_ok=True)
        (Path(keep_hlo) / f"{model}_{target}.hlo.txt").write_text(text)
    program, once = hlo_counts.counts(text), hlo_counts.counts(text, loops=False)
    tokens = settings.global_batch_size * settings.seq_len
    formula = w.model.shape().flops_per_token(w.seq_len) * tokens
    chip = t.generation.chip
    peak, bandwidth = chip.peak_bf16_tflops * 1e12, chip.hbm_gbps * 1e9
    compute_s, memory_s = program.flops / peak, program.hbm_bytes / bandwidth
    looped = any(n > 1 for _, n in program.loops)
    if report.optimal_s is not None and not looped:
        step_s, bound = report.optimal_s, "xla optimal_seconds"
    else:
        step_s, bound = max(compute_s, memory_s), "compute" if compute_s >= memory_s else "HBM bandwidth"

    return {
        "model": model, "target": target, "accelerator": name, "slices": slices, "chips": chips,
        "topology": report.target, "mesh": list(settings.mesh_shape), "microbatches": settings.microbatches,
        "tokens_per_step": tokens, "compile_s": round(report.compile_s, 1),
        "memory": {
            "compiler_hbm_gib": report.hbm_bytes_per_chip / GIB,
            "estimate_gib": est.total / GIB,
            "compiler_over_estimate": report.hbm_bytes_per_chip / est.total,
            "usable_gib": usable / GIB,
            "compiler_fits_usable": report.hbm_bytes_per_chip <= usable,
            "compiler_gib": {k: getattr(report, f"{k}_bytes") / GIB
                             for k in ("argument", "output", "alias", "temp", "code")},
            "estimate_parts_gib": {k: v / GIB for k, v in est.parts.items()},
            "estimate_tokens_per_microbatch_chip": est.tokens,
        },
        "flops": {
            "compiler_per_step": program.flops * chips,
            "formula_per_step": formula,
            "compiler_over_formula": program.flops * chips / formula,
            "kernels_declared_per_step": program.kernel_flops * chips,
            # XLA's cost analysis: every loop body once
            # microbatch loops unrolled (the compiler's own loops, such as fsdp's collective matmuls, still once)
            "xla_flops_per_step": report.xla_flops_per_chip * chips,
            "hlo_flops_once_per_step": once.flops * chips,  # our count taken the same way: checks the reading
            "loops": [list(x) for x in program.loops],
        },
        "step": {
            "seconds": step_s, "bound": bound,
            "compute_s": compute_s, "hbm_s": memory_s,
            "hbm_bytes_per_chip": program.hbm_bytes,  # default memory space, every loop trip
            "bytes_all_memory_spaces_per_chip": program.bytes_accessed,
            "hlo_bytes_once_per_chip": once.bytes_accessed,  # our count taken the same way: checks the reading
            "xla_optimal_s": report.optimal_s,
            "tokens_per_s": tokens / step_s,
            "mfu": formula / (step_s * chips * peak),
            "scaling_model_tokens_per_s": scaling_model_tokens_per_s(spec, name, slices),
        },
    }


def scaling_model_tokens_per_s(spec, name: str, slices: int) -> float:
    """The cost policy's a-priori speed for `slices` x `name`, built as the autoscaler builds its options."""
    from orchestrator.domain.options import job_options
    from policies.cost.slice_options import MultiSlice, multi_slice_options

    w = spec.workload
    singles = job_options([name], ["on-demand"], flops_per_token=w.model.shape().flops_per_token(w.seq_len))
    multi = MultiSlice(float(w.model.shape().num_params()), float(w.global_batch_size * w.seq_len),
                       max_count=max(slices, 1))
    options = multi_slice_options(singles, multi, slices)
    return next(o.tokens_per_s for o in options if o.count == slices)


def run_alone(model: str, target: str, timeout_s: float, extra: list[str]) -> dict:
    """`compile_row` in a fresh process; a failure is a row with its error."""
    cmd = [sys.executable, __file__, "--one", model, target, *extra]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return {"model": model, "target": target, "error": f"no answer in {timeout_s:.0f} s"}
    if r.returncode != 0:
        tail = [line for line in r.stderr.splitlines() if line.strip()][-3:]
        return {"model": model, "target": target, "error": " | ".join(tail)[-600:],
                "wall_s": round(time.perf_counter() - t0, 1)}
    row = json.loads(r.stdout.strip().splitlines()[-1])
    row["process_wall_s"] = round(time.perf_counter() - t0, 1)  # start-up, compile(s), counting
    return row


def table(rows: list[dict]) -> str:
    head = ("model", "target", "mb", "compile s", "HBM GiB compiler / estimate (usable)", "FLOPs compiler / formula",
            "roofline step s", "tokens/s", "MFU", "ScalingModel tokens/s")
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['model']} | {r['target']} | error: {r['error'][:160]}")
            continue
        m, f, s = r["memory"], r["flops"], r["step"]
        lines.append(" | ".join((
            r["model"], r["target"], str(r["microbatches"]), f"{r['compile_s']:.0f}",
            f"{m['compiler_hbm_gib']:.1f} / {m['estimate_gib']:.1f} = {m['compiler_over_estimate']:.2f} "
            f"({m['usable_gib']:.1f})",
            f"{f['compiler_per_step'] / 1e15:.3g} / {f['formula_per_step'] / 1e15:.3g} PF = "
            f"{f['compiler_over_formula']:.2f}",
            f"{s['seconds']:.3f} ({'HBM' if s['bound'] == 'HBM bandwidth' else s['bound']})",
            f"{s['tokens_per_s'] / 1e3:,.0f}k", f"{s['mfu']:.2f}", f"{s['scaling_model_tokens_per_s'] / 1e3:,.0f}k")))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--targets", default=",".join(TARGETS), help="slice types, NxTYPE for N slices of TYPE")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds for one compile")
    p.add_argument("--keep-hlo", metavar="DIR", help="write each compiled program's text (after optimization) here")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "tpu_compile.json"))
    p.add_argument("--one", nargs=2, metavar=("MODEL", "TARGET"), help=argparse.SUPPRESS)  # a child's run
    args = p.parse_args()
    if args.one:
        print(json.dumps(compile_row(*args.one, keep_hlo=args.keep_hlo)), flush=True)
        return
    extra = ["--keep-hlo", args.keep_hlo] if args.keep_hlo else []
    from importlib import metadata

    import jax

    models, targets = args.models.split(","), args.targets.split(",")
    for m in models:
        if m not in MODELS:
            raise SystemExit(f"--models: {m!r} is not one of {', '.join(MODELS)}")
    t0, rows = time.perf_counter(), []
    for model in models:
        for target in targets:
            rows.append(run_alone(model, target, args.timeout, extra))
            print(json.dumps(rows[-1]), flush=True)
    print(table(rows))
    out = {
        "command": "python benchmarks/tpu_compile.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()} {os.cpu_count()} cores, no TPU: XLA's TPU compiler (libtpu) for a "
                   "topology, nothing runs",
        "jax": jax.__version__, "libtpu": metadata.version("libtpu"), "wall_s": round(time.perf_counter() - t0),
        "jobs": {"1b": "examples/plan-1b.yaml",
                 "100m": "examples/plan-1b.yaml with benchmarks/mfu.py PRESETS['100m'] and mesh {data: -1}: "
                         "256 x 2048 tokens a step"},
        "notes": {
            "flops": "the compiled program's dots and convolutions and the Pallas kernels' declared FLOPs "
                     "(pl.CostEstimate), each loop body times its trip count (workers/program_counts.py); "
                     "xla_flops_per_step is XLA's cost analysis, which counts each loop body once",
            "step": "a roofline lower bound from the compiler's counts per chip, max(FLOPs / peak, HBM bytes / HBM "
                    "bandwidth): not measured, not calibrated against hardware, no collectives; tokens/s and MFU "
                    "are the upper bounds it implies",
            "memory": "compiler: arguments + outputs - aliased + temporaries + code, per chip; estimate: "
                      "policies.model.memory_fit.estimate for the same mesh and microbatch count",
        },
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
