"""Plan a job before running it: what each slice type x tier would cost, and what the policy would do.

This is the glue between the catalog (prices, chips, hosts, peak FLOPs) and the pure
cost policy in `policies.cost.policy`. The CLI's ``orchestrator plan job.yaml [--trace FILE]``
is meant to be a few lines over it::

    from orchestrator.user.planning import plan_job, render_plan
    plan = plan_job(tpu_types=["v4-16", "v4-32", "v4-64"], tiers=["spot", "on-demand"],
                    total_tokens=20e9, deadline_hours=36, budget_usd=800, trace_path=None)
    print(plan_text(plan, width=80))   # the table, then the policy's moves

`plan_job` replays the job on a spot capacity trace (the user's, or without one a
synthetic trace drawn from the policy's own priors) from `windows` evenly spaced
start times, once per fixed option (on spot: wait whenever the slice cannot be had,
restart after each preemption) and once under the cost policy, which may move
between all the allowed options. Expected figures are means over the windows; the
risk of missing the deadline is the fraction of windows that missed it.

Throughput before the job has measured any step times comes from a scaling model
(`policies.cost.slice_options.ScalingModel`) of a ~1B-parameter dense transformer; pass
`flops_per_token` (`ModelShape.flops_per_token`) for another model, and
`measured_tokens_per_s` (by type name) once the job has run.

`plan_spec` does the same for a parsed job file (what ``orchestrator plan`` and `Client.plan` run).

`render_memory` shows the memory-fit check's per-chip estimate for each candidate slice
type (`orchestrator.domain.fit.slice_fit`): what training needs against what HBM holds.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

from orchestrator.domain.fit import SliceFit
from orchestrator.domain.options import DEFAULT_FLOPS_PER_TOKEN, job_options
from orchestrator.domain.spec import AutoscalingConfig, JobSpec, LmWorkload
from policies.cost.compiled_prior import COMPILED, PUBLISHED_SHARE, CompiledStep, priced
from policies.cost.policy import CostPolicy
from policies.cost.restart_cost import RestartCost
from policies.cost.slice_options import Option
from policies.cost.spot_estimates import PRIOR_HOST_HAZARD_PER_HOUR, PRIOR_OUTAGE_HOURS
from policies.evaluation.baselines import FixedPolicy
from policies.evaluation.simulator import DecisionRecord, Run, SimJob, simulate
from policies.evaluation.traces import SpotTrace, load_trace, markov_trace
from policies.model.memory_fit import GIB, USABLE_FRACTION

REFERENCE_HOSTS = 4  # the synthetic trace's uptime is that of a 4-host slice under the prior
# The deadlines a plan takes. Below a minute no slice even starts; the synthetic trace is 12 deadlines long,
# so a year's deadline took minutes and gigabytes to replay (90 days: about 12 s).
MIN_DEADLINE_HOURS, MAX_DEADLINE_HOURS = 1 / 60, 24 * 90


def deadline_problem(hours: float) -> str | None:
    """Why `hours` cannot be a plan's deadline (not a number, not finite, out of range), or None."""
    if not MIN_DEADLINE_HOURS <= hours <= MAX_DEADLINE_HOURS:  # NaN fails this too
        return (f"a deadline from one minute to 90 days ({MIN_DEADLINE_HOURS:.4f} to {MAX_DEADLINE_HOURS} hours), "
                f"got {hours:g} hours")
    return None


@dataclass(frozen=True)
class ExpectedOutcome:
    """Expected outcome of one way to run the job, over the trace windows."""

    label: str  # "v4-32 spot", or "cost policy"
    expected_cost_usd: float
    expected_hours: float | None  # mean over the windows that finished
    deadline_miss_risk: float  # fraction of windows that missed the deadline
    within_budget: bool | None  # None when no window finished: the cost of an unfinished job says nothing


@dataclass(frozen=True)
class JobPlan:
    total_tokens: float
    deadline_hours: float
    budget_usd: float | None
    trace: str
    windows: int
    options: tuple[ExpectedOutcome, ...]  # one per type x tier, run on that option alone
    policy: ExpectedOutcome  # the cost policy, free to move between the options
    policy_moves: tuple[DecisionRecord, ...]  # what it did in the first window, with reasons
    # How each option's speed was priced (by `Option.what`): "scaling model", or "compiled" (a share of the TPU
    # compiler's roofline, `policies.cost.compiled_prior`); empty when nothing was compiled.
    priors: dict[str, str] = field(default_factory=dict)


def plan_job(
    *,
    tpu_types: Sequence[str],
    tiers: Sequence[str],
    total_tokens: float,
    deadline_hours: float,
    budget_usd: float | None = None,
    trace_path: str | Path | None = None,
    flops_per_token: float = DEFAULT_FLOPS_PER_TOKEN,
    measured_tokens_per_s: Mapping[str, float] | None = None,
    restart: RestartCost = RestartCost(),
    windows: int = 6,
    counted: Callable[[tuple[Option, ...]], tuple[Option, ...]] | None = None,
    compiled: Mapping[str, CompiledStep] | None = None,
) -> JobPlan:
    """Expected cost, time and deadline risk of each type x tier, and of the cost policy.
    `counted`: the single-slice options with several slices of each added (`autoscaling.max_slices`:
    `orchestrator.control.autoscaler.counted_options`). `compiled`: the TPU compiler's step for some options
    (by `Option.what`), which then start from a compiled prior instead of the scaling model."""
    if (problem := deadline_problem(deadline_hours)) is not None:
        raise ValueError(f"deadline_hours: plan takes {problem}")
    options = job_options(tpu_types, tiers, flops_per_token=flops_per_token,
                          measured_tokens_per_s=measured_tokens_per_s)
    if counted is not None:
        options = counted(options)
    priors: dict[str, str] = {}
    if compiled:
        found = priced(options, compiled)
        options, priors = found.options, found.priors
    job = SimJob(total_tokens, deadline_hours * 3600, options, budget_usd)
    trace = load_trace(trace_path) if trace_path else _prior_trace(deadline_hours, windows)
    starts = [i * trace.duration_s / windows for i in range(windows)]

    def replay(label: str, policy) -> tuple[ExpectedOutcome, list[Run]]:
        runs = [simulate(policy, job, trace, start_s=s, restart=restart) for s in starts]
        cost = sum(r.cost_usd for r in runs) / len(runs)
        hours = [r.hours for r in runs if r.hours is not None]
        miss = sum(not r.deadline_met for r in runs) / len(runs)
        within = None if not hours else budget_usd is None or cost <= budget_usd
        return ExpectedOutcome(label, cost, sum(hours) / len(hours) if hours else None, miss, within), runs

    fixed = tuple(replay(o.label, FixedPolicy(o, o.label))[0] for o in options)
    policy, runs = replay("cost policy", CostPolicy())
    return JobPlan(total_tokens, deadline_hours, budget_usd, trace.name, windows, fixed, policy, runs[0].decisions,
                   priors)


def plan_spec(spec: JobSpec, *, deadline_hours: float | None = None, trace_path: str | Path | None = None,
              model_flops_per_step: float | None = None,
              compiled: Mapping[str, CompiledStep] | None = None) -> JobPlan:
    """`plan_job` for a parsed job file: its options (type, tiers, slice counts), token count, deadline (or
    `deadline_hours`) and budget. `model_flops_per_step`: the FLOPs of one step where the job's model
    does not give them (a program of the user's own: from the TPU compiler, `orchestrator.user.compiled`).
    `compiled`: the compiler's steps of the options it compiled (`compiled.compiled_steps`), their priors.

    Raises:
      ValueError: naming the job file's field that the plan lacks (a deadline, the token count, the FLOPs).
      policies.evaluation.traces.TraceError: the trace cannot be read.
    """
    from orchestrator.control.autoscaler import counted_options

    w = spec.workload
    if w.steps is None or w.seq_len is None or w.global_batch_size is None:
        raise ValueError("workload: plan needs steps, seq_len and global_batch_size (the job's token count)")
    tokens_per_step = w.global_batch_size * w.seq_len
    params = None
    if isinstance(w, LmWorkload):
        flops_per_token = w.model.shape().flops_per_token(w.seq_len)
    elif model_flops_per_step:
        flops_per_token = model_flops_per_step / tokens_per_step
        params = flops_per_token / 6  # what the slices all-reduce: a training step's 6 FLOPs a parameter a token
    else:
        raise ValueError("workload: plan needs the built-in lm workload's model size, or the FLOPs of the "
                         "program's own step (plan --compile takes them from the TPU compiler)")
    hours = deadline_hours if deadline_hours is not None else \
        (spec.deadline.total_seconds() / 3600 if spec.deadline else None)
    if hours is None:
        raise ValueError("deadline: plan needs a deadline (in the job file, or --deadline-hours)")
    if (problem := deadline_problem(hours)) is not None:
        raise ValueError(f"deadline: plan takes {problem}" + (" (--deadline-hours overrides it)"
                                                              if deadline_hours is None else ""))
    auto = spec.autoscaling or AutoscalingConfig()
    return plan_job(tpu_types=auto.accelerators, tiers=[t.value for t in auto.tiers],
                    total_tokens=float(w.steps * tokens_per_step), deadline_hours=hours, budget_usd=spec.budget_usd,
                    trace_path=trace_path, flops_per_token=flops_per_token,
                    counted=lambda singles: counted_options(spec, singles, tokens_per_step, params=params),
                    compiled=compiled)


def _prior_trace(deadline_hours: float, windows: int) -> SpotTrace:
    """Without a user trace: a two-state trace with the policy's prior uptime and outages,
    in which every size can be had while spot is up."""
    mean_up_h = 1 / (REFERENCE_HOSTS * PRIOR_HOST_HAZARD_PER_HOUR)
    return markov_trace(mean_up_h=mean_up_h, mean_down_h=PRIOR_OUTAGE_HOURS,
                        hours=max(24 * 14, 2 * windows * deadline_hours), seed=0, nodes=4)


def _usd(x: float) -> str:
    return f"${x:,.2f}" if x < 100 else f"${x:,.0f}"


def render_plan(plan: JobPlan) -> Table:
    """A rich Table: one row per option and one for the policy (`moves_lines` says what the policy did)."""
    budget = "no budget" if plan.budget_usd is None else f"budget {_usd(plan.budget_usd)}"
    compiled = sorted(w for w, p in plan.priors.items() if p == COMPILED)
    speeds = (f"speeds before measuring: {PUBLISHED_SHARE:.0%} of the TPU compiler's roofline (MaxText's published "
              f"MFU) for {', '.join(compiled)}; the scaling model for the rest" if compiled else None)
    table = Table(title=f"{plan.total_tokens / 1e9:g}B tokens, deadline {plan.deadline_hours:g} h, {budget} "
                        f"(trace {plan.trace}, {plan.windows} windows)", caption=speeds)
    table.add_column("option", no_wrap=True)
    for column in ("cost", "$/Btok", "time", "miss risk", "budget"):
        table.add_column(column, justify="right", no_wrap=True)
    for o in (*plan.options, plan.policy):
        finished = o.expected_hours is not None  # else the cost is only what was spent before giving up
        table.add_row(
            o.label,
            _usd(o.expected_cost_usd) if finished else "-",
            f"{o.expected_cost_usd / plan.total_tokens * 1e9:,.2f}" if finished else "-",
            "unfinished" if o.expected_hours is None else f"{o.expected_hours:.1f} h",
            f"{o.deadline_miss_risk:.0%}",
            "-" if o.within_budget is None else "ok" if o.within_budget else "over",
            style="bold" if o is plan.policy else None,
        )
    return table


def moves_lines(plan: JobPlan, *, width: int = 120) -> list[str]:
    """The policy's moves in the first window, each wrapped to `width` under its time."""
    from orchestrator.user.terminal import wrap

    lines = ["cost policy, first window:"]
    for m in plan.policy_moves[:12]:
        lines += wrap(f"{m.at_s / 3600:6.2f} h  {m.option}: {m.reason}", width, hanging=" " * 10)
    if len(plan.policy_moves) > 12:
        lines.append(f"  and {len(plan.policy_moves) - 12} more moves")
    return lines


def render_memory(fits: Sequence[SliceFit]) -> Table:
    """A rich Table: the per-chip memory estimate of training on each slice type (`orchestrator.domain.fit`)."""
    table = Table(title=f"HBM per chip, GiB (usable: {USABLE_FRACTION:.0%}; formulas: policies/model/memory_fit.py)")
    table.add_column("slice", no_wrap=True)
    for column in ("mesh", "micro-batches", "needs", "usable", "largest part", "fits"):
        table.add_column(column, justify="right")
    for f in fits:
        mesh = "-" if f.mesh is None else "x".join(map(str, f.mesh.shape))  # data x fsdp x model
        if f.fit is None:
            why = f.mesh_error if f.mesh is None else "gradient_accumulation does not divide the rows"
            table.add_row(f.accelerator, mesh, "-", "-", "-", "-", why, style="red")
            continue
        e = f.fit.estimate
        table.add_row(f.accelerator, mesh, str(e.microbatches), f"{e.total / GIB:,.1f}",
                      f"{f.fit.usable_bytes / GIB:.1f}", f"{e.dominant} {e.parts[e.dominant] / GIB:,.1f}",
                      "yes" if f.fit.fits else "no", style=None if f.fit.fits else "red")
    return table


def plan_text(plan: JobPlan, *, width: int = 120) -> str:
    """`render_plan` as plain text (for logs and tests)."""
    console = Console(width=width, file=io.StringIO(), record=True, color_system=None)
    console.print(render_plan(plan))
    for line in moves_lines(plan, width=width):
        console.print(line, markup=False, highlight=False)
    return console.export_text()
