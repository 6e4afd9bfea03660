"""Prometheus metrics of the jobs, read from the store on each scrape: a series per job for every job not
ended and the last `ENDED_KEPT` to end, and counts by state of all of them.

What a scrape keeps for the next is what the store cannot change: the goodput of jobs that
have ended, and the rows already read of the others (`_Rows`: events are only ever added,
and a step written again is a new row), so the numbers are those `orchestrator status`
shows and a restarted controller exports the same series. Reading every running job's rows
again on each scrape took 12 s at 1,000 jobs, beyond Prometheus's default 10 s timeout.
Each sample carries the job id as `job`; note that Prometheus renames a target's own `job`
label to `exported_job` unless the scrape config sets `honor_labels: true`.

Exported (all gauges unless marked as counters):

- orchestrator_jobs{state}: how many jobs of the store are in each state
- orchestrator_job_info{job,name,accelerator,tier} 1
- orchestrator_job_state{job,state} 1 for the job's state, 0 for every other state
- orchestrator_job_completed_steps{job}: steps done (the last reported step + 1)
- orchestrator_job_tokens_per_second{job}, orchestrator_job_loss{job}: of the last reported step
- orchestrator_job_mfu_ratio{job}, orchestrator_job_tflops_per_chip{job}, orchestrator_job_hbm_bytes{job,kind},
  orchestrator_job_metric{job,name} (the program's own, from `loop.done(state, loss=..., name=value)`): the same
- orchestrator_job_goodput_ratio{job}: productive time / wall time
- orchestrator_job_time_seconds{job,category}: wall time by goodput category
- orchestrator_job_cost_dollars_total{job,accelerator,tier} (counter)
- orchestrator_job_preemptions_total{job}, orchestrator_job_restarts_total{job} (counters)

And the store's health, from the controller's memory (the store cannot say it is not writable):

- orchestrator_store_writable 1, or 0 while writes are refused
- orchestrator_store_fault_info{cause,message} 1 while they are; orchestrator_store_fault_since_seconds
  (Unix time of the first refused write); orchestrator_store_writes_held (waiting to be written)

`read_store_fault(url)` reads these back (`status` and `logs` do).
"""

from __future__ import annotations

import ipaddress
import logging
import threading
import time
import urllib.request
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from orchestrator.errors import OrchestratorError
from orchestrator.observe.goodput import Goodput, compute_goodput, goodput
from orchestrator.state.states import JobState
from orchestrator.state.store import Event, JobRecord, StepMetric, Store

log = logging.getLogger(__name__)

ENDED_KEPT = 100  # ended jobs whose series a scrape still exports, the last to end (`_with_series`)


class RemoteMetricsRefused(OrchestratorError, ValueError):
    """Serving metrics on a non-loopback address was asked for without `allow_remote=True`."""

    def __init__(self, host: str):
        self.host = host
        super().__init__(f"refusing to serve metrics on {host!r}: job names, losses and costs would be visible "
                         f"to the network; use 127.0.0.1, or pass allow_remote=True")


class JobCollector(Collector):
    """The per-job metrics of one store (see the module doc), computed on each `collect`."""

    def __init__(self, store: Store, *, clock: Callable[[], float] = time.time):
        self.store, self._clock = store, clock
        self._ended: dict[str, tuple[float, Goodput]] = {}  # job id -> (updated_at, goodput) of ended jobs
        self._rows: dict[str, _Rows] = {}  # job id -> its rows read so far, for jobs not ended

    def describe(self) -> list[Metric]:
        return _Families().all()  # empty: registering does not read the store (and `?name[]=` can leave it out)

    def collect(self) -> Iterator[Metric]:
        m = _Families()
        jobs = self.store.jobs()
        for state in JobState:
            m.count.add_metric([state.value], sum(1 for j in jobs if j.state is state))
        for job in _with_series(jobs):
            try:
                self._add(m, job)
            except Exception:  # one unreadable job must not take every other job's metrics down
                log.exception("job %s: could not compute its metrics", job.id)
        kept = {j.id for j in jobs if j.state.terminal}
        self._ended = {k: v for k, v in self._ended.items() if k in kept}
        self._rows = {k: v for k, v in self._rows.items() if k not in kept}
        yield from m.all()

    def _add(self, m: _Families, job: JobRecord) -> None:
        accelerator, tier = str(job.placed_json.get("accelerator", "")), str(job.placed_json.get("tier", ""))
        m.info.add_metric([job.id], {"name": job.name, "accelerator": accelerator, "tier": tier})
        for state in JobState:
            m.state.add_metric([job.id, state.value], 1.0 if job.state is state else 0.0)
        if job.state is JobState.FAILED and job.cause is not None:
            m.failed_because.add_metric([job.id, job.cause.value], 1.0)
        last = self.store.last_step(job.id)
        if last is not None:
            m.completed_steps.add_metric([job.id], last.step + 1)
            m.loss.add_metric([job.id], last.loss)
            if last.tokens_per_s is not None:
                m.tokens_per_second.add_metric([job.id], last.tokens_per_s)
            for name, value in sorted(last.metrics.items()):
                if name == "mfu":
                    m.mfu.add_metric([job.id], value)
                elif name == "tflops_per_chip":
                    m.tflops.add_metric([job.id], value)
                elif name.startswith("hbm_") and name.endswith("_gib"):
                    m.hbm.add_metric([job.id, name[4:-4]], value * 1024 ** 3)
                else:
                    m.user.add_metric([job.id, name], value)
        g = self._goodput(job)
        m.goodput.add_metric([job.id], g.goodput_fraction)
        for category, seconds in g.seconds().items():
            m.time.add_metric([job.id, category], seconds)
        for (acc, t), usd in sorted(g.usd_by.items()) or [((accelerator, tier), 0.0)]:
            m.cost.add_metric([job.id, acc, t], usd)
        m.preemptions.add_metric([job.id], g.preemptions)
        m.restarts.add_metric([job.id], g.restarts)

    def _goodput(self, job: JobRecord) -> Goodput:
        # An ended job's rows no longer change: reading all its steps again on every
        # scrape would make scrapes slower with every job ever run.
        cached = self._ended.get(job.id)
        if cached is not None and cached[0] == job.updated_at:
            return cached[1]
        if job.state.terminal:
            g = goodput(self.store, job.id)
            self._ended[job.id] = (job.updated_at, g)
            return g
        events, steps = self._rows.setdefault(job.id, _Rows()).read(self.store, job.id)
        return compute_goodput(job, events, steps, now=self._clock())  # the record this scrape read


class _Rows:
    """One job's events and step rows as read so far; each read adds what was written since (`Store.events`
    after the last seq, `Store.steps_written_after`), and gives what a read of them all would."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.steps: dict[int, StepMetric] = {}  # by step: a step written again replaces its row
        self._seq = 0
        self._row = 0

    def read(self, store: Store, job_id: str) -> tuple[list[Event], list[StepMetric]]:
        new_steps, self._row = store.steps_written_after(job_id, self._row)
        for m in new_steps:
            self.steps[m.step] = m
        self.events += store.events(job_id, after_seq=self._seq)
        self._seq = self.events[-1].seq if self.events else 0
        return self.events, [self.steps[k] for k in sorted(self.steps)]


def _with_series(jobs: list[JobRecord]) -> list[JobRecord]:
    """The jobs a scrape exports series of: every job not ended, and the `ENDED_KEPT` that ended last (so a
    scrape after a job's end still sees its final values). A series per job ever run would grow each scrape
    with the store's history; Prometheus keeps what it scraped of the others."""
    ended = sorted((j for j in jobs if j.state.terminal), key=lambda j: j.updated_at)[-ENDED_KEPT:]
    return [j for j in jobs if not j.state.terminal] + ended


class StoreCollector(Collector):
    """The store's health as the controller knows it (`orchestrator.control.store_faults.StoreHealth`)."""

    NAMES = ("orchestrator_store_writable", "orchestrator_store_fault", "orchestrator_store_fault_since_seconds",
             "orchestrator_store_writes_held")

    def __init__(self, health):
        self.health = health  # anything with a `fault` (cause, message, since, held) or None

    def describe(self) -> list[Metric]:
        return self._families()

    def collect(self) -> Iterator[Metric]:
        yield from self._families(self.health.fault)

    @staticmethod
    def _families(fault=None) -> list[Metric]:
        writable = GaugeMetricFamily("orchestrator_store_writable", "1 while the state store takes writes.",
                                     value=0.0 if fault else 1.0)
        info = InfoMetricFamily("orchestrator_store_fault", "Why the state store refuses writes.")
        since = GaugeMetricFamily("orchestrator_store_fault_since_seconds", "When the store began refusing writes.")
        held = GaugeMetricFamily("orchestrator_store_writes_held", "Writes waiting for the store.")
        if fault is not None:
            info.add_metric([], {"cause": fault.cause, "message": fault.message})
            since.add_metric([], fault.since)
            held.add_metric([], fault.held)
        return [writable, info, since, held]


def read_store_fault(url: str, *, timeout_s: float = 2.0) -> dict | None:
    """The store's fault as a controller's metrics endpoint `url` exports it: {cause, message, since,
    held}, or None while the store is writable. OSError if the endpoint does not answer."""
    query = "&".join(f"name[]={n}" for n in ("orchestrator_store_fault_info", *StoreCollector.NAMES[2:]))
    with urllib.request.urlopen(f"{url}?{query}", timeout=timeout_s) as r:
        text = r.read().decode()
    fault: dict = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "orchestrator_store_fault_info":
                fault.update(cause=sample.labels["cause"], message=sample.labels["message"])
            elif sample.name == "orchestrator_store_fault_since_seconds":
                fault["since"] = sample.value
            elif sample.name == "orchestrator_store_writes_held":
                fault["held"] = int(sample.value)
    return fault if "cause" in fault else None


class _Families:
    """One scrape's metric families, filled job by job."""

    def __init__(self):
        p = "orchestrator_job"
        self.count = GaugeMetricFamily("orchestrator_jobs", "Jobs in the store, by state (every job, ended or not).",
                                       labels=["state"])
        self.info = InfoMetricFamily(p, "The job's name, accelerator type and tier.", labels=["job_id"])
        self.state = GaugeMetricFamily(f"{p}_state", "1 for the job's current state, 0 for the others.",
                                       labels=["job_id", "state"])
        self.failed_because = GaugeMetricFamily(f"{p}_failed_because", "1 for a FAILED job's cause (setup, "
                                                "user_code, budget, ...; see FailedBecause).",
                                                labels=["job_id", "cause"])
        self.completed_steps = GaugeMetricFamily(f"{p}_completed_steps", "Training steps completed.", labels=["job_id"])
        self.tokens_per_second = GaugeMetricFamily(f"{p}_tokens_per_second", "Throughput of the last step.",
                                                   labels=["job_id"])
        self.loss = GaugeMetricFamily(f"{p}_loss", "Training loss of the last step.", labels=["job_id"])
        self.mfu = GaugeMetricFamily(f"{p}_mfu_ratio", "Model FLOPs utilisation of the last step (of the bf16 peak).",
                                     labels=["job_id"])
        self.tflops = GaugeMetricFamily(f"{p}_tflops_per_chip", "Model TFLOP/s per chip of the last step.",
                                        labels=["job_id"])
        self.hbm = GaugeMetricFamily(f"{p}_hbm_bytes", "Accelerator memory of host 0's first device "
                                     "(in_use, peak, limit).", labels=["job_id", "kind"])
        self.user = GaugeMetricFamily(f"{p}_metric", "The program's own metrics of the last step.",
                                      labels=["job_id", "name"])
        self.goodput = GaugeMetricFamily(f"{p}_goodput_ratio", "Productive step time over wall time.",
                                         labels=["job_id"])
        self.time = GaugeMetricFamily(f"{p}_time_seconds", "Wall time by goodput category.",
                                      labels=["job_id", "category"])
        self.cost = CounterMetricFamily(f"{p}_cost_dollars", "Slice time billed (list prices), in US dollars.",
                                        labels=["job_id", "accelerator", "tier"])
        self.preemptions = CounterMetricFamily(f"{p}_preemptions", "Slices preempted or hosts lost.", labels=["job_id"])
        self.restarts = CounterMetricFamily(f"{p}_restarts", "Launches of the workers after the first.",
                                            labels=["job_id"])

    def all(self) -> list[Metric]:
        return list(vars(self).values())


class MetricsServer:
    """A running HTTP endpoint serving the metrics at `/metrics`; `stop()` shuts it down."""

    def __init__(self, httpd, thread: threading.Thread):
        self._httpd, self._thread = httpd, thread
        self.host, self.port = httpd.server_address[:2]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    @property
    def serving(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop serving, close the socket and wait for the serving thread to end (idempotent)."""
        if self._thread.is_alive():
            self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout_s)


def serve_metrics(store: Store, *, host: str = "127.0.0.1", port: int = 0, allow_remote: bool = False,
                  store_health=None) -> tuple[MetricsServer, int]:
    """Serve the jobs of `store` at http://host:port/metrics on a daemon thread; returns (server, bound port).

    With `store_health` (the controller's `StoreHealth`), also the store's health.

    Only loopback addresses unless `allow_remote`; `port=0` picks a free port. Example::

        server, port = serve_metrics(store)
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
        server.stop()
    """
    if not allow_remote and not _is_loopback(host):
        raise RemoteMetricsRefused(host)
    # A registry of our own: the process-wide default would also export this process's
    # Python and GC metrics, and a second server in one process would clash in it.
    registry = CollectorRegistry(auto_describe=False)
    registry.register(JobCollector(store))
    if store_health is not None:
        registry.register(StoreCollector(store_health))
    httpd, thread = start_http_server(port, addr=host, registry=registry)
    server = MetricsServer(httpd, thread)
    log.info("serving job metrics at %s", server.url)
    return server, server.port


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost may resolve anywhere
        return False
