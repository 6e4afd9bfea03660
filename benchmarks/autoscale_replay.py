"""The real controller against its simulator, over replayed spot traces in compressed time.

For each trace window a small autoscaled job (a tiny LM, v4-8 on spot or on-demand, a
deadline) runs through the real controller on a local cluster whose spot capacity is
the trace (`provider: local` with `capacity_trace:`, `--scale` trace seconds a wall
second). When it ends, what it paid is read from the store: each slice's billed window
(requests that waited and were refused are never billed), in trace time, at catalog
prices. The same window is then replayed in `policies.evaluation.simulator` (the product's mode:
knowledge "own", make-before-break) with the restart costs and the speed the job
measured, and the two costs are compared.

    python benchmarks/autoscale_replay.py [--scale 20] [--steps 12000] [--deadline-s 3000] [--max-slices 2]
                                          [--priors a-priori|compiled]

Priors (`--priors`): before the job has measured an option, the controller prices it by the
scaling model ("a-priori", the default), or ("compiled") by the TPU compiler's report of the
job's step on it (`orchestrator.control.priors`): the replay compiles the tiny job's step for
v4-8 (and 2 x v4-8 with `--max-slices 2`) into the fresh state directory's tpu-programs
before it submits, as `orchestrator submit --compile` would, and the simulator prices the
options the same way. The results say which priors each option had before the job measured
anything (`priors_before_measuring`), read back with the controller's own function.

Writes benchmarks/results/autoscale_replay.json: per trace `controller_cost`,
`simulator_cost`, `ratio`, `deadlines_met`, and the slice sequences of both. With
`--max-slices N` (N > 1) the policy also chooses slice counts (`autoscaling.max_slices`), the
simulator replays the same options over counts, each count the job ran on priced at the speed
it measured there, and the results go to autoscale_replay_slices.json (with `--priors compiled`,
to autoscale_replay_slices_compiled.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orchestrator import catalog  # noqa: E402
from orchestrator.control.autoscaler import counted_options  # noqa: E402
from orchestrator.control.priors import kept_steps, programs_dir, with_priors  # noqa: E402
from orchestrator.domain.options import job_options  # noqa: E402
from orchestrator.domain.spec import LmWorkload  # noqa: E402
from orchestrator.observe.goodput import billed_slices  # noqa: E402
from orchestrator.state.events import EventKind  # noqa: E402
from policies.cost.compiled_prior import CompiledStep, priced  # noqa: E402
from policies.cost.policy import CostPolicy  # noqa: E402
from policies.cost.restart_cost import RestartCost  # noqa: E402
from policies.evaluation.simulator import SimJob, simulate  # noqa: E402
from policies.evaluation.traces import load_trace  # noqa: E402

TINY_MODEL = {"d_model": 64, "n_layers": 1, "n_heads": 4, "d_ff": 128}
ACCELERATORS, TIERS = ["v4-8"], ["spot", "on-demand"]


def write_trace(path: Path, counts: list[int], gap_s: float = 60.0) -> str:
    path.write_text(json.dumps({"metadata": {"gap_seconds": gap_s}, "data": counts}))
    return str(path)


def outage_trace(up: int, down: int, cycles: int = 2, tail: int = 200) -> list[int]:
    """`cycles` spot outages of `down` ticks, each after `up` ticks of capacity, then capacity."""
    return ([1] * up + [0] * down) * cycles + [1] * tail


def job_spec(name: str, trace: str, ckpt: Path, *, scale: float, start_s: float = 0.0, steps: int,
             deadline_s: float, interval: int = 100, max_slices: int = 1) -> dict:
    """A tiny autoscaled LM job whose spot capacity is `trace` replayed `scale` times faster."""
    return {"name": name, "accelerator": "v4-8", "tier": "spot",
            "workload": {"type": "lm", "steps": steps, "global_batch_size": 16, "seq_len": 32, "model": TINY_MODEL,
                         "learning_rate": {"warmup_steps": 2}},
            "checkpoint": {"interval_steps": interval, "directory": str(ckpt)},
            "recovery": {"start_timeout_s": 120, "max_failures": 0},
            "autoscaling": {"accelerators": ACCELERATORS, "tiers": TIERS, "max_slices": max_slices},
            "deadline": f"PT{int(deadline_s)}S",
            "capacity_trace": {"path": trace, "time_scale": scale, "start_s": start_s}}


@dataclass(frozen=True)
class Measured:
    """What the controller's run shows, in trace seconds and dollars."""

    cost_usd: float
    slices: list[tuple[str, str]]  # (accelerator, tier) of each billed slice, in order
    finish_s: float  # from submission
    deadline_met: bool
    restart: RestartCost
    tokens_per_s: float  # trace time
    total_tokens: float
    refused_billed: int  # requests that waited and were released unfilled, yet billed (must be 0)
    by_count: dict[int, float] = field(default_factory=dict)  # tokens/s (trace time) on each slice count it ran on
    max_slices: int = 1


def measure(store, job_id: str, *, scale: float) -> Measured:
    """The controller's figures for a finished job, from its store records, in trace time."""
    job = store.job(job_id)
    events = store.events(job_id)
    end = events[-1].at
    billed = billed_slices(events, end=end)
    cost = sum((b.end - b.start) * scale / 3600 * b.usd_per_hour for b in billed)
    states = {}
    for e in events:
        if e.kind is EventKind.SLICE:
            states.setdefault(e.payload.name, []).append(e.payload.state)
    never_up = {n for n, ss in states.items() if "READY" not in ss and "WAITING" in ss}
    refused_billed = len(never_up & {b.name for b in billed})
    spec = job.spec
    w = spec.workload
    assert isinstance(w, LmWorkload) and w.steps is not None and spec.deadline is not None, "the replayed lm job"
    tokens_per_step = w.global_batch_size * w.seq_len
    step_s = effective_step_s(store.steps(job_id))
    restart = RestartCost(provisioning_s=statistics.median(provisioning_times(events)) * scale,
                          startup_s=statistics.median(startup_times(events, store.steps(job_id))) * scale,
                          checkpoint_interval_s=spec.checkpoint.interval_steps * step_s * scale,
                          save_s=0.0)  # the effective step time has the saves in it already
    finish_s = (end - job.created_at) * scale
    deadline_s = spec.deadline.total_seconds()
    count_of = {e.payload.generation: e.payload.slices or 1 for e in events if e.kind is EventKind.LAUNCHED}
    by_count = {}
    for n in set(count_of.values()):
        ran = [m for m in store.steps(job_id) if count_of.get(m.generation) == n]
        if len(ran) > 2:
            by_count[n] = tokens_per_step / effective_step_s(ran) / scale
    auto = spec.autoscaling
    return Measured(cost, [(b.accelerator, b.tier) for b in billed], finish_s,
                    job.state.value == "SUCCEEDED" and finish_s <= deadline_s, restart,
                    tokens_per_step / step_s / scale, float(w.steps * tokens_per_step), refused_billed,
                    by_count, auto.max_slices if auto is not None else 1)


def effective_step_s(steps) -> float:
    """Wall seconds a step takes while a generation trains, saves and reports included: the
    span of each generation's steps over their count (the median step time leaves the rest out)."""
    by_gen: dict[int, list[float]] = {}
    for m in steps:
        by_gen.setdefault(m.generation, []).append(m.at)
    spans = [(max(ats) - min(ats), len(ats) - 1) for ats in by_gen.values() if len(ats) > 1]
    return sum(t for t, _ in spans) / sum(n for _, n in spans)


def provisioning_times(events) -> list[float]:
    """Per slice that came up: from capacity (PROVISIONING, or the request) to READY; waiting excluded."""
    seen: dict[str, dict[str, float]] = {}
    for e in events:
        if e.kind is EventKind.SLICE:
            seen.setdefault(e.payload.name, {}).setdefault(e.payload.state, e.at)
    return [s["READY"] - s.get("PROVISIONING", s["REQUESTED"]) for s in seen.values() if "READY" in s]


def startup_times(events, steps) -> list[float]:
    """Per generation: from its STARTING transition (slice ready) to its first step done."""
    starts = [e.at for e in events if e.kind is EventKind.STATE and e.to_state == "STARTING"]
    firsts: dict[int, float] = {}
    for m in steps:
        firsts[m.generation] = min(firsts.get(m.generation, m.at), m.at)
    return [firsts[g] - at for g, at in enumerate(starts, 1) if g in firsts]


def simulate_window(trace_path: str, m: Measured, *, start_s: float, deadline_s: float, spec=None,
                    compiled: dict[str, CompiledStep] | None = None):
    """The simulator's run of the same job on the same window, with the controller's measured costs
    (`compiled`: the compiled priors, for the counts the job did not run on)."""
    options = tuple(job_options(ACCELERATORS, TIERS, measured_tokens_per_s={"v4-8": m.tokens_per_s}))
    if spec is not None and m.max_slices > 1:
        # The controller's options over counts (`counted_options`): one slice at its own measured speed,
        # each count the job ran on at the speed it measured there, the others by the scaling model.
        one = m.by_count.get(1) or min(v / n for n, v in m.by_count.items())
        singles = tuple(job_options(ACCELERATORS, TIERS, measured_tokens_per_s={"v4-8": one}))
        w = spec.workload
        counted = counted_options(spec, singles, w.global_batch_size * w.seq_len)
        options = tuple(replace(o, tokens_per_s=m.by_count.get(o.count, o.tokens_per_s)) if o.count > 1 else o
                        for o in counted)
        if compiled:
            measured = {o.what: v for o in counted if (v := m.by_count.get(o.count)) is not None}
            options = priced(counted, compiled, measured).options
    job = SimJob(m.total_tokens, deadline_s, options)
    return simulate(CostPolicy(), job, load_trace(trace_path), start_s=start_s, restart=m.restart,
                    knowledge="own", release_first=False)


def sim_slices(run) -> list[tuple[str, str]]:
    """(accelerator, tier) of each slice the simulator ran, from its decisions."""
    out = []
    for d in run.decisions:
        if d.option != "wait" and (not out or out[-1] != d.option):
            out.append(d.option)
    return out


def compile_options(spec) -> None:
    """The job's step on each option it may run on (1 to `max_slices` x v4-8), compiled by XLA's TPU compiler
    into the state directory's tpu-programs, where the controller reads its priors (as `submit --compile`)."""
    from orchestrator.control.tpu_compile import step_report

    auto = spec.autoscaling
    for name in ACCELERATORS:
        for count in range(1, (auto.max_slices if auto is not None else 1) + 1):
            step_report(spec, catalog.lookup(name), count, cache_dir=programs_dir())


def options_of(spec):
    """The controller's options for `spec` before it measured anything: the scaling model's."""
    w = spec.workload
    return counted_options(spec, job_options(ACCELERATORS, TIERS), w.global_batch_size * w.seq_len)


def priors_before_measuring(spec) -> dict[str, str]:
    """The prior the controller gives each of `spec`'s options before it measured any (`with_priors`)."""
    found = with_priors(spec, options_of(spec), {})
    return {what: prior + (f" ({c.source}, {c.share:.2f} of the roofline)" if (c := found.calibrations.get(what))
                           else "") for what, prior in found.priors.items()}


def replay(client, name: str, trace: str, workdir: Path, *, scale: float, steps: int, deadline_s: float,
           start_s: float = 0.0, timeout_s: float = 900.0, max_slices: int = 1, priors: str = "a-priori") -> dict:
    """Run one window through the controller and the simulator; the figures of both."""
    from orchestrator import JobSpec

    spec = JobSpec.from_dict(job_spec(name, trace, workdir / f"ckpt-{name}", scale=scale, start_s=start_s,
                                      steps=steps, deadline_s=deadline_s, max_slices=max_slices))
    if priors == "compiled":
        compile_options(spec)
    job = client.submit(spec)
    st = job.wait(timeout_s=timeout_s)
    m = measure(client.store, job.id, scale=scale)
    stored = client.store.job(job.id).spec  # the spec the controller priced, as it priced it
    compiled = kept_steps(stored, options_of(stored)) if priors == "compiled" else None
    run = simulate_window(trace, m, start_s=start_s, deadline_s=deadline_s, spec=spec, compiled=compiled)
    return {"job": job.id, "state": st.state.value, "failures": client.store.job(job.id).failures,
            "controller_cost": round(m.cost_usd, 4), "simulator_cost": round(run.cost_usd, 4),
            "ratio": round(m.cost_usd / run.cost_usd, 4) if run.cost_usd else None,
            "deadlines_met": {"controller": m.deadline_met, "simulator": run.deadline_met},
            "controller_slices": [f"{a} {t}" for a, t in m.slices], "simulator_slices": sim_slices(run),
            "controller_finish_s": round(m.finish_s, 1), "simulator_finish_s": run.finish_s,
            "refused_billed": m.refused_billed,
            "priors_before_measuring": priors_before_measuring(stored),
            "tokens_per_s_by_slice_count": {str(n): round(v, 1) for n, v in sorted(m.by_count.items())},
            "restart_s": {"provisioning": round(m.restart.provisioning_s, 1),
                          "startup": round(m.restart.startup_s, 1)}}


PRIORS_USED = {
    "a-priori": "a-priori: policies.cost.slice_options.ScalingModel before an option is measured, scaled to what "
                "the job measured",
    "compiled": "compiled: a share of the TPU compiler's roofline of the job's step (policies.cost.compiled_prior), "
                "calibrated on the job's measured option, else MaxText's published 0.55; measured speed wins",
}

TRACES = {  # name -> (up ticks, down ticks) of a 60 s tick: two outages each, then capacity
    "short-outages": (12, 6),
    "long-outages": (12, 15),
    "flapping": (6, 4),
}


def main() -> None:
    from benchmarks.common import fresh_client, machine, save

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", type=float, default=20.0, help="trace seconds per wall second")
    p.add_argument("--steps", type=int, default=12000)
    p.add_argument("--deadline-s", type=float, default=3000.0,
                   help="the jobs' deadline in trace seconds (about 1.75x their time on one undisturbed slice)")
    p.add_argument("--max-slices", type=int, default=1, help="autoscaling.max_slices: the policy chooses counts too")
    p.add_argument("--priors", choices=("a-priori", "compiled"), default="a-priori",
                   help="how the controller prices an option before the job measured it: the scaling model, or "
                        "the TPU compiler's report of the job's step (compiled here first; needs libtpu)")
    args = p.parse_args()
    client = fresh_client()
    results = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name, (up, down) in TRACES.items():
                trace = write_trace(Path(tmp) / f"{name}.json", outage_trace(up, down))
                t0 = time.time()
                results[name] = replay(client, name, trace, Path(tmp), scale=args.scale, steps=args.steps,
                                       deadline_s=args.deadline_s, max_slices=args.max_slices,
                                       priors=args.priors)
                results[name]["wall_s"] = round(time.time() - t0, 1)
                print(name, json.dumps(results[name]), flush=True)
    finally:
        client.down()
    ratios = [r["ratio"] for r in results.values() if r["ratio"]]
    name = "autoscale_replay" if args.max_slices == 1 else "autoscale_replay_slices"
    save(name if args.priors == "a-priori" else f"{name}_compiled",
         {"machine": machine(), "scale": args.scale, "steps": args.steps, "deadline_s": args.deadline_s,
          "max_slices": args.max_slices, "priors": PRIORS_USED[args.priors], "traces": results,
          "mean_ratio": round(statistics.mean(ratios), 4) if ratios else None,
          "within_10_percent": all(abs(r - 1) <= 0.10 for r in ratios)})


if __name__ == "__main__":
    main()
