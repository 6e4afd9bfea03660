"""Cost of the cost-aware policy against the baselines and the hindsight optimum, on every trace.

    python benchmarks/cost.py [--windows N] [--jobs N] [--deadline X] [--sweep X,Y]
                              [--policies product,ondemand,...] [--out PATH]
    python benchmarks/cost.py --priors [--windows N]     # results/cost_priors.json

Priors: the headline job's options are priced a priori, by the scaling model (`job.priors`
in the results). `--priors` instead runs the job the TPU compiler compiled
(examples/plan-1b.yaml: 1.34B parameters, 256 x 2048 tokens a step, 20B tokens, deadline
36 h, up to 4 slices where the batch splits) twice on every trace: priced a priori, and
with compiled priors (`policies.cost.compiled_prior`: 0.55, MaxText's published MFU, of the
roofline in results/tpu_compile.json); each row says which priors each option got. The
simulator trains at the speeds the policy is given, so each prior is its own world: compare
the choices and the product against the optima within one, not dollars across them.

Issue 38: the simulator charges a grow, a shrink and a move the relaunch the controller pays
(`RestartCost.reshape_s`, the startup unless given); both optima are lower bounds by construction
(a relaxation of the simulator: `policies.evaluation.hindsight`); each prices up to `--schedules`
clairvoyant schedules in the simulator for each of its tries (aimed at the deadline, and 0.5, 1 and 2 h
before it: `hindsight.SCHEDULE_MARGINS_S`), and `best_known_over_bound` (per trace and in the
summary) is the cheapest run that met the deadline on each window, of every policy run and those
schedules, over the bound. `--scaling pessimistic` prices the options with the all-reduce not
hidden and no large-slice penalty (`policies.cost.scaling_assumptions`; results/
cost_pessimistic.json). The summary is repeated for the tune and the check set
(`policies.evaluation.traces.tune_and_check`) under `sets`; `--traces tune` runs one set alone.

Quick iterations: `--windows 1 --sweep '' --policies product,ondemand` runs the product,
the on-demand baseline and both optima on one window a trace at one deadline (about a
tenth of the full run).

The job (fixed before looking at any result, and the same on every trace):

- a ~1B-parameter dense decoder (24 layers, d_model 2048, 2048-token sequences)
  trained on 20B tokens (about 20 tokens per parameter), throughput from the scaling
  model in `policies.cost.slice_options.ScalingModel` on v4 (v4-16: 143k, v4-32: 270k,
  v4-64: 507k tokens/s);
- options: 1 to 4 slices of one type at once, at most 32 chips (v4-16 x1..4, v4-32
  x1..2, v4-64 x1), on spot and on-demand, catalog prices (N x the slice's). N slices
  train at N x one slice's speed x `policies.cost.slice_options.dcn_efficiency` for a
  global batch of 512 x 2048 tokens (1.0 here: the gradient all-reduce over the data-
  center network hides behind the backward pass); losing one slice of several is a
  shrink (the job trains on the others, nothing lost), losing the last a full restart;
- deadline 1.75x the on-demand v4-32 duration (20.7 h -> 36.0 h): a v4-16 alone
  could not make it, so the policy must trade size against tier;
- restart figures: the defaults of `policies.cost.restart_cost.RestartCost` (120 s
  provisioning, 240 s startup, the same 240 s to relaunch a group that grows or shrinks, a
  checkpoint at least every 600 s, each save costing 5 s).

Each trace (see policies/evaluation/traces/README.md: AWS GPU traces standing in for one TPU
slice family in one zone) is replayed from `--windows` start times spread evenly over
it. Policies: `product` and `policy` (policies.cost.policy.CostPolicy, online, from its priors and
what it observes; see below), `ondemand`
(fixed on-demand v4-32), `spot_restart` (fixed spot v4-32, waits and restarts),
`greedy` (spot v4-32, on-demand v4-32 to the end once slack runs out), `optimum`
(the clairvoyant lower bound of policies.evaluation.hindsight.hindsight_optimum, over every
slice count) and `optimum_single` (the same over one slice at a time: the optimum before
multi-slice options, `single_slice_optimum`). One more row,
`policy_notice`, is the capacity-fed policy in a world where every preemption notice leaves
time to commit a checkpoint (`RestartCost.saves_on_notice`): an assumption, shown
beside the headline figures, never in them.

The headline is `product`: the policy as the product runs it, through the snapshot
builder the autoscaler uses (`policies.cost.knowledge`): it knows only what the job's own
slices show and what the job before it in the zone learned (`simulate(knowledge=
"pooled")`: one job replayed back to back just before this one on the same trace), and it
moves make-before-break (a request waits beside the running slice; the spot size its plan
waits for stays requested; the switch comes when the new slice is READY). Beside it:
`policy_own` (the same without the pooled memory), `policy_own_release_first` (own
knowledge, releasing the running slice before requesting the next, with a 5-minute queue
timeout: the controller before make-before-break), `product_one_slice` (the product on one
slice at a time, as the controller runs it until it is wired for several), and `policy`, the same policy fed
the zone's capacity at every step (`knowledge="trace"`), the upper bound of what knowing
more could give.

`by_deadline` repeats the summary at other deadlines (`--sweep`, default 1.25x, 2.5x
and 3.5x): how much a looser deadline saves, for the policy and for the optimum.

Per trace and policy: `cost_per_btok` and `hours` are means over the windows, and
`deadline_met` is true only if every window met it; `unfilled_requests` are the spot
requests created and given back before they were filled (on GCP each is a queued
resource created and deleted), `shrinks` the losses of one slice of several, and
`hours_by_slice_count` the billed hours on 1, 2, 3 or 4 slices, means over the windows.
The summary gives the product against both optima, its worst trace, deadlines missed and
unfilled requests per job. The optimum's `cost_per_btok`
is the lower bound; `schedule_cost_per_btok` and `hours` are those of a clairvoyant
schedule found along the way (the true optimum lies between the two).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orchestrator.control.autoscaler import counted_options  # noqa: E402
from orchestrator.domain.options import job_options  # noqa: E402
from orchestrator.domain.spec import JobSpec, LmWorkload  # noqa: E402
from policies.cost.compiled_prior import PUBLISHED_SHARE, CompiledStep, priced  # noqa: E402
from policies.cost.policy import CostPolicy  # noqa: E402
from policies.cost.restart_cost import RestartCost  # noqa: E402
from policies.cost.scaling_assumptions import ASSUMPTIONS, DEFAULT, ScalingAssumptions  # noqa: E402
from policies.cost.slice_options import MultiSlice, multi_slice_options  # noqa: E402
from policies.evaluation.baselines import FixedPolicy, GreedyPolicy  # noqa: E402
from policies.evaluation.hindsight import SCHEDULES_SIMULATED, hindsight_optimum, single_slice_optimum  # noqa: E402
from policies.evaluation.simulator import SimJob, simulate  # noqa: E402
from policies.evaluation.traces import bundled_traces, tune_and_check  # noqa: E402

TOTAL_TOKENS = 20e9
PARAMS = 1.0e9  # the model's parameters (`orchestrator.domain.options.DEFAULT_FLOPS_PER_TOKEN`'s model)
BATCH_TOKENS = 512 * 2048  # the global batch, split evenly over the slices of a multi-slice option
MAX_SLICES = 4  # v4-16 x1..4, v4-32 x1..2, v4-64 x1: at most 32 chips
DEADLINE_OVER_ONDEMAND = 1.75
POLICIES = ("product", "policy", "ondemand", "spot_restart", "greedy", "optimum", "optimum_single", "policy_notice",
            "policy_own", "policy_own_release_first", "product_one_slice")
OPTIMA = ("optimum", "optimum_single")
SINGLE_SLICE_POLICIES = ("product_one_slice", "ondemand", "spot_restart", "greedy")  # bounded by optimum_single
SWEEP = (1.25, 2.5, 3.5)  # other deadlines, as multiples of the on-demand v4-32 duration
RESULT_PATH = Path(__file__).parent / "results" / "cost.json"
PESSIMISTIC_RESULT_PATH = Path(__file__).parent / "results" / "cost_pessimistic.json"

# --priors: the job the TPU compiler compiled (benchmarks/tpu_compile.py), priced both ways.
PRIORS_JOB_FILE = Path(__file__).resolve().parents[1] / "examples" / "plan-1b.yaml"
COMPILED_PATH = Path(__file__).parent / "results" / "tpu_compile.json"
PRIORS_RESULT_PATH = Path(__file__).parent / "results" / "cost_priors.json"
PRIORS = ("a-priori", "compiled")
PRIORS_POLICIES = ("product", "policy_own", "ondemand", "optimum", "optimum_single")
A_PRIORI = "a-priori: policies.cost.slice_options.ScalingModel (MFU 0.50 on one host, x0.94 a host doubling)"
COMPILED = (f"compiled: {PUBLISHED_SHARE} (MaxText's published MFU) x the TPU compiler's roofline "
            "(benchmarks/results/tpu_compile.json), policies.cost.compiled_prior; the scaling model where none")


def benchmark_job(deadline_over_ondemand: float = DEADLINE_OVER_ONDEMAND, max_slices: int = MAX_SLICES,
                  scaling: ScalingAssumptions = DEFAULT) -> SimJob:
    """The headline job, its options priced under `scaling` (`policies.cost.scaling_assumptions`). The
    deadline is always 1.75x the on-demand v4-32 duration under the default assumptions, so both
    assumptions give the job the same hours."""
    singles = job_options(["v4-16", "v4-32", "v4-64"], ["spot", "on-demand"])
    multi = MultiSlice(PARAMS, BATCH_TOKENS, bytes_per_s_per_host=scaling.dcn_bytes_per_s_per_host,
                       hidden_share=scaling.hidden_share)
    options = multi_slice_options([o.repriced(scaling, DEFAULT) for o in singles], multi, max_slices)
    default_od = next(o for o in singles if o.name == "v4-32" and o.tier == "on-demand")
    return SimJob(TOTAL_TOKENS, deadline_over_ondemand * TOTAL_TOKENS / default_od.tokens_per_s, options)


def compiled_steps(path: Path = COMPILED_PATH, model: str = "1b") -> dict[str, CompiledStep]:
    """The compiler's roofline of `model`'s step on each option it compiled, by `Option.what`."""
    rows = json.loads(path.read_text())["rows"]
    return {(r["accelerator"] if r["slices"] == 1 else f"{r['slices']}x{r['accelerator']}"):
            CompiledStep(r["tokens_per_step"], r["step"]["seconds"]) for r in rows if r["model"] == model}


def priors_job(priors: str, compiled_path: Path = COMPILED_PATH) -> tuple[SimJob, dict[str, str]]:
    """The job of examples/plan-1b.yaml (the one benchmarks/tpu_compile.py compiled: 1.34B parameters,
    256 x 2048 tokens a step, 20B tokens, deadline 36 h) on up to 4 slices, as the controller builds its
    options (`counted_options`: a count the batch splits over and each slice's share has a mesh for),
    priced a priori (the scaling model) or with compiled priors; and the prior each option got."""
    spec = JobSpec.from_yaml(PRIORS_JOB_FILE)
    w, auto = spec.workload, spec.autoscaling
    assert isinstance(w, LmWorkload) and auto is not None and spec.deadline is not None and w.steps
    spec = spec.model_copy(update={"autoscaling": auto.model_copy(update={"max_slices": MAX_SLICES})})
    tokens_per_step = w.global_batch_size * w.seq_len
    singles = job_options(auto.accelerators, [t.value for t in auto.tiers],
                          flops_per_token=w.model.shape().flops_per_token(w.seq_len))
    options = counted_options(spec, singles, tokens_per_step)
    used = {o.what: "scaling model" for o in options}
    if priors == "compiled":
        found = priced(options, compiled_steps(compiled_path))
        options, used = found.options, found.priors
    return SimJob(float(w.steps * tokens_per_step), spec.deadline.total_seconds(), options), used


def run_window(args: tuple) -> dict[str, dict]:
    """The policies named (and both optima) on one trace window; returns {policy: {usd, hours, deadline_met, ...}}.
    `args`: (trace, start, deadline over on-demand, policies, priors or None, scaling assumptions' name):
    with priors, `priors_job`'s job. `best_known` (and `best_known_single`): the cheapest run that met the
    deadline on the window, of every policy and the optimum's schedule (the single-slice ones)."""
    trace_name, start_s, deadline_over_ondemand, names, priors, scaling, schedules = args
    trace = next(t for t in bundled_traces() if t.name == trace_name)
    job = priors_job(priors)[0] if priors else benchmark_job(deadline_over_ondemand, scaling=ASSUMPTIONS[scaling])
    od32 = next(o for o in job.options if o.label == "v4-32 on-demand")
    spot32 = next(o for o in job.options if o.label == "v4-32 spot")
    policies = {
        "policy": (CostPolicy(), RestartCost()),
        "ondemand": (FixedPolicy(od32, "ondemand"), RestartCost()),
        "spot_restart": (FixedPolicy(spot32, "spot_restart"), RestartCost()),
        "greedy": (GreedyPolicy(spot32, od32), RestartCost()),
        "policy_notice": (CostPolicy(name="policy_notice"), RestartCost(saves_on_notice=True)),
        "product": (CostPolicy(name="product"), RestartCost()),
        "policy_own": (CostPolicy(name="policy_own"), RestartCost()),
        "policy_own_release_first": (CostPolicy(name="policy_own_release_first"), RestartCost()),
        "product_one_slice": (CostPolicy(name="product_one_slice"), RestartCost()),
    }
    knowledge = {"product": {"knowledge": "pooled"}, "product_one_slice": {"knowledge": "pooled"},
                 "policy_own": {"knowledge": "own"},
                 "policy_own_release_first": {"knowledge": "own", "release_first": True}}
    out = {}
    for name, (policy, restart) in policies.items():
        if name not in names:
            continue
        one_slice = replace(job, options=tuple(o for o in job.options if o.count == 1))
        run = simulate(policy, one_slice if name == "product_one_slice" else job, trace, start_s=start_s,
                       restart=restart, **knowledge.get(name, {}))
        hours_by_count: dict[str, float] = {}
        for o in job.options:
            if o.label in run.billed_s:
                key = f"x{o.count}"
                hours_by_count[key] = hours_by_count.get(key, 0.0) + run.billed_s[o.label] / 3600
        out[name] = {"usd": run.cost_usd, "hours": run.hours, "deadline_met": run.deadline_met,
                     "preemptions": run.preemptions, "lost": run.tokens_lost / run.total_tokens,
                     "refusals": run.refusals, "shrinks": run.shrinks, "hours_by_count": hours_by_count,
                     "hours_by_option": {k: v / 3600 for k, v in run.billed_s.items()}}
    for name, optimum in (("optimum", hindsight_optimum), ("optimum_single", single_slice_optimum)):
        best = optimum(job, trace, start_s=start_s, schedules=schedules)
        out[name] = {"usd": best.lower_bound_usd, "schedule_usd": best.schedule_cost_usd,
                     "hours": best.schedule_finish_s / 3600, "deadline_met": best.feasible}
    for key, optimum, ran in (("best_known", "optimum", [p for p in out if p not in OPTIMA]),
                              ("best_known_single", "optimum_single", [p for p in SINGLE_SLICE_POLICIES if p in out])):
        usd = [out[p]["usd"] for p in ran if out[p]["deadline_met"]] + [out[optimum]["schedule_usd"]]
        out[key] = min(u for u in usd if u == u)  # (nan: the schedule missed; on-demand always meets it here)
    return out


def summarise(trace_runs: dict[str, list[dict]]) -> dict:
    per_btok = 1e9 / TOTAL_TOKENS
    traces = {}
    for name, windows in trace_runs.items():
        row = {}
        for policy in (p for p in POLICIES if p in windows[0]):
            runs = [w[policy] for w in windows]
            hours = [r["hours"] for r in runs if r["hours"] is not None]
            row[policy] = {
                "cost_per_btok": round(sum(r["usd"] for r in runs) / len(runs) * per_btok, 3),
                "hours": round(sum(hours) / len(hours), 2) if hours else None,
                "deadline_met": all(r["deadline_met"] for r in runs),
                "windows_missed": sum(not r["deadline_met"] for r in runs),
            }
            if policy not in OPTIMA:  # tokens trained twice after preemptions, as a share of the job
                row[policy]["lost_work_share"] = round(sum(r["lost"] for r in runs) / len(runs), 4)
                row[policy]["unfilled_requests"] = round(sum(r["refusals"] for r in runs) / len(runs), 1)
                row[policy]["shrinks"] = round(sum(r["shrinks"] for r in runs) / len(runs), 1)
                counts = sorted({c for r in runs for c in r["hours_by_count"]})
                row[policy]["hours_by_slice_count"] = {
                    c: round(sum(r["hours_by_count"].get(c, 0.0) for r in runs) / len(runs), 2) for c in counts}
        for optimum, best in (("optimum", "best_known"), ("optimum_single", "best_known_single")):
            schedules = [w[optimum]["schedule_usd"] for w in windows
                         if w[optimum]["schedule_usd"] == w[optimum]["schedule_usd"]]  # (nan: none met the deadline)
            row[optimum]["schedule_cost_per_btok"] = (round(sum(schedules) / len(schedules) * per_btok, 3)
                                                      if len(schedules) == len(windows) else None)
            known = sum(w[best] for w in windows) / len(windows) * per_btok
            row[optimum]["best_known_cost_per_btok"] = round(known, 3)
            row[optimum]["best_known_over_bound"] = round(known / row[optimum]["cost_per_btok"], 4)
        traces[name] = row
    def mean(values):
        values = list(values)
        return round(sum(values) / len(values), 4)

    def over_optimum(p):
        return mean(t[p]["cost_per_btok"] / t["optimum"]["cost_per_btok"] for t in traces.values())

    def saving(p):
        return mean(1 - t[p]["cost_per_btok"] / t["ondemand"]["cost_per_btok"] for t in traces.values())

    def over_single(p):
        return mean(t[p]["cost_per_btok"] / t["optimum_single"]["cost_per_btok"] for t in traces.values())

    def ratios(p, optimum="optimum"):
        return {name: t[p]["cost_per_btok"] / t[optimum]["cost_per_btok"] for name, t in traces.items()}

    def missed(p):
        return sum(t[p]["windows_missed"] for t in traces.values())

    def unfilled(p):
        return mean(t[p]["unfilled_requests"] for t in traces.values())

    first = next(iter(traces.values()))
    over_known = {name: t["product"]["cost_per_btok"] / t["optimum"]["best_known_cost_per_btok"]
                  for name, t in traces.items()}
    worst = max(ratios("product").items(), key=lambda kv: kv[1])
    worst_single = max(ratios("product", "optimum_single").items(), key=lambda kv: kv[1])
    summary = {
        # the headline: the product's own mode (own knowledge, pooled memory, make-before-break)
        "product": {"policy_over_single_slice_optimum": over_single("product"),
                    "policy_over_optimum": over_optimum("product"), "saving_vs_ondemand": saving("product"),
                    "deadlines_missed": missed("product"), "unfilled_requests_per_job": unfilled("product"),
                    "shrinks_per_job": mean(t["product"]["shrinks"] for t in traces.values()),
                    "worst_trace_over_single_slice_optimum": round(worst_single[1], 4),
                    "worst_trace_single": worst_single[0],
                    "worst_trace_ratio": round(worst[1], 4), "worst_trace": worst[0],
                    # the policy's own share of the gap: against the cheapest run known to meet the deadline
                    "policy_over_best_known": mean(over_known.values()),
                    "worst_trace_over_best_known": round(max(over_known.values()), 4)},
        "single_slice_optimum_over_optimum": over_optimum("optimum_single"),
        "best_known_over_bound": {
            o: {"mean": mean(t[o]["best_known_over_bound"] for t in traces.values()),
                "worst": max(t[o]["best_known_over_bound"] for t in traces.values())} for o in OPTIMA},
        "optimum_saving_vs_ondemand": saving("optimum"),
        "single_slice_optimum_saving_vs_ondemand": saving("optimum_single"),
    }
    if "policy" in first:  # the same policy fed the zone's capacity at every step: the upper bound
        summary |= {"policy_over_optimum": over_optimum("policy"),
                    "policy_over_optimum_worst": round(max(ratios("policy").values()), 4),
                    "saving_vs_ondemand": saving("policy"), "deadlines_missed": missed("policy")}
    summary |= {
        "others": {p: {"over_optimum": over_optimum(p), "over_single_slice_optimum": over_single(p),
                       "saving_vs_ondemand": saving(p), "deadlines_missed": missed(p)}
                   | ({} if p in OPTIMA else {"unfilled_requests_per_job": unfilled(p)})
                   for p in POLICIES if p in first and p not in ("policy", "product", *OPTIMA)},
    }
    return {"traces": traces, "summary": summary}


def traces_of(which: str) -> list:
    """The bundled traces: all, or the tune or the check set (`policies.evaluation.traces.tune_and_check`)."""
    if which == "all":
        return bundled_traces()
    return dict(zip(("tune", "check"), tune_and_check(bundled_traces())))[which]


def run_all(pool: ProcessPoolExecutor, deadline_over_ondemand: float, windows: int,
            names: tuple[str, ...] = POLICIES, scaling: str = DEFAULT.name,
            which: str = "all", schedules: int = SCHEDULES_SIMULATED) -> dict[str, list[dict]]:
    """The policies named on every window of every trace (of `which` set): {trace: [one result per window]}."""
    tasks = [(t.name, i * t.duration_s / windows, deadline_over_ondemand, names, None, scaling, schedules)
             for t in traces_of(which) for i in range(windows)]
    trace_runs: dict[str, list[dict]] = {}
    for (name, *_), result in zip(tasks, pool.map(run_window, tasks)):
        trace_runs.setdefault(name, []).append(result)
    return trace_runs


def run_priors(pool: ProcessPoolExecutor, windows: int) -> dict:
    """`priors_job` priced a priori and with compiled priors, each on every window of every trace: the
    policy's choices side by side. Each is its own world: the simulator trains at the speeds the policy
    is given, so the costs compare within a row (the product against the optima), not across rows."""
    report: dict = {"notes": {
        "worlds": "each prior is also the simulated speed (the simulator has no other): compare the product "
                  "with the optima and the choices within a prior, not the dollars across priors",
        "compiled": "roofline = the compiler's FLOPs at peak or HBM bytes at bandwidth, a lower bound with no "
                    "collectives; the share 0.55 is MaxText's published typical MFU, not a measurement of this "
                    "job; several slices keep the DCN efficiency of the a-priori options",
    }, "priors": {}}
    for priors in PRIORS:
        job, used = priors_job(priors)
        tasks = [(t.name, i * t.duration_s / windows, 0.0, PRIORS_POLICIES, priors, DEFAULT.name,
                  SCHEDULES_SIMULATED)
                 for t in bundled_traces() for i in range(windows)]
        trace_runs: dict[str, list[dict]] = {}
        for (name, *_), result in zip(tasks, pool.map(run_window, tasks)):
            trace_runs.setdefault(name, []).append(result)
        summary = summarise(trace_runs)
        runs = [w["product"] for ws in trace_runs.values() for w in ws]
        by_option: dict[str, float] = {}
        for r in runs:
            for label, hours in r["hours_by_option"].items():
                by_option[label] = by_option.get(label, 0.0) + hours / len(runs)
        report["priors"][priors] = {
            "priors_used": A_PRIORI if priors == "a-priori" else COMPILED,
            "deadline_hours": round(job.deadline_s / 3600, 2), "total_tokens": job.total_tokens,
            "options": {o.label: {"tokens_per_s": round(o.tokens_per_s), "usd_per_hour": round(o.usd_per_hour, 2),
                                  "prior": used[o.what]} for o in job.options},
            "product_hours_by_option": {k: round(v, 2) for k, v in sorted(by_option.items(), key=lambda kv: -kv[1])},
            "summary": summary["summary"], "traces": summary["traces"],
        }
    return report


def main_priors(windows: int, jobs: int, out: Path) -> None:
    began = time.time()
    with ProcessPoolExecutor(jobs) as pool:
        report = run_priors(pool, windows)
    report["windows_per_trace"] = windows
    report["seconds"] = round(time.time() - began, 1)
    report["command"] = f"python benchmarks/cost.py --priors --windows {windows}"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    rows = report["priors"]
    print(f"{'trace':58s} " + " ".join(f"{p + ' product':>18s} {'optimum':>8s}" for p in PRIORS))
    for name in rows[PRIORS[0]]["traces"]:
        cells = " ".join(f"{rows[p]['traces'][name]['product']['cost_per_btok']:18.2f} "
                         f"{rows[p]['traces'][name]['optimum']['cost_per_btok']:8.2f}" for p in PRIORS)
        print(f"{name:58s} {cells}")
    for p in PRIORS:
        print(p, rows[p]["priors_used"])
        print("  options:", {k: v["tokens_per_s"] for k, v in rows[p]["options"].items() if "spot" in k})
        print("  product hours by option:", rows[p]["product_hours_by_option"])
        print("  summary:", json.dumps(rows[p]["summary"]["product"]))
    print(f"{report['seconds']} s; wrote {out}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--windows", type=int, default=4, help="start times per trace")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes")
    parser.add_argument("--deadline", type=float, default=DEADLINE_OVER_ONDEMAND,
                        help="deadline as a multiple of the on-demand v4-32 duration")
    parser.add_argument("--sweep", type=lambda v: [float(x) for x in v.split(",") if x], default=list(SWEEP),
                        help="other deadlines to summarise, comma-separated ('' for none)")
    parser.add_argument("--policies", type=lambda v: tuple(x for x in v.split(",") if x), default=POLICIES,
                        help="policies to run, comma-separated (product and ondemand always; both optima always)")
    parser.add_argument("--out", type=Path, default=None, help=f"default {RESULT_PATH} ({PRIORS_RESULT_PATH} "
                        "with --priors)")
    parser.add_argument("--scaling", choices=sorted(ASSUMPTIONS), default=DEFAULT.name,
                        help="scaling assumptions the options are priced with (policies.cost.scaling_assumptions); "
                             f"pessimistic writes {PESSIMISTIC_RESULT_PATH.name} by default")
    parser.add_argument("--traces", choices=("all", "tune", "check"), default="all",
                        help="the bundled traces, or only the set to tune on or the set to check on")
    parser.add_argument("--schedules", type=int, default=SCHEDULES_SIMULATED,
                        help="clairvoyant schedules each optimum prices in the simulator (0: the bounds alone; "
                             "the best known run is then the policies' best)")
    parser.add_argument("--priors", action="store_true",
                        help="instead: the compiled job (examples/plan-1b.yaml) priced a priori and with compiled "
                             f"priors, side by side ({', '.join(PRIORS_POLICIES)})")
    args = parser.parse_args(argv)
    if args.priors:
        main_priors(args.windows, args.jobs, args.out or PRIORS_RESULT_PATH)
        return
    args.out = args.out or (RESULT_PATH if args.scaling == DEFAULT.name else PESSIMISTIC_RESULT_PATH)
    scaling = ASSUMPTIONS[args.scaling]
    names = tuple(dict.fromkeys(("product", "ondemand", *args.policies)))
    unknown = set(names) - set(POLICIES)
    if unknown:
        parser.error(f"unknown policies {sorted(unknown)}; choose from {', '.join(POLICIES)}")

    job = benchmark_job(args.deadline, scaling=scaling)
    tune, check = ([t.name for t in ts] for ts in tune_and_check(bundled_traces()))
    began = time.time()
    with ProcessPoolExecutor(args.jobs) as pool:
        runs = run_all(pool, args.deadline, args.windows, names, scaling.name, args.traces, args.schedules)
        report = summarise(runs)
        report["sets"] = {name: {"traces": members, **summarise({n: runs[n] for n in members})["summary"]}
                          for name, members in (("tune", tune), ("check", check)) if members[0] in runs}
        sweep = [d for d in args.sweep if d != args.deadline]
        report["by_deadline"] = {str(args.deadline): report["summary"]}
        for d in sweep:
            print(f"deadline {d}x ...", flush=True)
            report["by_deadline"][str(d)] = summarise(run_all(pool, d, args.windows, names, scaling.name,
                                                              args.traces, args.schedules))["summary"]
    report["job"] = {
        "model": "dense decoder ~1B params (24 layers, d_model 2048, seq 2048)",
        "priors": A_PRIORI,
        "scaling": scaling.describe(),
        "restart": {k: v for k, v in vars(RestartCost()).items()},
        "global_batch_tokens": BATCH_TOKENS,
        "max_slices": MAX_SLICES,
        "total_tokens": TOTAL_TOKENS,
        "deadline_hours": round(job.deadline_s / 3600, 2),
        "deadline_over_ondemand_v4_32": args.deadline,
        "options": {o.label: {"tokens_per_s": round(o.tokens_per_s), "usd_per_hour": round(o.usd_per_hour, 2),
                              "dcn_efficiency": round(MultiSlice(
                                  PARAMS, BATCH_TOKENS, bytes_per_s_per_host=scaling.dcn_bytes_per_s_per_host,
                                  hidden_share=scaling.hidden_share).efficiency(
                                  o.with_count(1, job.options) or o, o.count), 4)}
                    for o in job.options},
        "windows_per_trace": args.windows,
    }
    report["command"] = "python benchmarks/cost.py " + " ".join(argv if argv is not None else sys.argv[1:])
    report["seconds"] = round(time.time() - began, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")

    shown = [p for p in ("product", "policy", "optimum", "optimum_single", "ondemand", "spot_restart", "greedy")
             if p in names or p in OPTIMA]
    print(f"{'trace':58s} " + " ".join(f"{p[:8]:>8s}" for p in shown) + f" {'unfilled':>8s}  met")
    for name, row in report["traces"].items():
        cells = " ".join(f"{row[p]['cost_per_btok']:8.2f}" for p in shown)
        print(f"{name:58s} {cells} {row['product']['unfilled_requests']:8.1f}  "
              f"{'yes' if row['product']['deadline_met'] else 'NO'}")
    print(json.dumps(report["summary"], indent=2))
    for name, summary in report["sets"].items():
        print(name, json.dumps(summary["product"]))
    print(f"{report['seconds']} s; wrote {args.out}")


if __name__ == "__main__":
    main()
