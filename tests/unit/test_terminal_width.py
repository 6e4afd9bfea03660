"""What the commands print fits the terminal: `status`, `list`, `plan` and the progress line at 80 and 120 columns.

No line may be wider than the terminal, and nothing may be cut so that two rows read the
same (two jobs of one name once both read `gru-lm-disrup...`).
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from orchestrator.state.events import Launched, ResizeAsked, StateChange
from orchestrator.state.states import JobState
from orchestrator.state.store import Store
from orchestrator.user import cli
from orchestrator.user.commands import console
from orchestrator.user.job import JobStatus
from orchestrator.user.progress import LiveBar, bar_fields
from orchestrator.user.terminal import fit_fields, table, unique_prefixes
from tests.unit.test_goodput import preempted_job

REPO = Path(__file__).resolve().parents[2]
WIDTHS = (80, 120)
J = JobState


def _running(store, job_id, name, *, steps=1000, done=73, accelerator="v4-8"):
    store.create_job(job_id, name, {"name": name, "accelerator": accelerator, "tier": "spot",
                                       "workload": {"type": "lm", "steps": steps}})
    store.transition(job_id, J.PROVISIONING, f"requesting {accelerator} (spot)")
    store.transition(job_id, J.STARTING, "slice ready")
    store.add_event(job_id, Launched(f"{job_id}-1", ["n1"], [1], 1), "launched")
    store.transition(job_id, J.RUNNING, "all hosts joined the runtime", data=StateChange(generation=1), generation=1)
    store.record_steps(job_id, 1, [(k, 2.5 - k / 1000, 48758.0, 0.05) for k in range(done)])


@pytest.fixture
def home(tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("ORCHESTRATOR_HOME", str(home))
    store = Store(home / "state.db")
    preempted_job(store, "lm-0a1b2c")
    _running(store, "gru-lm-disruption-3f2a1c", "gru-lm-disruption")
    _running(store, "gru-lm-disruption-3f9b00", "gru-lm-disruption", done=412)
    _running(store, "resized-c0ffee", "resized", steps=20000, done=12345, accelerator="v4-16")
    store.add_event("resized-c0ffee", ResizeAsked("v4-16", "v4-32", "spot", "requested by the user", 12345),
                    "resizing v4-16 spot -> v4-32 spot: requested by the user")
    store.create_job("waiting-for-a-very-long-name-of-forty-c-123abc", "waiting-for-a-very-long-name-of-forty-c",
                     {"name": "waiting-for-a-very-long-name-of-forty-c", "accelerator": "v4-128",
                      "tier": "on-demand", "workload": {"type": "lm", "steps": 100}})
    store.transition("waiting-for-a-very-long-name-of-forty-c-123abc", J.QUEUED,
                     "waiting for capacity: v4-128 on-demand (up to 7200 s) behind gru-lm-disruption-3f2a1c, "
                     "0 of 8 hosts free")
    return home


def run_at(width: int, monkeypatch, *args) -> tuple[int, list[str]]:
    buf = io.StringIO()
    monkeypatch.setattr(console, "out", Console(file=buf, width=width, soft_wrap=True, color_system=None))
    r = CliRunner().invoke(cli.app, list(args))
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    return r.exit_code, (buf.getvalue() + r.stdout).splitlines()


def assert_fits(lines: list[str], width: int) -> None:
    assert lines
    wide = [line for line in lines if len(line) > width]
    assert not wide, f"{len(wide)} line(s) wider than {width}: {wide}"
    assert not any("..." in line or "…" in line for line in lines), lines  # nothing cut with an ellipsis


@pytest.mark.parametrize("width", WIDTHS)
def test_list_fits_and_names_every_job_apart(home, monkeypatch, width):
    code, lines = run_at(width, monkeypatch, "list")
    assert code == 0
    assert_fits(lines, width)
    assert lines[0].split()[:3] == ["id", "state", "slice"] and "wall time" in lines[0]
    rows, note = lines[1:6], " ".join(lines[6:])
    assert len(set(rows)) == 5
    assert note.startswith("4 job(s) not ended, but the local cluster is not running")  # no cluster in this test
    store = Store(home / "state.db")
    shown = [row.split()[0] for row in rows]
    assert len(set(shown)) == 5
    for prefix in shown:  # each is a prefix every command accepts for its job
        assert store.find_job(prefix).id.startswith(prefix)
    if width == 80:  # the two jobs of one name differ in what is shown
        assert "gru-lm-disruption-3f2" in shown and "gru-lm-disruption-3f9" in shown
    assert any("QUEUED #1" in row for row in rows)


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("job", ["lm-0a1b2c", "gru-lm-disruption-3f2a1c", "resized", "waiting-for"])
def test_status_fits_and_shows_wall_time(home, monkeypatch, width, job):
    code, lines = run_at(width, monkeypatch, "status", job, "--events")
    assert code == 0
    assert_fits(lines, width)
    text = "\n".join(lines)
    assert ("wall time 1m 50s" if job == "lm-0a1b2c" else "running for ") in text
    if job == "resized":  # right after a resize: what the move is doing, not only RUNNING
        assert "moving to v4-32 spot: checkpointing (step 12345)" in re.sub(r"\s+", " ", text)
    if job == "lm-0a1b2c":
        assert "goodput 27.3%" in text and "1 preemption, 0 failures, 1 restart" in text


_PLANS: dict[tuple[str, str], object] = {}


@pytest.fixture
def plan_once(monkeypatch):
    """The plan of a job file is the same at every width: the real `plan_spec` (a replay of each option over
    the policy's traces, seconds of CPU) runs once for the module, and each width renders it."""
    from orchestrator.user import planning

    real = planning.plan_spec

    def once(spec, **options):
        key = (spec.model_dump_json(), repr(sorted(options.items())))
        if key not in _PLANS:
            _PLANS[key] = real(spec, **options)
        return _PLANS[key]

    monkeypatch.setattr(planning, "plan_spec", once)


@pytest.mark.parametrize("width", WIDTHS)
def test_plan_fits(home, monkeypatch, plan_once, width):
    code, lines = run_at(width, monkeypatch, "plan", str(REPO / "examples" / "plan-1b.yaml"))
    assert code == 0
    assert_fits(lines, width)
    assert any(line.startswith("cost policy, first window:") for line in lines)
    assert any("cost policy" in line and "$" in line for line in lines)


def _status(step: int, total: int, loss: float | None = 2.3456, tps: float | None = 48758.0) -> JobStatus:
    return JobStatus(id="gru-lm-disruption-3f2a1c", name="gru-lm-disruption", state=J.RUNNING, reason="",
                     accelerator="v4-8", tier="spot", step=step, total_steps=total, loss=loss, tokens_per_s=tps,
                     preemptions=0, failures=0, error=None, created_at=0.0, updated_at=0.0)


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("step,total", [(73, 1000), (12345, 100000), (0, 8)])
def test_progress_line_fits_and_keeps_the_whole_step_count(width, step, total):
    bar = LiveBar(Console(file=io.StringIO(), width=width))
    bar.update(_status(step, total), 1234.56, 3723.0)
    buf = io.StringIO()
    Console(file=buf, width=width, color_system=None).print(bar.progress.get_renderable())
    lines = buf.getvalue().splitlines()
    assert_fits(lines, width)
    assert len(lines) == 1 and f"{step}/{total}" in lines[0]
    state, count, stats = bar_fields(_status(step, total), 1234.56, 3723.0, 65.0, width=width)
    assert count == f"{step}/{total}" and stats.startswith("loss 2.34")
    if width == 120:
        assert "tok/s" in stats and "ETA 1:02:03" in stats and "$1,234.56" in stats


def test_the_layout_helpers():
    assert unique_prefixes(["abc-1", "abc-2", "xyz-9", "ab"], minimum=2) == {
        "abc-1": "abc-1", "abc-2": "abc-2", "xyz-9": "xy", "ab": "ab"}
    assert fit_fields(["aaaa", "bbbb", "cccc"], 12, indent="  ") == ["  aaaa  bbbb", "  cccc"]
    lines = table(["id", "note", "n"], [["x", "a long note", "1"], ["yy", "b", "22"]], 12, right=(2,), drop_order=(1,))
    assert lines == ["id   n", "x    1", "yy  22"]
