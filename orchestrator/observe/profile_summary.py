"""What a profile capture says without a viewer: step time, where the devices' time went, the top operations.

Read from the Chrome/Perfetto trace JSON that `jax.profiler` writes beside its
``.xplane.pb`` (``host-<k>/plugins/profile/<run>/<host>.trace.json.gz``), one per host.

Which events are XLA operations ("ops"), by backend:

- TPU: the events on a device process's "XLA Ops" line ("/device:TPU:0"); the enclosing
  event on that device's "XLA Modules" line is one execution of its program.
- CPU (and a GPU's kernel events): the events whose args name an ``hlo_op`` and an
  ``hlo_module``; ``run_id`` groups one execution, ``device_ordinal`` names the device. On
  CPU a "device" is no chip but the host's XLA CPU threads (the PjRt client's and Eigen's)
  that run that device's ops, several at once.

Ops on one thread nest (a ``while`` holds its body's ops): an op's self time leaves out the
ops inside it, and at any moment a thread is in its innermost op.

The train step is the program with the most distinct ops in the capture (then the most op
time): a forward pass, its gradient and an update are far more ops than the small programs
around them (the loop's vote among hosts, a conversion), which may take longer (an all-gather
waiting for a late host) but have a handful of ops. Its step time is the
time from the first execution's start to the last one's on one device, per step between
them: the wall time a step took over the steps traced, as the job's own step times measure
it (each from one step's result to the next one's). Where the trace does not tell
executions apart, the loop's step annotations say it; with one step traced, it is that
execution's length.

Where a device's time went, over the span from the train step's first execution start to
its last one's end:

- compute: some op that is not a collective runs, on any of the device's threads;
- collectives: only collectives run (all-reduce, all-gather, reduce-scatter, all-to-all,
  collective-permute, collective-broadcast, send, recv, and their -start/-done halves).
  On CPU that includes waiting for the other devices and hosts to arrive. A collective
  that overlaps compute is hidden behind it and counts as compute;
- idle: no op runs (the host is late dispatching the step: the input pipeline, a save,
  the loop's own work).

The shares are the mean over the host's devices. Top ops are ranked by self time summed
over devices and executions, shown as time per step on one device and as a share of all
op self time.
"""

from __future__ import annotations

import bisect
import gzip
import json
import re
import statistics
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

COLLECTIVE = re.compile(r"^%?(all-reduce|all-gather|reduce-scatter|ragged-all-to-all|all-to-all|collective-permute|"
                        r"collective-broadcast|send|recv)([-_.]|$)")
TOP_OPS = 8


def op_kind(name: str, category: str | None = None) -> str:
    """"collective" or "compute", from the HLO instruction's name (or the trace's category for it)."""
    if COLLECTIVE.match(name.lower()) or (category and COLLECTIVE.match(category.lower())):
        return "collective"
    return "compute"


@dataclass(frozen=True)
class OpStat:
    name: str
    kind: str  # compute | collective
    program: str
    self_s: float  # summed over devices and executions
    per_step_s: float  # on one device, in one step
    share: float  # of all op self time in the capture
    count: int  # executions of it, over devices and steps


@dataclass(frozen=True)
class TraceSummary:
    program: str | None  # the train step's program, e.g. jit__step or jit_train_step
    devices: int  # devices that ran it
    executions: int  # of the train step on one device: the steps in the trace
    step_time_s: float | None
    compute: float  # shares of the train steps' span, mean over devices
    collectives: float
    idle: float
    top_ops: tuple[OpStat, ...] = ()
    programs: dict[str, int] = field(default_factory=dict)  # each program's executions on one device

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class _Op:
    device: Any
    thread: Any
    ts: float  # microseconds, as in the trace
    end: float
    name: str
    kind: str
    program: str | None
    run: Any


def summarize(trace: dict) -> TraceSummary:
    """The summary of one host's trace (the parsed JSON of its ``.trace.json.gz``)."""
    ops, executions = _ops_and_executions(trace.get("traceEvents") or [])
    if not ops:
        return TraceSummary(None, 0, 0, None, 0.0, 0.0, 0.0)
    segments = _self_segments(ops)  # (op, start, end): where each thread's innermost op runs
    self_time: dict[tuple, float] = defaultdict(float)
    count: dict[tuple, int] = defaultdict(int)
    for op, a, b in segments:
        key = (op.program or "?", op.name, op.kind)
        self_time[key] += b - a
    for op in ops:
        count[(op.program or "?", op.name, op.kind)] += 1
    by_program: dict[str, float] = defaultdict(float)
    distinct: dict[str, int] = defaultdict(int)
    for (program, _, _), t in self_time.items():
        by_program[program] += t
        distinct[program] += 1
    train = max(by_program, key=lambda p: (distinct[p], by_program[p]))

    runs = executions.get(train, {})  # device -> [(start, end)], sorted
    devices = sorted(runs, key=lambda d: (-len(runs[d]), str(d)))
    ref = runs[devices[0]] if devices else []
    step_us = None
    if len(ref) >= 2:
        step_us = (ref[-1][0] - ref[0][0]) / (len(ref) - 1)
    elif len(markers := _step_markers(trace.get("traceEvents") or [])) >= 2:  # executions without run ids
        step_us = statistics.fmean(markers)
    elif ref:
        step_us = ref[0][1] - ref[0][0]

    shares = [_shares(segments, d, runs[d][0][0], runs[d][-1][1]) for d in devices if runs[d][-1][1] > runs[d][0][0]]
    compute, collectives, idle = (statistics.fmean(s[i] for s in shares) if shares else 0.0 for i in range(3))

    total = sum(self_time.values()) or 1.0
    steps = max(len(ref), 1)
    n_devices = max(len(devices), 1)
    top = sorted(self_time.items(), key=lambda kv: -kv[1])[:TOP_OPS]
    top_ops = tuple(OpStat(name, kind, program, t / 1e6, t / 1e6 / n_devices / steps, t / total,
                           count[(program, name, kind)])
                    for (program, name, kind), t in top)
    programs = {p: max((len(v) for v in execs.values()), default=0) for p, execs in executions.items()}
    return TraceSummary(train, len(devices), len(ref), step_us / 1e6 if step_us is not None else None,
                        compute, collectives, idle, top_ops, programs)


def read_trace(path: str) -> dict:
    """A ``.trace.json.gz`` (or plain ``.json``) file, local or at a URL (gs://...)."""
    from workers import storage

    raw = storage.read_bytes(path)
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    return json.loads(raw)


# -- reading the trace -----------------------------------------------------------------------


_Executions = dict[str, dict[Any, list[tuple[float, float]]]]  # program -> device -> its runs' (start, end)
_Modules = dict[Any, list[tuple[float, float, str]]]  # device -> its XLA Modules events (start, end, program)


def _ops_and_executions(events: list[dict]) -> tuple[list[_Op], _Executions]:
    ops, modules = _read_ops(events, *_op_lines(events))
    _place_in_modules(ops, modules)
    return ops, _executions(ops, modules)


def _op_lines(events: list[dict]) -> tuple[dict[tuple, str], set[Any]]:
    """The threads' names, and the devices (processes) whose ops come on an "XLA Ops" line of their own."""
    processes: dict[Any, str] = {}
    threads: dict[tuple, str] = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            processes[e.get("pid")] = (e.get("args") or {}).get("name", "")
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e.get("pid"), e.get("tid"))] = (e.get("args") or {}).get("name", "")
    with_op_lines = {pid for (pid, _), name in threads.items()
                     if name == "XLA Ops" and processes.get(pid, "").startswith("/device:")}
    return threads, with_op_lines


def _read_ops(events: list[dict], threads: dict[tuple, str], with_op_lines: set[Any]) -> tuple[list[_Op], _Modules]:
    """The ops of the trace's complete events, and each device's module executions (TPU traces have them)."""
    ops: list[_Op] = []
    modules: _Modules = defaultdict(list)
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        pid, tid, args = e.get("pid"), e.get("tid"), e.get("args") or {}
        ts, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        if pid in with_op_lines:
            line = threads.get((pid, tid))
            if line == "XLA Ops":
                name = str(e.get("name", "?"))
                ops.append(_Op(pid, tid, ts, end, name, op_kind(name, args.get("hlo_category")),
                               args.get("hlo_module"), args.get("run_id")))
            elif line == "XLA Modules":
                modules[pid].append((ts, end, _program_name(str(e.get("name", "?")))))
        elif "hlo_op" in args and "hlo_module" in args:
            name = str(args["hlo_op"])
            ops.append(_Op((pid, args.get("device_ordinal")), (pid, tid), ts, end, name,
                           op_kind(name, args.get("hlo_category")), str(args["hlo_module"]), args.get("run_id")))
    return ops, modules


def _place_in_modules(ops: list[_Op], modules: _Modules) -> None:
    """TPU: an op with no program of its own belongs to the module execution around it (sets program and run)."""
    for device, mods in modules.items():
        mods.sort()
        starts = [m[0] for m in mods]
        for op in ops:
            if op.device == device and op.program is None:
                i = bisect.bisect_right(starts, op.ts) - 1
                if i >= 0 and op.ts <= mods[i][1]:
                    op.program, op.run = mods[i][2], i


def _executions(ops: list[_Op], modules: _Modules) -> _Executions:
    """Each program's runs per device: the module events where there are some, else the span of each run's ops."""
    executions: _Executions = defaultdict(dict)
    if modules:
        for device, mods in modules.items():
            for ts, end, program in mods:
                executions[program].setdefault(device, []).append((ts, end))
    else:
        spans: dict[tuple, list[float]] = {}
        for op in ops:
            key = (op.program, op.device, op.run if op.run is not None else id(op))
            span = spans.setdefault(key, [op.ts, op.end])
            span[0], span[1] = min(span[0], op.ts), max(span[1], op.end)
        for (program, device, _), (ts, end) in spans.items():
            executions[program].setdefault(device, []).append((ts, end))
    for per_device in executions.values():
        for runs in per_device.values():
            runs.sort()
    return executions


def _step_markers(events: list[dict]) -> list[float]:
    """The lengths of the training loop's step annotations (`workers.api.Loop` marks each traced step)."""
    return [float(e["dur"]) for e in events
            if e.get("ph") == "X" and e.get("name") == "train" and "step_num" in (e.get("args") or {})]


def _program_name(module_event: str) -> str:
    """``jit_train_step(123)`` -> ``jit_train_step``."""
    return re.sub(r"\(\d+\)$", "", module_event)


def _self_segments(ops: list[_Op]) -> list[tuple[_Op, float, float]]:
    """Each thread's time split among its innermost ops: (op, start, end) pieces."""
    by_thread: dict[Any, list[_Op]] = defaultdict(list)
    for op in ops:
        by_thread[(op.device, op.thread)].append(op)
    return [segment for thread_ops in by_thread.values() for segment in _thread_segments(thread_ops)]


def _thread_segments(thread_ops: list[_Op]) -> list[tuple[_Op, float, float]]:
    """One thread's time split among its innermost ops, walking its ops as a stack of open ones."""
    thread_ops.sort(key=lambda o: (o.ts, -o.end))
    out: list[tuple[_Op, float, float]] = []
    stack: list[_Op] = []
    cursor = 0.0

    def pop_until(t: float) -> None:
        nonlocal cursor
        while stack and stack[-1].end <= t:
            top = stack.pop()
            if top.end > cursor:
                out.append((top, cursor, top.end))
            cursor = max(cursor, top.end)

    for op in thread_ops:
        pop_until(op.ts)
        if stack and op.ts > cursor:
            out.append((stack[-1], cursor, op.ts))
        if stack:
            op.end = min(op.end, stack[-1].end)  # a child ends with its parent (clock jitter)
        stack.append(op)
        cursor = max(cursor, op.ts)
    pop_until(float("inf"))
    return out


def _shares(segments: list[tuple[_Op, float, float]], device: Any, start: float,
            end: float) -> tuple[float, float, float]:
    """(compute, collectives, idle) shares of [start, end] on `device`."""
    compute: list[tuple[float, float]] = []
    collective: list[tuple[float, float]] = []
    for op, a, b in segments:
        if op.device != device:
            continue
        a, b = max(a, start), min(b, end)
        if b > a:
            (collective if op.kind == "collective" else compute).append((a, b))
    span = end - start
    c = _union_length(compute)
    busy = _union_length(compute + collective)
    return c / span, (busy - c) / span, 1.0 - busy / span


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, reach = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= reach:
            continue
        total += b - max(a, reach)
        reach = b
    return total
