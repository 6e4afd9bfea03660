"""What `status` and `list` show: a job's lines, the table of jobs, and both as JSON."""

from __future__ import annotations

import datetime as dt
import json

from rich.markup import escape

from orchestrator.user.commands import console
from orchestrator.user.job import JobStatus
from orchestrator.user.progress import user_metrics, utilisation
from orchestrator.user.terminal import fit_fields, table, unique_prefixes, wrap


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def clock_time(ts: float) -> str:
    """`ts` as the local time of day to the millisecond, as a job's events show it."""
    return dt.datetime.fromtimestamp(ts).strftime("%H:%M:%S.%f")[:-3]


def status_dict(st: JobStatus) -> dict:
    """`st` as `status --json` and `list --json` print it."""
    d = dict(vars(st))
    d["state"] = st.state.value
    d["cause"] = st.cause.value if st.cause else None  # FAILED's cause (setup, budget, ...)
    return d


def status_lines(st: JobStatus, g, *, width: int) -> list[str]:
    """`status JOB` as lines of at most `width` columns (see `orchestrator.user.terminal`)."""
    from orchestrator.observe.goodput import format_duration

    where = f", position {st.queue_position} in the queue" if st.queue_position else ""
    lines = wrap(f"{st.id}  {st.state_name}{where}  ({st.reason})", width, hanging="  ")
    for note in (st.moving, st.stalled, st.warning, st.store_fault):
        if note:
            lines += wrap(note, width, indent="  ", hanging="    ")
    wall = ("wall time " if st.done else "running for ") + format_duration(st.wall_s or 0.0)
    lines += fit_fields([f"{st.accelerator} {st.tier}", f"step {st.step}/{st.total_steps or '?'}",
                         f"loss {_fmt(st.loss, '.4f')}", f"{_fmt(st.tokens_per_s, ',.0f')} tokens/s", wall],
                        width, indent="  ", sep="   ")
    if st.plan:
        lines += wrap(f"plan: {st.plan}", width, indent="  ", hanging="    ")
    by = ", ".join(f"{a} {t} ${usd:,.2f}" for (a, t), usd in sorted(g.usd_by.items()))
    lines += fit_fields([f"goodput {g.goodput_fraction:.1%}", f"cost ${g.usd_total:,.2f}" + (f" ({by})" if by else "")],
                        width, indent="  ", sep="   ")
    lines += fit_fields([_count(g.preemptions, "preemption"), _count(g.failures, "failure"),
                         _count(g.restarts, "restart"), f"{g.productive_steps} steps kept",
                         f"{g.lost_steps} recomputed"], width, indent="  ", sep=", ")
    if utilisation(st.metrics):
        lines += fit_fields(utilisation(st.metrics).split("  "), width, indent="  ")
    if user_metrics(st.metrics):
        lines += wrap(f"metrics: {user_metrics(st.metrics)}", width, indent="  ", hanging="    ")
    return lines


def _count(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


def print_jobs(jobs: list[JobStatus], as_json: bool, fault: str | None = None) -> None:
    """`list`: the table of `jobs` (or their JSON), then what stalls them and the store's fault, if any."""
    out = console.out
    if as_json:
        print(json.dumps([status_dict(s) for s in jobs], indent=2))
        return
    for line in jobs_lines(jobs, width=out.width):
        out.print(line, markup=False, highlight=False)
    stalled = [s for s in jobs if s.stalled]
    if stalled:
        for line in wrap(f"{len(stalled)} job(s) not ended, but {stalled[0].stalled}", out.width):
            out.print(f"[yellow]{escape(line)}[/yellow]", highlight=False)
    if fault:
        for line in wrap(fault, out.width):
            out.print(f"[yellow]{escape(line)}[/yellow]", highlight=False)


def jobs_lines(jobs: list[JobStatus], *, width: int) -> list[str]:
    """`list` as a table of at most `width` columns: full ids where they fit, else each id's shortest
    unique prefix (every command takes it as JOB); the created and loss columns go first when narrow."""
    from orchestrator.observe.goodput import format_duration

    if not jobs:
        return ["no jobs yet"]

    def rows(ids: dict[str, str]) -> list[list[str]]:
        return [[ids[s.id], s.state_name + (f" #{s.queue_position}" if s.queue_position else ""),
                 f"{s.accelerator} {s.tier}", f"{s.step}/{s.total_steps or '?'}", _fmt(s.loss, ".4f"),
                 format_duration(s.wall_s or 0.0),
                 dt.datetime.fromtimestamp(s.created_at).strftime("%m-%d %H:%M")] for s in jobs]

    headers = ["id", "state", "slice", "step", "loss", "wall time", "created"]
    full = table(headers, rows({s.id: s.id for s in jobs}), width, right=(3, 4, 5), drop_order=())
    if max(map(len, full)) <= width:
        return full
    return table(headers, rows(unique_prefixes([s.id for s in jobs])), width, right=(3, 4, 5), drop_order=(6, 4))
