"""`orchestrator profile` on the client's side: ask for a capture, wait for its event, read the traces back.

`Client.profile` asks the controller (`Controller.profile`), which has every host of the
running job agree on a step and trace from there (`workers.profiling`); the capture ends as
a `Profiled` event in the store, which this module waits for. The traces are then read
where the hosts wrote them, beside the job's checkpoints::

    <checkpoint dir>/profiles/<capture id>/host-<k>/
        plugins/profile/<run>/<host>.xplane.pb        TensorBoard's profile plugin, XProf
        plugins/profile/<run>/<host>.trace.json.gz    the trace viewer's JSON (read for the summary)
        plugins/profile/<run>/perfetto_trace.json.gz  Perfetto (ui.perfetto.dev)
        capture.json                                  steps traced, each device's memory
        memory.prof                                   with --memory: pprof of device memory
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, replace

from orchestrator import cluster
from orchestrator.errors import CaptureError, ClusterError, JobStateError, ProfileError
from orchestrator.observe.profile_summary import TraceSummary, read_trace, summarize
from orchestrator.state.events import EventKind, Profiled
from orchestrator.state.states import JobState
from orchestrator.user.job import CLUSTER_GONE, JobsClient

MAX_STEPS = 100  # as the controller's (orchestrator.control.captures)
GIB = 1024 ** 3


@dataclass(frozen=True)
class HostTrace:
    """What one host's folder of a capture holds."""

    host: int
    folder: str
    xplane: str | None = None  # TensorBoard / XProf
    trace: str | None = None  # the trace viewer's JSON, .trace.json.gz
    perfetto: str | None = None  # Perfetto's JSON
    memory: tuple[dict, ...] = ()  # per device at the capture's end (capture.json)
    memory_profile: str | None = None
    summary: TraceSummary | None = None
    error: str | None = None  # why it could not be read


@dataclass(frozen=True)
class Capture:
    job_id: str
    capture_id: str
    path: str | None  # <checkpoint dir>/profiles/<capture id>
    hosts: tuple[int, ...]  # the hosts asked to trace
    first_step: int | None  # numbered as the job's metrics
    steps: int
    steps_asked: int
    error: str | None  # a host that failed while others traced
    traces: tuple[HostTrace, ...] = ()

    def to_dict(self) -> dict:
        return asdict(self)


def check_request(client: JobsClient, job_id: str, steps: int, host: int | None):
    """The job's record if a capture can be asked of it: RUNNING, `steps` in range, `host` one of its hosts."""
    job = client.store.find_job(job_id)
    if job.state is not JobState.RUNNING:
        raise JobStateError(job.id, job.state.value, "profiled", (JobState.RUNNING.value,))
    if not 1 <= steps <= MAX_STEPS:
        raise ProfileError(f"--steps must be 1 to {MAX_STEPS}, got {steps}")
    hosts = job.spec.tpu_type.hosts
    if host is not None and not 0 <= host < hosts:
        raise ProfileError(f"--host {host}: job {job.id} runs on {hosts} host{'s' if hosts > 1 else ''} "
                           f"(0{f' to {hosts - 1}' if hosts > 1 else ''}), or use --host all")
    if client.address is None and cluster.read_cluster(client.home) is None:
        raise ClusterError(f"job {job.id}: {CLUSTER_GONE}")
    return job


def profile(client: JobsClient, job_id: str, *, steps: int, host: int | None, memory: bool, timeout_s: float,
            read: bool = True) -> Capture:
    job = check_request(client, job_id, steps, host)
    seen = max((e.seq for e in client.store.events(job.id)), default=0)
    asked = client._ask("profile", job.id, steps, host, memory)
    capture_id = asked["capture"]
    deadline = time.monotonic() + timeout_s
    ended_at = None
    while True:
        for e in client.store.events(job.id, after_seq=seen, kind=EventKind.PROFILE):
            p = e.payload_as(Profiled)
            if p.capture == capture_id:
                return _capture(job.id, capture_id, p, read=read)
        now = time.monotonic()
        if client.store.job(job.id).state.terminal:
            ended_at = ended_at or now  # its driver records the capture's end as the job ends
            if now - ended_at > 15:
                raise CaptureError(f"job {job.id} ended before capture {capture_id} did")
        if now > deadline:
            why = (f"no word of capture {capture_id} from every host within {timeout_s:g} s (a program that runs "
                   "its own loop instead of ctx.loop cannot be profiled)")
            client._ask("profile_abandon", job.id, capture_id, why)
            raise CaptureError(f"job {job.id}: {why}")
        time.sleep(0.2)


def _capture(job_id: str, capture_id: str, p: Profiled, *, read: bool) -> Capture:
    if not p.path:
        raise CaptureError(f"capture {capture_id} of job {job_id} failed: {p.error or 'no host traced'}")
    traced = [h for h in (p.hosts or []) if str(h) in (p.memory or {})]
    from workers import storage

    traces = tuple(read_host(storage.join(p.path, f"host-{h}"), h, summary=read) for h in traced)
    return Capture(job_id, capture_id, p.path, tuple(p.hosts or ()), p.first_step, p.steps or 0,
                   p.steps_asked or 0, p.error, traces)


def read_host(folder: str, host: int, *, summary: bool = True) -> HostTrace:
    """One host's folder of a capture (a path or a URL), and the summary of its trace."""
    from workers import storage

    runs = storage.join(folder, "plugins", "profile")
    try:
        files = [storage.join(runs, run, name) for run in (storage.listdir(runs) if storage.isdir(runs) else [])
                 for name in storage.listdir(storage.join(runs, run))]
        meta_file = storage.join(folder, "capture.json")
        meta = json.loads(storage.read_text(meta_file)) if storage.exists(meta_file) else {}
    except (OSError, ValueError) as e:
        return HostTrace(host, folder, error=f"cannot read {folder}: {e}")

    def last(suffix: str, exclude: str | None = None) -> str | None:
        found = [f for f in files if f.endswith(suffix) and not (exclude and f.rsplit("/", 1)[-1].startswith(exclude))]
        return found[-1] if found else None

    trace = last(".trace.json.gz", exclude="perfetto")
    out = HostTrace(host, folder, xplane=last(".xplane.pb"), trace=trace, perfetto=last("perfetto_trace.json.gz"),
                    memory=tuple(meta.get("memory") or ()),
                    memory_profile=storage.join(folder, meta["memory_profile"]) if meta.get("memory_profile") else None)
    if not summary:
        return out
    if trace is None:
        return replace(out, error=f"no .trace.json.gz in {folder}")
    try:
        return replace(out, summary=summarize(read_trace(trace)))
    except (OSError, ValueError) as e:
        return replace(out, error=f"cannot read {trace}: {e}")


# -- the CLI's lines (80 columns) ---------------------------------------------------------------


def render(c: Capture) -> list[str]:
    """Where the capture is, how to open it, what it says."""
    hosts = ", ".join(str(t.host) for t in c.traces)
    last = c.first_step + c.steps - 1 if c.first_step is not None else None
    lines = [f"profiled {c.job_id}: steps {c.first_step}-{last} ({c.steps} of {c.steps_asked} asked) "
             f"on host{'s' if len(c.traces) > 1 else ''} {hosts}",
             f"capture {c.capture_id} in", f"  {c.path}"]
    if c.error:
        lines.append(f"warning: {c.error}")
    one = c.traces[0] if c.traces else None
    lines += ["open it:",
              "  TensorBoard (Profile tab; pip install tensorboard tensorboard-plugin-profile):",
              f"    tensorboard --logdir {c.path}",
              "  XProf (pip install xprof):",
              f"    xprof --logdir {c.path}"]
    if one is not None and one.perfetto:
        lines += ["  Perfetto (trace view): open this file at https://ui.perfetto.dev",
                  f"    {one.perfetto}"]
    summaries = [t for t in c.traces if t.summary is not None and t.summary.program]
    if summaries:
        lines += ["summary (read from the traces; compute, collectives and idle are shares",
                  "of each device's time in the train step's span):",
                  "  host  program           steps  step time  compute  collectives   idle"]
        for t in summaries:
            s = t.summary
            assert s is not None and s.program, "summaries are the traces with a program's summary"
            lines.append(f"  {t.host:>4}  {_cut(s.program, 16):<16}  {s.executions:>5}  {_ms(s.step_time_s):>9}  "
                         f"{s.compute:>7.0%}  {s.collectives:>11.0%}  {s.idle:>5.0%}")
        hosts = " and ".join(str(t.host) for t in summaries) if len(summaries) < 3 else "all hosts"
        together = f", hosts {hosts} together" if len(summaries) > 1 else ""
        lines += [f"  top operations by self time (per step on one device{together};",
                  "  share of all op time):"]
        for op in top_ops(summaries):
            lines.append(f"  {_ms(op['per_step_s']):>9}  {op['share']:>6.1%}  {_cut(op['name'], 40):<40}  {op['kind']}")
    for t in c.traces:
        if t.error:
            lines.append(f"host {t.host}: {t.error}")
    lines.append("device memory at the capture's end:")
    for t in c.traces:
        lines.append(f"  host {t.host}: {memory_line(t.memory)}")
        if t.memory_profile:
            lines.append(f"    memory profile (pprof): {t.memory_profile}")
    return lines


def top_ops(traces: list[HostTrace], n: int = 8) -> list[dict]:
    """The top ops of several hosts' summaries together: per step on one device, share of all op time."""
    per_step: dict[tuple, float] = {}
    share: dict[tuple, float] = {}
    for t in traces:
        assert t.summary is not None, "given the traces with a summary"
        for op in t.summary.top_ops:
            key = (op.name, op.kind)
            per_step[key] = per_step.get(key, 0.0) + op.per_step_s / len(traces)
            share[key] = share.get(key, 0.0) + op.share / len(traces)
    ranked = sorted(per_step, key=lambda k: -per_step[k])[:n]
    return [{"name": k[0], "kind": k[1], "per_step_s": per_step[k], "share": share[k]} for k in ranked]


def memory_line(devices: tuple[dict, ...] | list[dict]) -> str:
    """A host's device memory in one line: in use and peak summed over its devices."""
    if not devices:
        return "not recorded"
    in_use = [d["bytes_in_use"] for d in devices if "bytes_in_use" in d]
    if not in_use:
        kinds = {str(d.get("device", "")).split(":")[0] for d in devices}
        return "not reported on CPU" if kinds == {"cpu"} else "not reported by this backend"
    peak = [d["peak_bytes_in_use"] for d in devices if "peak_bytes_in_use" in d]
    limit = [d["bytes_limit"] for d in devices if "bytes_limit" in d]
    line = f"{sum(in_use) / GIB:.2f} GiB in use"
    if peak:
        line += f", peak {sum(peak) / GIB:.2f} GiB"
    if limit:
        line += f", of {sum(limit) / GIB:.2f} GiB"
    return line + f" ({len(devices)} device{'s' if len(devices) > 1 else ''})"


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.1f} us"


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 1] + "…"
