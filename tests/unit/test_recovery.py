"""The recovery rules as tables: outcome, counts and budgets in; next state, reason and backoff out. No Ray."""

from __future__ import annotations

import errno

import pytest

from policies.decisions.recovery import (
    RULES,
    Budgets,
    FailureCause,
    Next,
    Outcome,
    OutcomeKind,
    after,
    backoff_s,
    classify_failure,
    failure_cause,
    native_error,
    native_lines,
    results_outcome,
    telling_lines,
)
from workers.protocol import Ending, WorkerResult

K = OutcomeKind
BUDGETS = Budgets(max_preemptions=2, max_failures=1, max_aborts=3)


@pytest.mark.parametrize("kind, transient, pre, fail, ab, expected", [
    # kind                 transient  counts     -> next, preemptions, failures, aborts, backoff (jitter 0)
    (K.SUCCEEDED,          True,      0, 0, 0,   (Next.SUCCEED, 0, 0, 0, 0.0)),
    (K.CANCELLED,          True,      1, 1, 1,   (Next.CANCEL, 1, 1, 1, 0.0)),
    (K.RESIZED,            True,      0, 0, 0,   (Next.RESIZE, 0, 0, 0, 0.0)),
    (K.PREEMPTED,          True,      0, 0, 0,   (Next.RECOVER, 1, 0, 0, 0.0)),   # no backoff after a preemption
    (K.INFRA_LOST,         True,      1, 0, 0,   (Next.RECOVER, 2, 0, 0, 0.0)),   # a host went
    (K.PREEMPTED,          True,      2, 0, 0,   (Next.FAIL, 3, 0, 0, 0.0)),      # over max_preemptions
    (K.WORKER_ABORTED,     True,      0, 0, 0,   (Next.RECOVER, 0, 0, 1, 2.0)),   # its own budget, never a preemption
    (K.WORKER_ABORTED,     True,      0, 0, 3,   (Next.FAIL, 0, 0, 4, 0.0)),      # over max_aborts
    (K.HUNG,               True,      0, 0, 0,   (Next.RECOVER, 0, 1, 0, 2.0)),   # workers answer, no step: a failure
    (K.HUNG,               True,      0, 1, 0,   (Next.FAIL, 0, 2, 0, 0.0)),
    (K.APP_FAILED,         True,      0, 0, 0,   (Next.RECOVER, 0, 1, 0, 2.0)),   # backoff 2**failures
    (K.APP_FAILED,         True,      0, 1, 0,   (Next.FAIL, 0, 2, 0, 0.0)),      # over max_failures
    (K.USER_EXIT,          True,      0, 0, 0,   (Next.RECOVER, 0, 1, 0, 2.0)),   # sys.exit(1): as a raise
    (K.USER_EXIT,          False,     0, 0, 0,   (Next.FAIL, 0, 1, 0, 0.0)),      # sys.exit(0) before the end: never
    (K.IMPORT_ERROR,       True,      0, 0, 0,   (Next.FAIL, 0, 1, 0, 0.0)),      # never tried again
    (K.STORAGE_FAILED,     True,      0, 0, 0,   (Next.FAIL, 0, 1, 0, 0.0)),      # a full disk: never tried again
    (K.PLATFORM_FAILED,    True,      0, 0, 0,   (Next.FAIL, 0, 1, 0, 0.0)),      # a host without its TPU: never
    (K.FOLDER_TAKEN,       True,      0, 0, 0,   (Next.FAIL, 0, 1, 0, 0.0)),      # another job's folder now: never
    (K.PROVISION_FAILED,   True,      0, 0, 0,   (Next.RECOVER, 0, 1, 0, 2.0)),   # workers did not start: a failure
    (K.PROVISION_FAILED,   False,     0, 0, 0,   (Next.FAIL, 0, 0, 0, 0.0)),      # permanent: no budget spent
])
def test_what_comes_after_an_outcome(kind, transient, pre, fail, ab, expected):
    d = after(Outcome(kind, "why", transient=transient), preemptions=pre, failures=fail, aborts=ab, budgets=BUDGETS,
              jitter=0.0)
    assert (d.next, d.preemptions, d.failures, d.aborts, d.backoff_s) == expected
    assert "why" in d.reason


def test_every_way_of_ending_has_a_rule():
    # The ends the job asked for (a resize, the budget's stop) and the final ones are no rule's: nothing is retried.
    assert set(RULES) == set(K) - {K.SUCCEEDED, K.CANCELLED, K.RESIZED, K.BUDGET_SPENT}
    assert {k for k in K if Outcome(k, "x").counts_as_preemption} == {K.PREEMPTED, K.INFRA_LOST}


@pytest.mark.parametrize("kind, pre, fail, ab, transient, reason", [
    (K.PREEMPTED, 0, 0, 0, True, "why (preemption 1 of at most 2)"),
    (K.PREEMPTED, 2, 0, 0, True, "3 preemptions or host losses, more than max_preemptions=2; last: why"),
    (K.APP_FAILED, 0, 0, 0, True, "why (failure 1 of at most 1)"),
    (K.APP_FAILED, 0, 1, 0, True, "the job's code failed 2 times (max_failures=1): why"),
    (K.PROVISION_FAILED, 0, 1, 0, True, "could not start after 2 tries (max_failures=1): why"),
    (K.WORKER_ABORTED, 0, 0, 1, True, "why (abort 2 of at most 3)"),
    (K.WORKER_ABORTED, 0, 0, 3, True, "4 worker aborts, more than max_aborts=3; last: why"),
    (K.HUNG, 0, 1, 0, True, "the job hung 2 times (max_failures=1): why"),
    (K.USER_EXIT, 0, 1, 0, True, "the job's code exited 2 times (max_failures=1): why"),
    (K.USER_EXIT, 0, 0, 0, False, "why; not tried again: the program ended itself with status 0; run again it "
                                  "would do the same"),
    (K.IMPORT_ERROR, 0, 0, 0, True, "why; not tried again: every slice would import the same code; fix it and "
                                    "submit again"),
    (K.STORAGE_FAILED, 0, 0, 0, True, "why; not tried again: the disk would refuse again; free space (or point "
                                      "checkpoint.directory elsewhere) and submit again: it goes on from the last "
                                      "committed step"),
    (K.PLATFORM_FAILED, 0, 0, 0, True, "why; not tried again: every launch on these hosts would find the same "
                                       "chips"),
    (K.FOLDER_TAKEN, 0, 0, 0, True, "why; not tried again: the folder's checkpoints are another job's now; give "
                                    "this job a checkpoint folder of its own and submit again"),
])
def test_the_reason_names_the_budget(kind, pre, fail, ab, transient, reason):
    d = after(Outcome(kind, "why", transient=transient), preemptions=pre, failures=fail, aborts=ab, budgets=BUDGETS,
              jitter=0.0)
    assert d.reason == reason


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
    ([None, _r("failed", error="ValueError: x", cause="error")], None, K.APP_FAILED),
    ([None, _r("failed", error="exited", cause="exit", exit_code=3)], None, K.USER_EXIT),
    ([_r("failed", cause="import"), None], None, K.IMPORT_ERROR),
    ([_r("failed", cause="storage"), None], None, K.STORAGE_FAILED),
    ([_r("failed", cause="platform"), _r("failed", cause="error")], None, K.PLATFORM_FAILED),  # no TPU, then gloo
    ([_r("failed", cause="error"), _r("failed", cause="folder_taken")], None, K.FOLDER_TAKEN),  # a save refused
    # The host that says most wins: the others only failed in a collective after it.
    ([_r("failed", error="XlaRuntimeError: gloo", cause="error"), _r("failed", cause="storage")], None,
     K.STORAGE_FAILED),
])
def test_results_outcome(results, resizing_to, expected):
    o = results_outcome(results, resizing_to=resizing_to, notice=None)
    assert (o.kind if o else None) == expected


def test_a_platform_failure_is_said_by_the_host_as_it_knows_itself():
    """Its worker names its host within its slice (rank 2 is host 0 of the second slice), so no rank is put first."""
    said = "host 0 of slice s2 (v4-16) found no TPU: Unable to initialize backend 'tpu'"
    o = results_outcome([None, None, WorkerResult(Ending.FAILED, rank=2, error=said, cause="platform")],
                        resizing_to=None, notice=None)
    assert o is not None and (o.kind, o.reason) == (K.PLATFORM_FAILED, said)


@pytest.mark.parametrize("code, transient", [(0, False), (1, True), (2, True)])
def test_only_an_exit_with_status_0_is_never_tried_again(code, transient):
    o = results_outcome([_r("failed", error="SystemExit", cause="exit", exit_code=code)], resizing_to=None,
                        notice=None)
    assert (o.kind, o.transient) == (K.USER_EXIT, transient)


ENOSPC = ("OSError", errno.ENOSPC, "[Errno 28] No space left on device: '/ckpt/8.orbax-checkpoint-tmp'")


@pytest.mark.parametrize("chain, importing, cause", [
    ([("ValueError", None, "bad batch")], False, FailureCause.ERROR),
    ([("ModuleNotFoundError", None, "No module named 'train'")], True, FailureCause.IMPORT),
    ([("SyntaxError", None, "invalid syntax (train.py, line 3)")], True, FailureCause.IMPORT),
    ([("NameError", None, "name 'x' is not defined")], True, FailureCause.IMPORT),  # raised while importing
    ([("ModuleNotFoundError", None, "No module named 'wandb'")], False, FailureCause.IMPORT),  # a lazy import
    ([ENOSPC], False, FailureCause.STORAGE),
    ([("OSError", errno.EROFS, "[Errno 30] Read-only file system: '/ckpt'")], False, FailureCause.STORAGE),
    ([("OSError", errno.EDQUOT, "[Errno 122] Disk quota exceeded")], False, FailureCause.STORAGE),
    ([("RuntimeError", None, "save failed"), ENOSPC], False, FailureCause.STORAGE),  # wrapped: its cause says
    ([("ValueError", None, "NOT_FOUND: Error writing: No space left on device [tensorstore]")], False,
     FailureCause.STORAGE),  # a library's own error, in the operating system's words
    ([("OSError", errno.ENOENT, "[Errno 2] No such file or directory: 'x'")], False, FailureCause.ERROR),
])
def test_failure_cause(chain, importing, cause):
    assert failure_cause(chain, importing=importing) is cause


def test_a_failure_is_the_jobs_only_while_every_host_is_healthy():
    failed = Outcome(K.APP_FAILED, "host 1: ValueError: x", traceback="tb", at=5.0)
    assert classify_failure(failed, host_lost=None, unreachable=None) is failed
    lost = classify_failure(failed, host_lost="host 1 of slice s is gone", unreachable=None)
    assert (lost.kind, lost.reason, lost.at) == (K.INFRA_LOST, "host 1 of slice s is gone", 5.0)
    gone = classify_failure(failed, host_lost=None, unreachable="RayActorError")
    assert (gone.kind, gone.reason) == (K.INFRA_LOST, "a worker is unreachable (RayActorError)")


ABSL_ABORT = """:job_id:01000000
:actor_name:HostWorker
INFO workers.host: step 3/20 loss 5.1
F1125 12:00:00.000000 1234 pjrt_client.cc:77] Check failed: buffer != nullptr (0 vs. 1)
*** SIGABRT received at time=1795609409 on cpu 0 ***
PC: @     0x7f4d6b4a8eec  (unknown)  (unknown)
[2026-11-25 12:23:29,461 E 21004 21192] logging.cc:474: *** SIGABRT received at time=1795609409 on cpu 0 ***
Fatal Python error: Aborted

Stack (most recent call first):
  File "/srv/train.py", line 12 in main
"""


@pytest.mark.parametrize("tail, says", [
    (ABSL_ABORT, "SIGABRT: pjrt_client.cc:77] Check failed: buffer != nullptr (0 vs. 1)"),
    ("*** SIGSEGV received at time=1 on cpu 1 ***\nFatal Python error: Segmentation fault\n",
     "SIGSEGV: Fatal Python error: Segmentation fault"),
    ("terminate called after throwing an instance of 'std::bad_alloc'\n  what():  std::bad_alloc\n",
     "terminate called after throwing an instance of 'std::bad_alloc'"),
    (":job_id:01000000\n:actor_name:HostWorker\nWARNING: some earlier warning\n",
     "no native error on its stderr (killed from outside? SIGKILL, the OOM killer)"),
    (None, "no native error on its stderr (killed from outside? SIGKILL, the OOM killer)"),
])
def test_the_native_error_of_a_worker_that_died(tail, says):
    assert native_error(tail) == says


def test_an_import_error_handled_before_another_error_is_not_an_import_error():
    chain = [("ValueError", None, "bad batch"), ("ModuleNotFoundError", None, "No module named 'wandb'")]
    assert failure_cause(chain) is FailureCause.ERROR


GLOO_ABORT = """:job_id:01000000
:actor_name:HostWorker
INFO workers.host: step 7/40 loss 4.9
terminate called after throwing an instance of 'gloo::EnforceNotMet'
  what():  [enforce fail at external/gloo/gloo/transport/tcp/pair.cc:459] op.preamble.length <= op.nbytes. 256 vs 64. \
Received data size doesn't match expected size. Is there a distributed collective mismatch
*** SIGABRT received at time=1795609409 on cpu 1 ***
PC: @     0x7f4d6b4a8eec  (unknown)  (unknown)
Fatal Python error: Aborted

""" + "".join(f'Thread 0x{i:04x} (most recent call first):\n  File "/srv/x.py", line {i} in run\n'
              for i in range(40))


def test_a_gloo_abort_says_what_gloo_said():
    """The one line names gloo's enforce failure (not "Fatal Python error: Aborted"), and the lines kept
    for the job's log hold it although Python's dump of 40 threads' stacks comes after it."""
    assert native_error(GLOO_ABORT) == (
        "SIGABRT: [enforce fail at external/gloo/gloo/transport/tcp/pair.cc:459] op.preamble.length <= op.nbytes. "
        "256 vs 64. Received data size doesn't match expected size. Is there a distributed collective mismatch")
    kept = telling_lines(GLOO_ABORT)
    assert any("256 vs 64" in ln for ln in kept) and "256 vs 64" not in "\n".join(native_lines(GLOO_ABORT)[-40:])
    assert kept[-1] == native_lines(GLOO_ABORT)[-1]


def test_a_cpp_exception_says_its_what():
    tail = ("terminate called after throwing an instance of 'std::runtime_error'\n  what():  bad collective\n"
            "*** SIGABRT received at time=1 on cpu 0 ***\nFatal Python error: Aborted\n")
    assert native_error(tail) == ("SIGABRT: terminate called after throwing an instance of 'std::runtime_error': "
                                  "bad collective")


def test_the_tail_read_on_the_host_keeps_what_gloo_said_before_a_long_thread_dump(tmp_path, monkeypatch):
    """A Ray worker's fatal-error dump of its threads can be longer than the tail: the lines that say what
    happened are kept from before it, so the job's status and log still name gloo's failure."""
    from workers import crash

    dump = "".join(f'Thread 0x{i:04x} (most recent call first):\n  File "/srv/x.py", line {i} in run\n'
                   for i in range(2000))
    assert len(dump) > crash.TAIL_BYTES
    err = tmp_path / "worker-abc-01000000-4242.err"
    err.write_text(GLOO_ABORT + dump)
    monkeypatch.setattr(crash.os, "readlink", lambda path: str(tmp_path / "python-core-worker.log"))
    tail = crash.stderr_tail(4242)
    assert tail is not None and tail.endswith(dump[-crash.TAIL_BYTES:])
    assert native_error(tail).startswith("SIGABRT: [enforce fail at external/gloo/gloo/transport/tcp/pair.cc:459]")
    assert native_error((GLOO_ABORT + dump)[-crash.TAIL_BYTES:]) == "no native error on its stderr (killed from " \
        "outside? SIGKILL, the OOM killer)"  # what the tail alone said
    assert crash.stderr_tail(999) is None
