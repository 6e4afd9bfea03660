"""The survivors of a lost slice go on from the newest step their hosts' memory holds; a loss seen at once (a
worker's death wakes its driver) can be seen while their copy of the last step done is still on its way to its
keeper, so that step is waited for a moment (`memory.common_step(expect=...)`), never for longer than
`settle_s`, and only the step the memory cadence copies is expected (`ReportSink.last_copied_step`)."""

from __future__ import annotations

import time
from types import SimpleNamespace

from orchestrator.control import memory
from orchestrator.control.job.reports import ReportSink


def _answers(monkeypatch, *steps):
    seen = iter(steps)
    asked = []

    def common(slices):
        asked.append(time.monotonic())
        step = next(seen, steps[-1])
        return step, "" if step is not None else "no copy"

    monkeypatch.setattr(memory, "_common_step", common)
    return asked


def test_a_copy_still_on_its_way_is_waited_for(monkeypatch):
    asked = _answers(monkeypatch, 5, 5, 6)
    assert memory.common_step([], expect=6, settle_s=10.0) == (6, "")
    assert len(asked) == 3


def test_the_wait_ends_after_settle_s_with_what_they_hold(monkeypatch):
    asked = _answers(monkeypatch, 5)
    t0 = time.monotonic()
    assert memory.common_step([], expect=6, settle_s=0.3) == (5, "")
    assert 0.3 <= time.monotonic() - t0 < 2.0 and len(asked) > 1


def test_nothing_expected_or_nothing_held_is_answered_at_once(monkeypatch):
    asked = _answers(monkeypatch, 5, 6)
    assert memory.common_step([], settle_s=10.0) == (5, "") and len(asked) == 1
    _answers(monkeypatch, None)
    assert memory.common_step([], expect=6, settle_s=10.0) == (None, "no copy")  # storage then, not waited for


def test_the_step_expected_is_the_cadence_s_last_copy():
    def expected(last_step, every):
        return ReportSink.last_copied_step(SimpleNamespace(last_step=last_step, memory_every=every))

    assert expected(5, None) == 6 and expected(5, 1) == 6  # 6 steps done, a copy every step
    assert expected(5, 4) == 4 and expected(7, 4) == 8  # a copy every 4 steps: the last at 4, or at 8
    assert expected(-1, None) is None  # no step yet
