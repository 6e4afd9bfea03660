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
import json
import os
import statistics
import tempfile
from pathlib import Path

from orchestrator.domain.locations import kernel_tree_problem
from orchestrator.errors import OutputFileError
from orchestrator.observe.goodput import format_duration, summary_line
from orchestrator.observe.report_picture import render_png
from orchestrator.observe.report_series import ReportSeries, report_series  # also for tests/integration/test_profile
from orchestrator.state.store import Event, Store
from workers.protocol import LOOP_METRICS

FORMATS = (".png", ".html")


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


def _clock(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts).astimezone().strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def _transition(e: Event) -> str:
    return f"{e.from_state.value if e.from_state else ''} → {e.to_state.value}" if e.to_state else ""
