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
from rich.progress import BarColumn, Progress, TextColumn

from orchestrator.observe.goodput import goodput
from orchestrator.state.events import EventKind
from orchestrator.state.states import JobState
from orchestrator.state.store import Event
from orchestrator.user.client import Job, JobStatus
from orchestrator.user.terminal import wrap
from workers.protocol import LOOP_METRICS

# Events worth a line of their own while watching (the rest are in `status --events`).
SHOWN = {EventKind.DISRUPTION, EventKind.RESTORE, EventKind.RESIZE, EventKind.RESUMED, EventKind.LOST_WORK,
         EventKind.ADOPTED, EventKind.NOTICE, EventKind.FOLDER, EventKind.STORE}


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
        return f"{e.to_state.value if e.to_state else ''}: {e.reason}"
    return f"{e.kind.value}: {e.reason}"


def _updates(job: Job, poll_s: float) -> Iterator[tuple[JobStatus, list[Event], float, float | None]]:
    """The job's status, its new events (a store fault's beginning and end among them), dollars, ETA."""
    seq, fault = 0, None
    while True:
        st = job.status()
        events = job.events()
        new = [e for e in events if e.seq > seq]
        seq = events[-1].seq if events else seq
        if st.store_fault and not fault:  # its end is an event (`StoreFaulted`), written when the store works
            new.append(_store_line(st.store_fault))
        fault = st.store_fault
        usd = goodput(job._client.store, job.id).usd_total
        yield st, new, usd, eta_s(job, st)
        if st.done:
            return
        time.sleep(poll_s)


def _store_line(text: str) -> Event:
    """A store fault's line among the events shown (no event says it yet: the store could not take one)."""
    return Event(0, "", time.time(), EventKind.STORE, None, None, text, None)


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
        return _watch_json(job, poll_s, on_poll)
    if not console.is_terminal:
        return _watch_lines(job, console, poll_s, on_poll)
    return _watch_bar(job, console, poll_s, on_poll)


def _watch_json(job: Job, poll_s: float, on_poll: Callable[[Progress | None], None] | None) -> JobStatus:
    """One JSON object a line: each new event, then the job's figures at each poll."""
    for st, new, usd, eta in _updates(job, poll_s):
        for e in new:
            state = e.to_state.value if e.to_state else None
            print(json.dumps({"event": e.kind.value, "at": e.at, "state": state, "reason": e.reason,
                              "data": e.data}), flush=True)
        print(json.dumps({"job": st.id, "state": st.state.value, "step": st.step, "total_steps": st.total_steps,
                          "loss": st.loss, "tokens_per_s": st.tokens_per_s, "metrics": st.metrics, "eta_s": eta,
                          "usd": round(usd, 4),
                          "preemptions": st.preemptions}), flush=True)
        if on_poll:
            on_poll(None)
    return st


def _watch_lines(job: Job, console: Console, poll_s: float,
                 on_poll: Callable[[Progress | None], None] | None) -> JobStatus:
    """Plain lines for a console that is not a terminal: the events shown, and a step line each tenth of the run."""
    every, printed = None, 0
    for st, new, usd, _eta in _updates(job, poll_s):
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


def _watch_bar(job: Job, console: Console, poll_s: float,
               on_poll: Callable[[Progress | None], None] | None) -> JobStatus:
    """The live bar on a terminal, with the events that change the run's course printed above it."""
    with LiveBar(console) as bar:
        for st, new, usd, eta in _updates(job, poll_s):
            for e in new:
                if e.kind in SHOWN or (e.kind is EventKind.STATE and e.to_state in (
                        JobState.RECOVERING, JobState.RESIZING, JobState.FAILED)):
                    bar.event(e)
            bar.update(st, usd, eta)
            if on_poll:
                on_poll(bar.progress)
        return st


class LiveBar:
    """The live progress line, laid out for the console's width (see `bar_fields`); events print above it."""

    MIN_BAR = 10

    def __init__(self, console: Console):
        self.console = console
        self.progress = Progress(TextColumn("{task.fields[state]}"), BarColumn(bar_width=None),
                                 TextColumn("{task.fields[count]}"), TextColumn("{task.fields[stats]}"),
                                 console=console, expand=True)
        self._task = self.progress.add_task("job", total=None, state="PENDING".ljust(10), count="0/?", stats="")
        self._started = time.monotonic()

    def __enter__(self) -> "LiveBar":
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def event(self, e: Event) -> None:
        stamp = time.strftime("%H:%M:%S", time.localtime(e.at))
        for line in wrap(f"{stamp} {_event_line(e)}", self.console.width, hanging=" " * 9):
            self.progress.console.print(line, markup=False, highlight=False)

    def update(self, st: JobStatus, usd: float, eta: float | None) -> None:
        state, count, stats = bar_fields(st, usd, eta, time.monotonic() - self._started,
                                         width=self.console.width, min_bar=self.MIN_BAR)
        self.progress.update(self._task, completed=st.step, total=st.total_steps, state=state, count=count,
                             stats=stats)


def bar_fields(st: JobStatus, usd: float, eta: float | None, elapsed_s: float, *, width: int,
               min_bar: int = LiveBar.MIN_BAR) -> tuple[str, str, str]:
    """(state, step count, figures) of the progress line, leaving the bar at least `min_bar` columns.

    The step count is never shortened; the figures drop what does not fit, least needed first:
    the elapsed time, the loss's fourth decimal, tokens/s, the ETA, the dollars.
    """
    state = st.state.value.ljust(10)
    count = f"{st.step}/{st.total_steps or '?'}"
    loss4, loss3 = _fmt(st.loss, ".4f"), _fmt(st.loss, ".3f")
    tps = "-" if st.tokens_per_s is None else _short(st.tokens_per_s)
    left = "-" if eta is None else _clock(eta)
    spent = f"${usd:,.2f}"
    choices = [f"loss {loss4}  {tps} tok/s  ETA {left}  {spent}  {_clock(elapsed_s)}",
               f"loss {loss4}  {tps} tok/s  ETA {left}  {spent}",
               f"loss {loss3}  {tps} tok/s  ETA {left}  {spent}",
               f"loss {loss3}  ETA {left}  {spent}",
               f"loss {loss3}  {spent}",
               f"loss {loss3}", ""]
    room = width - len(state) - len(count) - min_bar - 3  # three gaps of one column between the four columns
    return state, count, next(c for c in choices if len(c) <= room)


def _short(x: float) -> str:
    """12,345 -> "12.3k"; 1,234,567 -> "1.23M"; small numbers as they are."""
    if x >= 1e6:
        return f"{x / 1e6:.3g}M"
    if x >= 1e4:
        return f"{x / 1e3:.3g}k"
    return f"{x:,.0f}"


def _clock(seconds: float) -> str:
    """1:02:03 or 2:03."""
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"
