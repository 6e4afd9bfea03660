"""`orchestrator profile` on running local multi-host jobs (issue: profile a running job).

Every chosen host starts `jax.profiler` at the same agreed step and traces exactly N
steps; each trace lands beside the job's checkpoints, one folder per host, and reads back
(the train step's operations are in it, on every device); the summary's step time agrees
with the job's own; and the run's losses are those of an undisturbed run.
"""

from __future__ import annotations

import gzip
import json
import statistics
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from orchestrator import JobSpec, JobState
from orchestrator.errors import JobStateError
from orchestrator.observe.profile_summary import summarize
from orchestrator.observe.report import report_series
from tests.conftest import REPO, assert_losses_close, run_reference
from tests.integration.test_local_jobs import losses, tiny_spec

STEPS = 4

try:
    from xprof.convert import raw_to_tool_data  # the test extras have it
except ImportError:
    raw_to_tool_data = None


def wait_running(job, step: int, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = job.status()
        assert not st.done, (st.reason, job.logs()[-2000:])
        if st.state is JobState.RUNNING and st.step >= step:
            return
        time.sleep(0.1)
    raise AssertionError(f"{job.id} did not reach step {step}")


def profile_running(client, job, step: int, **kw):
    """A capture of `job` once it runs at `step`; asked again if a restart began meanwhile (a busy machine)."""
    deadline = time.monotonic() + 300
    while True:
        wait_running(job, step)
        try:
            return client.profile(job.id, timeout_s=180, **kw)
        except JobStateError:  # "starting": the attempt ended between the look and the ask
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def train_step_executions(trace_file: str, program: str) -> dict[str, set]:
    """device -> run ids of `program`'s executions in one host's trace (read as JSON, as Perfetto does)."""
    with gzip.open(trace_file) as f:
        events = json.load(f)["traceEvents"]
    runs: dict[str, set] = defaultdict(set)
    for e in events:
        args = e.get("args") or {}
        if args.get("hlo_module") == program and "hlo_op" in args:
            runs[args["device_ordinal"]].add(args["run_id"])
    return runs


def user_spec(tmp_path: Path) -> JobSpec:
    """The user example (its own model and step, under the training API) on 2 hosts, on bytes."""
    return JobSpec.from_dict({
        "name": "prof-user", "accelerator": "v4-16", "workdir": str(REPO / "examples" / "user-train"),
        "workload": {"type": "entrypoint", "entrypoint": "train:main", "steps": 40, "seq_len": 32,
                     "global_batch_size": 16, "args": {"d_model": 64, "n_layers": 1, "n_heads": 4, "warmup_steps": 2}},
        "checkpoint": {"interval_steps": 20, "directory": str(tmp_path / "ckpt-user")},
        "recovery": {"start_timeout_s": 180}})


def test_profile_running_two_host_jobs(client, tmp_path):
    """The built-in trainer on both hosts; a user's program on one of its two, with a memory profile.

    The two jobs run at once (their start-ups overlap); each capture is compared with its own job.
    """
    spec = tiny_spec("prof", "v4-16", tmp_path, steps=40, interval=20)  # no save among the steps traced
    job = client.submit(spec)
    user_job = client.submit(user_spec(tmp_path))
    with ThreadPoolExecutor(2) as pool:  # both at once: each job runs on while the other's capture is taken
        builtin = pool.submit(profile_running, client, job, 4, steps=STEPS)
        user = pool.submit(profile_running, client, user_job, 3, steps=2, host=1, memory=True)
        capture, user_capture = builtin.result(), user.result()
    for j in (job, user_job):
        st = j.wait(timeout_s=420)
        assert st.state is JobState.SUCCEEDED, (st.reason, j.logs()[-2000:])

    # One trace per host, beside the checkpoints, of exactly STEPS steps from the same step.
    assert capture.steps == STEPS and capture.hosts == (0, 1) and capture.error is None
    assert capture.path == f"{spec.checkpoint.directory}/profiles/{capture.capture_id}"
    assert [t.host for t in capture.traces] == [0, 1]
    for t in capture.traces:
        assert t.folder == f"{capture.path}/host-{t.host}" and t.xplane and t.perfetto, t
        meta = json.loads((Path(t.folder) / "capture.json").read_text())
        assert (meta["first_step"], meta["steps"]) == (capture.first_step, STEPS)
        # The train step's operations on each of the host's 4 devices, STEPS executions each.
        runs = train_step_executions(t.trace, "jit__step")
        assert len(runs) == 4 and {len(r) for r in runs.values()} == {STEPS}, runs
        s = t.summary
        assert (s.program, s.devices, s.executions) == ("jit__step", 4, STEPS)
        if raw_to_tool_data is not None:  # as TensorBoard's profile plugin and XProf read it
            data, _ = raw_to_tool_data.xspace_to_tool_data([t.xplane], "trace_viewer", {})
            assert summarize(json.loads(data)).executions == STEPS
        assert abs(s.compute + s.collectives + s.idle - 1) < 1e-6 and s.compute > 0 and s.collectives > 0
        assert any(op.kind == "collective" for op in s.top_ops)  # the gradients' all-reduce across hosts
        assert t.memory and all(d["device"].startswith("cpu:") for d in t.memory)  # CPU keeps no byte counts

    # The summary's step time is the job's own over the same steps: the traced ones but the last, whose
    # time holds stopping the profiler (the summary's spans the traced executions' starts).
    metrics = {m.step: m.step_time_s for m in job.metrics()}
    own = statistics.fmean(metrics[k] for k in range(capture.first_step, capture.first_step + STEPS - 1))
    for t in capture.traces:
        assert abs(t.summary.step_time_s - own) <= 0.2 * own, (t.summary.step_time_s, own)

    # Tracing changed nothing the steps computed.
    ref = run_reference(spec, devices=spec.tpu_type.chips, tmp_path=tmp_path)
    assert_losses_close(losses(job), ref["losses"], rtol=1e-5)

    # One event, and a mark in the report.
    (event,) = [e for e in job.events() if e.kind == "profile"]
    assert event.payload.capture == capture.capture_id and event.payload.first_step == capture.first_step
    assert any(m.kind == "profile" for m in report_series(client.store, job.id).markers)
    with pytest.raises(JobStateError, match=f"job {job.id} is SUCCEEDED; only a RUNNING job can be profiled"):
        client.profile(job.id)

    # The user's program: host 1 alone traced its own train step; host 0 only voted.
    assert (user_capture.hosts, user_capture.steps, [t.host for t in user_capture.traces]) == ((1,), 2, [1])
    (t,) = user_capture.traces
    assert sorted(p.name for p in Path(user_capture.path).iterdir()) == ["host-1"]
    assert (t.summary.program, t.summary.executions) == ("jit_train_step", 2)
    assert t.memory_profile and Path(t.memory_profile).stat().st_size > 0
