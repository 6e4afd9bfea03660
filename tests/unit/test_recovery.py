"""The recovery rules as tables: outcome, counts and budgets in; next state, reason and backoff out. No Ray."""

from __future__ import annotations

import pytest

from policies.recovery import (Budgets, Next, Outcome, OutcomeKind, after, backoff_s, classify_failure,
                               results_outcome)
from workers.protocol import Ending, WorkerResult

K = OutcomeKind
BUDGETS = Budgets(max_preemptions=2, max_failures=1)


@pytest.mark.parametrize("kind, transient, pre, fail, expected", [
    # kind                 transient  counts   -> next, preemptions, failures, backoff (jitter 0)
    (K.SUCCEEDED,          True,      0, 0,    (Next.SUCCEED, 0, 0, 0.0)),
    (K.CANCELLED,          True,      1, 1,    (Next.CANCEL, 1, 1, 0.0)),
    (K.RESIZED,            True,      0, 0,    (Next.RESIZE, 0, 0, 0.0)),
    (K.PREEMPTED,          True,      0, 0,    (Next.RECOVER, 1, 0, 0.0)),   # no backoff after a preemption
    (K.INFRA_LOST,         True,      1, 0,    (Next.RECOVER, 2, 0, 0.0)),
    (K.PREEMPTED,          True,      2, 0,    (Next.FAIL, 3, 0, 0.0)),      # over max_preemptions
    (K.APP_FAILED,         True,      0, 0,    (Next.RECOVER, 0, 1, 2.0)),   # backoff 2**failures
    (K.APP_FAILED,         True,      0, 1,    (Next.FAIL, 0, 2, 0.0)),      # over max_failures
    (K.PROVISION_FAILED,   True,      0, 0,    (Next.RECOVER, 0, 1, 2.0)),   # workers did not start: a failure
    (K.PROVISION_FAILED,   False,     0, 0,    (Next.FAIL, 0, 0, 0.0)),      # permanent: no budget spent
])
def test_what_comes_after_an_outcome(kind, transient, pre, fail, expected):
    d = after(Outcome(kind, "why", transient=transient), preemptions=pre, failures=fail, budgets=BUDGETS, jitter=0.0)
    assert (d.next, d.preemptions, d.failures, d.backoff_s) == expected
    assert "why" in d.reason


@pytest.mark.parametrize("kind, pre, fail, reason", [
    (K.PREEMPTED, 0, 0, "why (preemption 1 of at most 2)"),
    (K.PREEMPTED, 2, 0, "3 preemptions or host losses, more than max_preemptions=2; last: why"),
    (K.APP_FAILED, 0, 0, "why (failure 1 of at most 1)"),
    (K.APP_FAILED, 0, 1, "the job's code failed 2 times (max_failures=1): why"),
    (K.PROVISION_FAILED, 0, 1, "could not start after 2 tries (max_failures=1): why"),
])
def test_the_reason_names_the_budget(kind, pre, fail, reason):
    assert after(Outcome(kind, "why"), preemptions=pre, failures=fail, budgets=BUDGETS, jitter=0.0).reason == reason


@pytest.mark.parametrize("failures, jitter, expected", [
    (1, 0.0, 2.0), (2, 0.0, 4.0), (5, 0.0, 32.0), (6, 0.0, 60.0), (30, 0.0, 60.0), (2, 0.999, 4.0 * 0.5005),
])
def test_backoff_doubles_to_a_minute_and_jitter_takes_up_to_half_off(failures, jitter, expected):
    assert backoff_s(failures, jitter) == pytest.approx(expected)


def _r(ending, **kw):
    return WorkerResult(Ending(ending), rank=0, steps=7, notice="host 1: SIGTERM", **kw)


@pytest.mark.parametrize("results, resizing_to, expected", [
    ([None, None], None, None),                                                    # still training
    ([_r("succeeded"), None], None, None),                                         # one host still at it
    ([_r("succeeded"), _r("succeeded")], None, K.SUCCEEDED),
    ([_r("stopped"), _r("stopped")], None, K.PREEMPTED),                           # a notice, saved and stopped
    ([_r("stopped"), _r("stopped")], "v4-32", K.RESIZED),                          # ... for a resize
    ([None, _r("failed", error="ValueError: x", traceback="tb")], None, K.APP_FAILED),  # to be confirmed
])
def test_results_outcome(results, resizing_to, expected):
    o = results_outcome(results, resizing_to=resizing_to, notice=None)
    assert (o.kind if o else None) == expected


def test_a_failure_is_the_jobs_only_while_every_host_is_healthy():
    failed = Outcome(K.APP_FAILED, "host 1: ValueError: x", traceback="tb", at=5.0)
    assert classify_failure(failed, host_lost=None, unreachable=None) is failed
    lost = classify_failure(failed, host_lost="host 1 of slice s is gone", unreachable=None)
    assert (lost.kind, lost.reason, lost.at) == (K.INFRA_LOST, "host 1 of slice s is gone", 5.0)
    gone = classify_failure(failed, host_lost=None, unreachable="RayActorError")
    assert (gone.kind, gone.reason) == (K.INFRA_LOST, "a worker is unreachable (RayActorError)")
