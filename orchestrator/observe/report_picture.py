"""A job's report as a picture: the PNG, panel by panel (see `orchestrator.observe.report`)."""

from __future__ import annotations

import datetime as dt
import io

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.transforms import blended_transform_factory

from orchestrator.observe.goodput import CATEGORIES, Goodput, format_duration
from orchestrator.observe.goodput_intervals import StateInterval
from orchestrator.observe.report_series import ReportSeries
from orchestrator.observe.timeline import MARKER_TITLES, SAVE, Marker

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

