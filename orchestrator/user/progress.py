"""What `submit` (waiting) and `logs --follow` show while a job runs.

A live bar (step of total, loss, tokens/s, ETA, dollars so far) with each disruption,
restore, resize and state change printed above it as it happens; plain lines when the
output is not a terminal; JSON Lines (`--json`) for scripts: one object per update,
and one per event.
"""

from __future__ import annotations

import json
import time
from typing import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from orchestrator.user.client import Job, JobStatus
from workers.protocol import LOOP_METRICS
from orchestrator.observe.goodput import goodput
from orchestrator.state.events import EventKind
from orchestrator.state.store import Event

# Events worth a line of their own while watching (the rest are in `status --events`).
SHOWN = {EventKind.DISRUPTION, EventKind.RESTORE, EventKind.RESIZE, EventKind.RESUMED, EventKind.LOST_WORK,
         EventKind.ADOPTED, EventKind.NOTICE}


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def eta_s(job: Job, st: JobStatus) -> float | None:
    """Seconds left at the recent pace (the last 10 steps)."""
    if not st.total_steps or st.done:
        return None
    recent = [m.step_time_s for m in job.metrics()[-10:] if m.step_time_s]
    if not recent:
        return None
    return (st.total_steps - st.step) * sum(recent) / len(recent)


def _event_line(e: Event) -> str:
    if e.kind is EventKind.STATE:
        return f"{e.to_state}: {e.reason}"
    return f"{e.kind.value}: {e.reason}"


def _updates(job: Job, poll_s: float) -> Iterator[tuple[JobStatus, list[Event], float, float | None]]:
    seq = 0
    while True:
        st = job.status()
        events = job.events()
        new = [e for e in events if e.seq > seq]
        seq = events[-1].seq if events else seq
        usd = goodput(job._client.store, job.id).usd_total
        yield st, new, usd, eta_s(job, st)
        if st.done:
            return
        time.sleep(poll_s)


def utilisation(metrics: dict) -> str:
    """"  MFU 41.2% (113.3 TFLOP/s/chip)  HBM 12.1 GiB (peak 14.0 of 31.7)" from what the step reported; "" if none."""
    out = ""
    if "mfu" in metrics:
        out += f"  MFU {100 * metrics['mfu']:.1f}%"
    if "tflops_per_chip" in metrics:
        out += f" ({metrics['tflops_per_chip']:.3g} TFLOP/s/chip)"
    if "hbm_in_use_gib" in metrics:
        out += f"  HBM {metrics['hbm_in_use_gib']:.1f} GiB"
        extra = [f"peak {metrics['hbm_peak_gib']:.1f}" if "hbm_peak_gib" in metrics else "",
                 f"of {metrics['hbm_limit_gib']:.1f}" if "hbm_limit_gib" in metrics else ""]
        if any(extra):
            out += f" ({' '.join(e for e in extra if e)})"
    return out


def user_metrics(metrics: dict) -> str:
    """The program's own metrics, "accuracy 0.512, grad_norm 1.03"."""
    return ", ".join(f"{k} {v:.4g}" for k, v in sorted(metrics.items()) if k not in LOOP_METRICS)


def watch(job: Job, console: Console, *, mode: str = "auto", poll_s: float = 1.0,
          on_poll: Callable[[Progress | None], None] | None = None) -> JobStatus:
    """Show the job until it ends; `mode` is "auto" (bar on a terminal, lines otherwise), "json" or "quiet"."""
    if mode == "quiet":
        return job.wait(poll_s=poll_s)
    if mode == "json":
        for st, new, usd, eta in _updates(job, poll_s):
            for e in new:
                print(json.dumps({"event": e.kind.value, "at": e.at, "state": e.to_state, "reason": e.reason,
                                  "data": e.data}), flush=True)
            print(json.dumps({"job": st.id, "state": st.state.value, "step": st.step, "total_steps": st.total_steps,
                              "loss": st.loss, "tokens_per_s": st.tokens_per_s, "metrics": st.metrics, "eta_s": eta,
                              "usd": round(usd, 4),
                              "preemptions": st.preemptions}), flush=True)
            if on_poll:
                on_poll(None)
        return st
    if not console.is_terminal:
        every, printed = None, 0
        for st, new, usd, eta in _updates(job, poll_s):
            for e in new:
                if e.kind in SHOWN or e.kind is EventKind.STATE:
                    console.print(_event_line(e), highlight=False)
            every = every or max(1, (st.total_steps or 10) // 10)
            if st.step > printed and (st.step // every > printed // every or st.done):
                printed = st.step
                console.print(f"step {st.step}/{st.total_steps or '?'}  loss {_fmt(st.loss, '.4f')}  "
                              f"tokens/s {_fmt(st.tokens_per_s, ',.0f')}{utilisation(st.metrics)}  ${usd:,.2f}",
                              highlight=False)
            if on_poll:
                on_poll(None)
        return st
    with Progress(TextColumn("{task.fields[state]:<12}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("loss {task.fields[loss]}  tok/s {task.fields[tps]}  ETA {task.fields[eta]}  "
                             "${task.fields[usd]}"), TimeElapsedColumn(), console=console) as progress:
        task = progress.add_task("job", total=None, state="PENDING", loss="-", tps="-", eta="-", usd="0.00")
        for st, new, usd, eta in _updates(job, poll_s):
            for e in new:
                if e.kind in SHOWN or (e.kind is EventKind.STATE and e.to_state in ("RECOVERING", "RESIZING",
                                                                                    "FAILED")):
                    progress.console.print(f"[dim]{time.strftime('%H:%M:%S', time.localtime(e.at))}[/dim] "
                                           f"{_event_line(e)}", highlight=False)
            progress.update(task, completed=st.step, total=st.total_steps, state=st.state.value,
                            loss=_fmt(st.loss, ".4f"), tps=_fmt(st.tokens_per_s, ",.0f"),
                            eta="-" if eta is None else time.strftime("%H:%M:%S", time.gmtime(eta)),
                            usd=f"{usd:,.2f}")
            if on_poll:
                on_poll(progress)
        return st
