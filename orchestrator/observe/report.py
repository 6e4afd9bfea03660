"""One job's report: a picture of its run, as a PNG or as a self-contained HTML page.

The picture, top to bottom: loss against step (a disrupted run that restored right draws
the curve an undisturbed one would, so this is where to check it by eye); then against
time since submission: the job's state, loss, throughput, the slices held (chips,
coloured by tier), cumulative cost; and where the wall time went (the goodput
categories) as one stacked bar. Every event worth a marker
(`orchestrator.observe.timeline`: preemptions, host losses, worker crashes, hangs,
program failures, restores, checkpoint saves, moves, controller adoptions, profile
captures) is a vertical line in its kind's colour and style, on the step panel at its step
and on the time panels at its time; each is labelled on the two loss panels, and the
legend names every kind with its count. The HTML page adds the goodput table and the job's
event list, with the picture inlined, so it can be mailed or attached as one file.
"""

from __future__ import annotations

import base64
import datetime as dt
import html
import io
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.transforms import blended_transform_factory

from orchestrator.domain.locations import kernel_tree_problem
from orchestrator.errors import OutputFileError, RequestError
from orchestrator.observe.billing import BilledSlice, billed_slices
from orchestrator.observe.goodput import CATEGORIES, Goodput, compute_goodput, format_duration, summary_line
from orchestrator.observe.goodput_intervals import StateInterval, state_intervals
from orchestrator.observe.timeline import MARKER_TITLES, SAVE, Marker
from orchestrator.observe.timeline import markers as timeline_markers
from orchestrator.state.events import EventKind, Profiled
from orchestrator.state.store import Event, StepMetric, Store
from workers.protocol import LOOP_METRICS

FORMATS = (".png", ".html")

_MARKER_STYLE = {  # kind (orchestrator.observe.timeline) -> (colour, line style)
    "preemption": ("#d62728", "--"),
    "host_lost": ("#8c1a1a", "--"),
    "worker_crash": ("#e377c2", "--"),
    "hung": ("#bcbd22", "--"),
    "failure": ("#ff7f0e", "--"),
    "restore": ("#2ca02c", ":"),
    "checkpoint": ("#7f7f7f", (0, (1, 3))),
    "move": ("#9467bd", "-."),
    "adoption": ("#17becf", (0, (8, 2, 1, 2))),
    "profile": ("#1f77b4", ":"),
}
_MARKER_TITLES = {**MARKER_TITLES, "profile": "profile capture"}
MAX_LABELLED_CHECKPOINTS = 30  # beyond this many saves, their lines are named by the legend alone
_STATE_COLOUR = {"PENDING": "#bdbdbd", "QUEUED": "#e0e0e0", "PROVISIONING": "#9ecae1", "STARTING": "#3182bd",
                 "RUNNING": "#2ca02c", "RECOVERING": "#d62728", "RESIZING": "#9467bd"}
_TIER_COLOUR = {"spot": "#ff9f1c", "on-demand": "#1f77b4", "reserved": "#2ca02c"}
_CATEGORY_COLOUR = dict(zip(CATEGORIES, ["#2ca02c", "#bdbdbd", "#9ecae1", "#3182bd", "#9467bd", "#17becf",
                                         "#8c564b", "#d62728", "#eeeeee"], strict=True))

class NoStepsError(RequestError, ValueError):
    """A report was asked for a job that has not reported a single training step."""

    def __init__(self, job_id: str):
        self.job_id = job_id
        super().__init__(f"job {job_id!r} has no recorded steps yet; there is nothing to plot")


@dataclass(frozen=True)
class ReportSeries:
    """Everything the picture shows, as plain numbers (times are Unix seconds)."""

    job_id: str
    name: str
    state: str
    start: float  # the job's submission
    end: float  # its end (or now), or the last slice release if later
    states: tuple[StateInterval, ...]
    step_at: tuple[float, ...]  # when each kept step was reported
    step: tuple[int, ...]
    generation: tuple[int, ...]
    loss: tuple[float, ...]
    tokens_per_s: tuple[float | None, ...]
    metrics: tuple[dict, ...]  # each step's other figures (MFU, HBM, the program's own)
    slices: tuple[BilledSlice, ...]
    chips_at: tuple[float, ...]  # a step function: `chips[i]` chips held from `chips_at[i]` on
    chips: tuple[int, ...]
    cost_at: tuple[float, ...]  # cumulative dollars, linear between these points
    cost_usd: tuple[float, ...]
    markers: tuple[Marker, ...]
    goodput: Goodput


def report_series(store: Store, job_id: str, *, now: float | None = None) -> ReportSeries:
    """The series of job `job_id`'s report; raises `NoStepsError` if it has no steps."""
    job, events, steps = store.job(job_id), store.events(job_id), store.steps(job_id)
    if not steps:
        raise NoStepsError(job_id)
    now = time.time() if now is None else now
    g = compute_goodput(job, events, steps, now=now)
    slices = tuple(billed_slices(events, end=g.end))
    end = max([g.end] + [s.end for s in slices])
    changes = sorted({g.start, end} | {t for s in slices for t in (s.start, s.end) if g.start <= t <= end})
    return ReportSeries(
        job_id=job.id, name=job.name, state=job.state.value, start=g.start, end=end,
        states=tuple(iv for iv in state_intervals(job, events, now=now) if iv.end > iv.start),
        step_at=tuple(s.at for s in steps), step=tuple(s.step for s in steps),
        generation=tuple(s.generation for s in steps), loss=tuple(s.loss for s in steps),
        tokens_per_s=tuple(s.tokens_per_s for s in steps), metrics=tuple(s.metrics for s in steps), slices=slices,
        chips_at=tuple(changes), chips=tuple(sum(s.chips for s in slices if s.start <= t < s.end) for t in changes),
        cost_at=tuple(changes), cost_usd=tuple(sum(s.usd_until(t) for s in slices) for t in changes),
        markers=tuple(_markers(events, steps)), goodput=g)


def write_report(store: Store, job_id: str, path: Path | str, *, now: float | None = None,
                 force: bool = False) -> Path:
    """Write job `job_id`'s report to `path`: a `.png` picture or a self-contained `.html` page.

    The file appears whole or not at all (see `write_atomically`); `OutputFileError` if `path`
    cannot be written, or exists and `force` does not allow to replace it (as `export` and
    `data prepare` do), checked before the picture is drawn.
    """
    path = Path(path)
    if path.suffix.lower() not in FORMATS:
        raise OutputFileError(path, f"a report's file name must end in {' or '.join(FORMATS)}")
    check_output_path(path)
    if path.exists() and not force:
        raise OutputFileError(path, "exists (--force replaces it)")
    series = report_series(store, job_id, now=now)
    png = render_png(series)
    if path.suffix.lower() == ".png":
        write_atomically(path, png)
    else:
        write_atomically(path, render_html(series, png, store.events(job_id)).encode("utf-8"))
    return path


def check_output_path(path: Path) -> None:
    """Raise `OutputFileError` unless `path` names a regular file (new or not) in a folder that exists.

    A symbolic link is refused: writing through it would overwrite whatever it points to.
    """
    if path.is_symlink():
        raise OutputFileError(path, "is a symbolic link; give the path of a regular file (its target is left alone)")
    if path.is_dir():
        raise OutputFileError(path, "is a directory; give a file name, e.g. report.html")
    if path.exists() and not path.is_file():
        raise OutputFileError(path, "exists and is not a regular file")
    if not path.parent.is_dir():
        raise OutputFileError(path, f"the folder {path.parent} does not exist")
    if (problem := kernel_tree_problem(path)) is not None:  # /dev/full.png: a file among the devices
        raise OutputFileError(path, problem)


def write_atomically(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a new temporary file beside it, renamed over `path`.

    A reader sees the old file or the whole new one, never half of it. The rename replaces
    a link that appears at `path` meanwhile, never its target.
    """
    check_output_path(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # O_EXCL, mode 600
    except OSError as e:
        raise OutputFileError(path, f"cannot create a file in {path.parent}: {e.strerror}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            os.fchmod(f.fileno(), 0o644)  # a report is for sharing, as a file written with umask 022 would be
        os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise OutputFileError(path, f"cannot write the file: {e.strerror}") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def render_png(s: ReportSeries) -> bytes:
    """The picture (see the module doc) as PNG bytes, 1100 x 1600 pixels."""
    fig = Figure(figsize=(11, 16), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)  # Agg, without pyplot: no global figure registry, safe off the main thread
    grid = fig.add_gridspec(8, 1, height_ratios=[3, 0.3, 0.35, 1.6, 1.6, 1.4, 1.3, 0.9])
    ax_step = fig.add_subplot(grid[0])
    ax_loss = fig.add_subplot(grid[3])
    ax_states, ax_tps, ax_chips, ax_cost = (fig.add_subplot(grid[i], sharex=ax_loss) for i in (2, 4, 5, 6))
    unit, unit_s = _time_unit(s.end - s.start)
    x = _elapsed(s.start, unit_s)

    dots = "." if len(s.step) <= 300 else ""  # thousands of dots would hide the line
    for gen in sorted(set(s.generation)):
        rows = [i for i, g in enumerate(s.generation) if g == gen]
        line, = ax_step.plot([s.step[i] + 1 for i in rows], [s.loss[i] for i in rows], dots + "-", ms=3, lw=1,
                             label=f"generation {gen}")
        ax_loss.plot([x(s.step_at[i]) for i in rows], [s.loss[i] for i in rows], dots + "-", ms=3, lw=1,
                     color=line.get_color())
        tps = [(i, rate) for i in rows if (rate := s.tokens_per_s[i]) is not None]
        ax_tps.plot([x(s.step_at[i]) for i, _ in tps], [rate for _, rate in tps], dots + "-", ms=3, lw=1,
                    color=line.get_color())
    ax_step.set_ylabel("loss")
    ax_step.set_xlabel("step")
    ax_step.set_xlim(0, max(s.step) + 1 + max(1, 0.01 * max(s.step)))
    ax_step.set_title("loss against step: after a disruption the curve goes on as if nothing happened", fontsize=10,
                      loc="left")
    ax_step.grid(alpha=0.3)
    legend = ax_step.legend(loc="upper right", fontsize=8, title="workers", title_fontsize=8)
    _plot_markers(ax_step, s.markers, lambda m: m.step, labelled=True)

    _plot_states(ax_states, s.states, x)
    ax_states.set_title("against time since submission", fontsize=10, loc="left")
    ax_loss.set_ylabel("loss")
    ax_tps.set_ylabel("tokens / s")
    ax_tps.set_ylim(bottom=0)
    _plot_slices(ax_chips, s, x)
    ax_cost.plot([x(t) for t in s.cost_at], s.cost_usd, color="black", lw=1.5)
    ax_cost.fill_between([x(t) for t in s.cost_at], s.cost_usd, color="#cccccc")
    ax_cost.set_ylabel("cost (USD)")
    ax_cost.set_ylim(bottom=0)
    if s.slices:
        ax_cost.annotate(f"${s.cost_usd[-1]:,.2f}", (x(s.cost_at[-1]), s.cost_usd[-1]), xytext=(-4, -4),
                         textcoords="offset points", ha="right", va="top", fontsize=9)
    else:  # a store from before slices were recorded as events: say so rather than show $0
        for ax in (ax_chips, ax_cost):
            ax.text(0.5, 0.5, "no slice events recorded", transform=ax.transAxes, ha="center", va="center",
                    color="#7f7f7f")
    ax_cost.set_xlabel(f"time since submission ({unit})")
    ax_cost.set_xlim(0, x(s.end))
    for ax in (ax_states, ax_loss, ax_tps, ax_chips):
        ax.tick_params(labelbottom=False)
    for ax in (ax_loss, ax_tps, ax_chips, ax_cost):
        ax.grid(alpha=0.3)
    for ax in (ax_states, ax_loss, ax_tps, ax_chips, ax_cost):
        _plot_markers(ax, s.markers, lambda m: x(m.at), labelled=ax is ax_loss, label_saves=False)
    _marker_legend(fig.add_subplot(grid[1]), s.markers)
    ax_step.add_artist(legend)
    _plot_goodput(fig.add_subplot(grid[7]), s.goodput)
    started = dt.datetime.fromtimestamp(s.start).astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")
    fig.suptitle(f"{s.name} ({s.job_id}): {s.state}\nsubmitted {started}, {format_duration(s.goodput.wall_s)} "
                 f"wall time, ${s.goodput.usd_total:,.2f}, {s.step[-1] + 1} steps", fontsize=12)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def render_html(s: ReportSeries, png: bytes, events: list[Event]) -> str:
    """A self-contained page: summary, the picture inlined, the goodput table and the event list."""
    e = html.escape
    g = s.goodput
    rows = "".join(f"<tr><td>{e(c.replace('_', ' '))}</td><td>{e(format_duration(sec))}</td>"
                   f"<td>{sec / g.wall_s if g.wall_s else 0:.1%}</td></tr>" for c, sec in g.seconds().items())
    rows += f"<tr class=total><td>wall time</td><td>{e(format_duration(g.wall_s))}</td><td>100.0%</td></tr>"
    event_rows = "".join(
        f"<tr><td>{e(_clock(ev.at))}</td><td>+{e(format_duration(max(0.0, ev.at - s.start)))}</td>"
        f"<td>{e(ev.kind.value)}</td><td>{e(_transition(ev))}</td><td>{e(ev.reason)}</td>"
        f"<td><code>{e(json.dumps(ev.data, sort_keys=True)) if ev.data else ''}</code></td></tr>" for ev in events)
    title = f"{s.name} ({s.job_id}): {s.state}"
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{e(title)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; }}
table {{ border-collapse: collapse; margin-bottom: 2em; }}
td, th {{ border-bottom: 1px solid #ddd; padding: 0.25em 0.8em; text-align: left; vertical-align: top; }}
table.goodput td:nth-child(n+2) {{ text-align: right; }}
tr.total td {{ font-weight: bold; }}
code {{ font-size: 0.85em; }}
img {{ max-width: 100%; }}
</style></head>
<body>
<h1>{e(title)}</h1>
<p>{e(summary_line(g))}</p>
<img alt="loss, throughput, slices, cost and goodput of {e(s.job_id)}"
     src="data:image/png;base64,{base64.b64encode(png).decode()}">
<h2>Goodput</h2>
<table class="goodput"><tr><th>category</th><th>time</th><th>share</th></tr>{rows}</table>
<h2>Training</h2>
<table class="training">{training_rows(s)}</table>
<h2>Events</h2>
<table class="events">
<tr><th>time</th><th>since submission</th><th>kind</th><th>state</th><th>reason</th><th>data</th></tr>
{event_rows}</table>
</body></html>
"""


def training_rows(s: ReportSeries) -> str:
    """Median throughput and MFU, peak HBM, and the last value of each of the program's own metrics."""
    e = html.escape

    def median(values: list[float]) -> float | None:
        return statistics.median(values) if values else None

    def of(name: str) -> list[float]:
        return [m[name] for m in s.metrics if name in m]

    rows = [("tokens/s (median)", median([t for t in s.tokens_per_s if t is not None]), ",.0f"),
            ("MFU (median, of the bf16 peak)", median(of("mfu")), ".1%"),
            ("model TFLOP/s per chip (median)", median(of("tflops_per_chip")), ".3g"),
            ("HBM peak (GiB, host 0's first device)", max(of("hbm_peak_gib"), default=None), ".2f")]
    last = s.metrics[-1] if s.metrics else {}
    rows += [(f"{name} (last step)", value, ".4g") for name, value in sorted(last.items()) if name not in LOOP_METRICS]
    return "".join(f"<tr><td>{e(label)}</td><td>{'-' if v is None else format(v, fmt)}</td></tr>"
                   for label, v, fmt in rows)


# -- pieces of the picture ---------------------------------------------------------------


def _markers(events: list[Event], steps: list[StepMetric]) -> list[Marker]:
    out = timeline_markers(events, steps)
    for e in events:
        if e.kind is not EventKind.PROFILE:
            continue
        p = e.payload_as(Profiled)
        if p.path and p.steps and p.first_step is not None:  # a capture that traced names its first step
            out.append(Marker(e.at, p.first_step, "profile",
                              f"profile steps {p.first_step}-{p.first_step + p.steps - 1}", e.reason))
    return sorted(out, key=lambda m: m.at)


def _plot_states(ax, states: tuple[StateInterval, ...], x) -> None:
    """The job's state over time as one coloured strip, each stretch named where it is wide enough."""
    span = x(states[-1].end) - x(states[0].start) if states else 0.0
    for iv in states:
        x0, width = x(iv.start), x(iv.end) - x(iv.start)
        ax.broken_barh([(x0, width)], (0, 1), color=_STATE_COLOUR.get(iv.state, "#eeeeee"))
        if span and width / span > 0.06:
            ax.text(x0 + width / 2, 0.5, iv.state.lower(), ha="center", va="center", fontsize=7, clip_on=True)
    ax.set_ylim(0, 1)
    ax.set_yticks([])
    ax.set_ylabel("state", rotation=0, ha="right", va="center")


def _plot_slices(ax, s: ReportSeries, x) -> None:
    seen_tiers = set()
    for sl in s.slices:
        colour = _TIER_COLOUR.get(sl.tier, "#7f7f7f")
        ax.fill_between([x(sl.start), x(sl.end)], 0, sl.chips, color=colour, alpha=0.35, lw=0,
                        label=None if sl.tier in seen_tiers else sl.tier)
        seen_tiers.add(sl.tier)
        ax.text(x((sl.start + sl.end) / 2), sl.chips / 2, f"{sl.accelerator}\n{sl.tier}", ha="center", va="center",
                fontsize=8, clip_on=True)
    ax.step([x(t) for t in s.chips_at], s.chips, where="post", color="black", lw=1.2)
    ax.set_ylabel("chips held")
    ax.set_ylim(0, max(s.chips + (1,)) * 1.25)
    if seen_tiers:
        ax.legend(loc="upper right", fontsize=8, title="tier", title_fontsize=8)


def _plot_markers(ax, markers: tuple[Marker, ...], where, *, labelled: bool, label_saves: bool = True) -> None:
    """Each marker as a vertical line at `where(marker)` (skipped where that is None); with `labelled`,
    its label beside it, inside the axes whichever edge it is near, staggered where labels would meet.
    Checkpoint saves are labelled only with `label_saves` (and while there are few of them)."""
    on_top = blended_transform_factory(ax.transData, ax.transAxes)  # x in data, y in axes fractions
    placed = [(where(m), m) for m in markers if where(m) is not None]
    many_saves = sum(m.kind == SAVE for _, m in placed) > MAX_LABELLED_CHECKPOINTS
    lo, hi = ax.get_xlim()
    span = (hi - lo) or 1.0
    last_x, row = None, 0
    for pos, m in placed:
        colour, style = _MARKER_STYLE.get(m.kind, ("#000000", "-"))
        ax.axvline(pos, color=colour, ls=style, lw=1.0 if m.kind == SAVE else 1.2)
        if not labelled or (m.kind == SAVE and (many_saves or not label_saves)):
            continue
        row = row + 1 if last_x is not None and (pos - last_x) / span < 0.025 else 0
        last_x = pos
        near_left = (pos - lo) / span < 0.03
        ax.text(pos, 0.98 - 0.34 * (row % 3), f" {m.label} " if near_left else f"{m.label} ", transform=on_top,
                rotation=90, ha="left" if near_left else "right", va="top", fontsize=7.5, color=colour,
                clip_on=False, bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.6, "pad": 0.5})


def _marker_legend(ax, markers: tuple[Marker, ...]) -> None:
    """One line naming each kind of marker drawn, with its line style and how many there are."""
    from matplotlib.lines import Line2D

    ax.axis("off")
    kinds = [k for k in _MARKER_STYLE if any(m.kind == k for m in markers)]
    if not kinds:
        ax.text(0.0, 0.5, "no disruptions, restores, saves, moves or adoptions", transform=ax.transAxes,
                fontsize=8, color="#7f7f7f", va="center")
        return
    handles = [Line2D([], [], color=_MARKER_STYLE[k][0], ls=_MARKER_STYLE[k][1], lw=1.5) for k in kinds]
    labels = [f"{_MARKER_TITLES.get(k, k)} ({sum(m.kind == k for m in markers)})" for k in kinds]
    ax.legend(handles, labels, loc="center", ncol=min(len(kinds), 5), fontsize=8, frameon=False,
              handlelength=3)


def _plot_goodput(ax, g: Goodput) -> None:
    """One horizontal bar of 100%: each category's share of wall time, labelled where it is wide enough."""
    left = 0.0
    for category, seconds in g.seconds().items():
        share = 100 * seconds / g.wall_s if g.wall_s > 0 else 0.0
        ax.barh(0, share, height=0.6, left=left, color=_CATEGORY_COLOUR[category], edgecolor="white",
                label=f"{category.replace('_', ' ')} {share:.1f}% ({format_duration(seconds)})")
        if share >= 6:
            ax.text(left + share / 2, 0, f"{share:.0f}%", ha="center", va="center", fontsize=9)
        left += share
    ax.set_xlim(0, 100)
    ax.set_yticks([])
    ax.set_xlabel("share of wall time (%)")
    ax.set_title(f"where the {format_duration(g.wall_s)} went: goodput {g.goodput_fraction:.1%}", fontsize=10,
                 loc="left")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.45), ncol=3, fontsize=8, frameon=False)


def _time_unit(span_s: float) -> tuple[str, float]:
    """The unit that keeps the time axis' numbers readable."""
    if span_s >= 3 * 3600:
        return "h", 3600.0
    if span_s >= 180:
        return "min", 60.0
    return "s", 1.0


def _elapsed(start: float, unit_s: float):
    return lambda t: (t - start) / unit_s


def _clock(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts).astimezone().strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def _transition(e: Event) -> str:
    return f"{e.from_state.value if e.from_state else ''} → {e.to_state.value}" if e.to_state else ""
