"""The profile summary read from a trace, on hand-made traces with known answers (a real capture:
tests/numerics/test_profile_capture.py)."""

from __future__ import annotations

import pytest

from orchestrator.observe.profile_summary import op_kind, summarize


@pytest.mark.parametrize("name,kind", [
    ("all-reduce.52", "collective"), ("all-reduce-start", "collective"), ("all-gather", "collective"),
    ("reduce-scatter.3", "collective"), ("send-done.1", "collective"), ("%collective-permute.4", "collective"),
    ("all-to-all.2", "collective"), ("reduce.3", "compute"), ("reduce-window", "compute"), ("fusion.12", "compute"),
    ("ynn_fusion.33", "compute"), ("sender_fusion", "compute"), ("while.208", "compute")])
def test_op_kinds_by_name(name, kind):
    assert op_kind(name) == kind


def test_op_kind_by_the_traces_category():
    assert op_kind("fusion.3", "all-reduce") == "collective"
    assert op_kind("fusion.3", "convolution fusion") == "compute"


def _meta(pid, name, threads):
    out = [{"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}}]
    out += [{"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": t}}
            for tid, t in threads.items()]
    return out


def _cpu_op(tid, ts, dur, op, run, module="jit_step", device="0"):
    return {"ph": "X", "pid": 1, "tid": tid, "ts": ts, "dur": dur, "name": op,
            "args": {"hlo_op": op, "hlo_module": module, "run_id": str(run), "device_ordinal": device}}


def cpu_trace() -> dict:
    """Two executions of jit_step on CPU device 0, 200 us apart; each: a fusion, a while holding a fusion,
    an all-reduce half hidden by an op on another thread; and a small program between them."""
    events = _meta(1, "/host:CPU", {10: "tf_XLAPjRtCpuClient/1", 11: "tf_XLAEigen/2", 12: "python"})
    for run, t0 in ((1, 0.0), (2, 200.0)):
        events += [_cpu_op(10, t0, 40, "fusion.1", run), _cpu_op(10, t0 + 40, 40, "while.1", run),
                   _cpu_op(10, t0 + 50, 20, "fusion.2", run), _cpu_op(10, t0 + 80, 20, "all-reduce.1", run),
                   {"ph": "X", "pid": 1, "tid": 10, "ts": t0 + 81, "dur": 5, "name": "Rendezvous"}]  # no op
    events.append(_cpu_op(11, 85, 10, "fusion.3", 1))  # beside the first all-reduce
    events.append(_cpu_op(11, 150, 5, "copy.1", 3, module="jit_small"))
    events.append({"ph": "X", "pid": 1, "tid": 12, "ts": 0, "dur": 190, "name": "train", "args": {"step_num": "4"}})
    return {"traceEvents": events}


def test_a_cpu_trace_by_hand():
    s = summarize(cpu_trace())
    assert (s.program, s.devices, s.executions) == ("jit_step", 1, 2)
    assert s.step_time_s == pytest.approx(200e-6)
    # Over [0, 300] us: compute 80 + 80 per run (the while's own 20 included), the other thread's fusion (10,
    # over the all-reduce) and the small program (5); the all-reduces' 40 less the 10 hidden; idle the rest.
    assert s.compute == pytest.approx(175 / 300)
    assert s.collectives == pytest.approx(30 / 300)
    assert s.idle == pytest.approx(95 / 300)
    ops = {op.name: op for op in s.top_ops}
    assert s.top_ops[0].name == "fusion.1" and ops["fusion.1"].self_s == pytest.approx(80e-6)
    assert ops["fusion.1"].per_step_s == pytest.approx(40e-6) and ops["fusion.1"].count == 2
    assert ops["while.1"].self_s == pytest.approx(40e-6)  # 80 us long, 40 of them in its body
    assert ops["all-reduce.1"].kind == "collective" and ops["all-reduce.1"].self_s == pytest.approx(40e-6)
    assert sum(op.share for op in s.top_ops) == pytest.approx(1.0)
    assert s.programs == {"jit_step": 2, "jit_small": 1}


def test_a_tpu_trace_by_hand():
    """TPU: ops on each device's "XLA Ops" line, executions on its "XLA Modules" line."""
    events = []
    for pid in (5, 6):
        events += _meta(pid, f"/device:TPU:{pid - 5}", {1: "Steps", 2: "XLA Modules", 3: "XLA Ops"})
        for t0 in (0.0, 120.0):
            events += [{"ph": "X", "pid": pid, "tid": 2, "ts": t0, "dur": 100, "name": "jit_train_step(7)"},
                       {"ph": "X", "pid": pid, "tid": 3, "ts": t0, "dur": 60, "name": "fusion.1"},
                       {"ph": "X", "pid": pid, "tid": 3, "ts": t0 + 60, "dur": 30, "name": "all-gather.2"}]
    events += _meta(9, "/host:CPU", {1: "python"})
    events.append({"ph": "X", "pid": 9, "tid": 1, "ts": 0, "dur": 5, "name": "fusion.1",
                   "args": {"hlo_op": "fusion.1"}})  # no module: not a device's op
    s = summarize({"traceEvents": events})
    assert (s.program, s.devices, s.executions) == ("jit_train_step", 2, 2)
    assert s.step_time_s == pytest.approx(120e-6)
    assert (s.compute, s.collectives, s.idle) == pytest.approx((120 / 220, 60 / 220, 40 / 220))
    assert [(op.name, op.kind, op.count) for op in s.top_ops] == [("fusion.1", "compute", 4),
                                                                  ("all-gather.2", "collective", 4)]
    assert s.top_ops[0].per_step_s == pytest.approx(60e-6)


def test_a_trace_without_ops():
    s = summarize({"traceEvents": [{"ph": "X", "pid": 1, "tid": 1, "ts": 0, "dur": 5, "name": "python"}]})
    assert (s.program, s.executions, s.step_time_s) == (None, 0, None)


def test_what_the_cli_prints_fits_80_columns_but_for_paths():
    from orchestrator.user.capture import Capture, HostTrace, render

    s = summarize(cpu_trace())
    path = "/a/rather/long/checkpoint/folder/of/a/job/profiles/20261125-131331-41b8"
    cpu = HostTrace(0, f"{path}/host-0", perfetto=f"{path}/host-0/plugins/profile/r/perfetto_trace.json.gz",
                    memory=({"device": "cpu:0"}, {"device": "cpu:1"}), summary=s)
    tpu = HostTrace(1, f"{path}/host-1", memory=({"device": "tpu:4", "bytes_in_use": 3 << 30,
                                                  "peak_bytes_in_use": 5 << 30, "bytes_limit": 16 << 30},
                                                 {"device": "tpu:5", "bytes_in_use": 1 << 30}),
                    summary=s, memory_profile=f"{path}/host-1/memory.prof")
    lines = render(Capture("tiny-abc123", "20261125-131331-41b8", path, (0, 1), 6, 2, 3, None, (cpu, tpu)))
    text = "\n".join(lines)
    assert lines[0] == "profiled tiny-abc123: steps 6-7 (2 of 3 asked) on hosts 0, 1"
    assert f"tensorboard --logdir {path}" in text and f"xprof --logdir {path}" in text and cpu.perfetto in text
    assert "     0  jit_step              2   200.0 us      58%          10%    32%" in lines
    assert "    40.0 us   37.2%  fusion.1                                  compute" in lines
    assert "  host 0: not reported on CPU" in lines
    assert "  host 1: 4.00 GiB in use, peak 5.00 GiB, of 16.00 GiB (2 devices)" in lines
    assert all(len(line) <= 80 for line in lines if path not in line), [x for x in lines if len(x) > 80]
