"""The budget cap and the deadline forecast (`policies.decisions.limits`), and how a failure's cause is
kept and shown."""

from __future__ import annotations

import json
import sqlite3

import pytest

from orchestrator.state.states import FailedBecause, JobState
from orchestrator.state.store import Store
from orchestrator.user.commands.views import jobs_lines, status_dict
from orchestrator.user.job import _status
from policies.decisions.limits import MIN_RUN_S, budget_refuses_start, budget_stop, forecast, step_seconds
from policies.decisions.recovery import Budgets, Next, Outcome, OutcomeKind, after


def test_the_budget_stops_a_job_while_its_stop_still_fits_under_the_cap():
    # $36/h: 10 s of a stop cost $0.10.
    assert budget_stop(spent_usd=0.89, usd_per_hour=36.0, cap_usd=1.0, stop_s=10) is None
    why = budget_stop(spent_usd=0.90, usd_per_hour=36.0, cap_usd=1.0, stop_s=10)
    assert why == "budget_usd is $1.00: $0.90 spent, and stopping may cost $0.10 more"
    assert budget_stop(spent_usd=1.5, usd_per_hour=36.0, cap_usd=1.0, stop_s=0) is not None  # already over


def test_a_slice_starts_only_if_the_budget_pays_for_some_training_and_its_stop():
    price = 36.0  # $0.01 a second
    need = (10 + MIN_RUN_S) * price / 3600
    assert budget_refuses_start(spent_usd=1.0 - need - 0.001, usd_per_hour=price, cap_usd=1.0, stop_s=10) is None
    why = budget_refuses_start(spent_usd=1.0 - need + 0.001, usd_per_hour=price, cap_usd=1.0, stop_s=10)
    assert why.startswith("budget_usd is $1.00: $0.60 spent, and $0.40 left does not pay for 30 s"), why


def test_the_deadline_forecast_counts_the_steps_left_at_the_measured_speed():
    f = forecast(elapsed_s=100.0, deadline_s=600.0, steps_left=1000, step_s=0.6)
    assert (f.end_s, f.late_by_s, f.late) == (700.0, 100.0, True)
    assert not forecast(elapsed_s=100.0, deadline_s=600.0, steps_left=100, step_s=0.6).late
    assert forecast(elapsed_s=10.0, deadline_s=5.0, steps_left=-3, step_s=1.0).steps_left == 0


def test_the_speed_is_the_span_of_the_marks_over_their_steps():
    assert step_seconds([(0.0, 10), (1.0, 12), (5.0, 20)]) == 0.5  # a slow step (a save) counts
    assert step_seconds([(0.0, 10)]) is None
    assert step_seconds([(0.0, 10), (1.0, 10)]) is None


def test_a_budget_stop_fails_the_job_and_spends_no_budget_of_failures():
    d = after(Outcome(OutcomeKind.BUDGET_SPENT, "budget_usd is $1.00: ..."), preemptions=2, failures=1,
              budgets=Budgets(max_preemptions=5, max_failures=1), jitter=0.0)
    assert (d.next, d.preemptions, d.failures, d.reason) == (Next.FAIL, 2, 1, "budget_usd is $1.00: ...")


def test_a_failed_jobs_cause_is_kept_and_shown_with_its_state(tmp_path):
    store = Store(tmp_path / "s.db")
    store.create_job("j1", "one", {"accelerator": "v4-8", "tier": "spot", "workload": {"steps": 10}})
    store.transition("j1", JobState.FAILED, "budget_usd is $1.00: ...", cause=FailedBecause.BUDGET.value)
    store.create_job("j2", "two", {"accelerator": "v4-8", "tier": "spot", "workload": {"steps": 10}})
    store.transition("j2", JobState.CANCELLED, "cancelled by the user")
    one, two = (_status(store.job(j), None) for j in ("j1", "j2"))
    assert (one.state, one.cause, one.state_name) == (JobState.FAILED, FailedBecause.BUDGET, "FAILED_BUDGET")
    assert (two.cause, two.state_name) == (None, "CANCELLED")
    assert json.loads(json.dumps(status_dict(one)))["cause"] == "budget"  # list --json, status --json
    assert status_dict(one)["state"] == "FAILED"
    assert "FAILED_BUDGET" in "\n".join(jobs_lines([one, two], width=80))


def test_a_store_of_the_version_before_gets_the_cause_column(tmp_path):
    path = tmp_path / "old.db"
    Store(path).create_job("j", "old", {})
    db = sqlite3.connect(path)  # as version 2 left it: no cause column
    db.execute("ALTER TABLE jobs DROP COLUMN cause")
    db.execute("UPDATE meta SET value='2' WHERE key='schema_version'")
    db.commit()
    db.close()
    store = Store(path)
    assert store.job("j").cause is None
    store.transition("j", JobState.FAILED, "no slice", cause=FailedBecause.NO_RESOURCE.value)
    assert store.job("j").cause is FailedBecause.NO_RESOURCE


@pytest.mark.parametrize("cause", list(FailedBecause))
def test_every_cause_has_a_state_name(cause):
    assert cause.state_name() == f"FAILED_{cause.value.upper()}"
