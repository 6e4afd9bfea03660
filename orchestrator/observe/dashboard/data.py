"""What the dashboard shows, as JSON-ready dicts read from the store on each request.

Nothing is kept between requests but the goodput of jobs that have ended (it cannot
change), so the page shows what `orchestrator status` would, and a restarted controller
serves the same. Times are Unix seconds; money is US dollars at list prices.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path

from orchestrator import catalog
from orchestrator.catalog import CATALOG
from orchestrator.cluster import Home
from orchestrator.domain.provider_facts import PROVIDERS
from orchestrator.observe.billing import billed_slices
from orchestrator.observe.goodput import Goodput, compute_goodput
from orchestrator.observe.timeline import MARKER_TITLES, deadline_line, disruption_cause, markers, move_line
from orchestrator.state.events import Disrupted, EventKind
from orchestrator.state.states import JobState, SliceState
from orchestrator.state.store import Event, JobRecord, SliceRow, StepMetric, Store

MAX_POINTS = 2000  # per curve: a long run's steps are thinned to this many (every k-th, the last kept)
LOG_TAIL_BYTES = 64 * 1024


# Every QUEUED job's place in its line (1 = next) among the jobs given, by id: the controller's
# (`orchestrator.control.queue.queue_positions`), which knows the lines.
QueuePositions = Callable[[list[JobRecord]], dict[str, int]]
PAGE_SIZE = 50  # jobs a page of the overview shows in full (the others are counted)
LIST_MAX = 100  # slices and queued jobs the overview lists (all of them are counted)


class DashboardData:
    """The dashboard's reads of one store (thread-safe: the store keeps a connection per thread)."""

    def __init__(self, store: Store, home: Home, *, queue_positions: QueuePositions = lambda jobs: {}):
        self.store, self.home = store, home
        self.queue_positions = queue_positions
        self._ended: dict[str, tuple[float, Goodput]] = {}
        self._lock = threading.Lock()

    # -- every job ------------------------------------------------------------------

    def overview(self, *, now: float | None = None, page: int = 1) -> dict:
        """A page of the jobs (those not ended first, then the ended; newest first in each), the slices in
        use and requested across them, the queue, and counts of all of them.

        What a page costs grows with the page, not with the store: each job shown reads its steps and
        events (its goodput), so a thousand jobs are shown `PAGE_SIZE` at a time, and the slices and the
        queue are listed up to `LIST_MAX` (their chips and lengths count every one)."""
        now = time.time() if now is None else now
        jobs = self.store.jobs()
        ordered = [j for j in reversed(jobs) if not j.state.terminal] + [j for j in reversed(jobs) if j.state.terminal]
        pages = max(1, -(-len(ordered) // PAGE_SIZE))
        page = min(max(1, page), pages)
        positions = self.queue_positions([j for j in jobs if j.state is JobState.QUEUED])
        rows = [self.job_row(job, now=now, queue_position=positions.get(job.id))
                for job in ordered[(page - 1) * PAGE_SIZE:page * PAGE_SIZE]]
        by_id = {j.id: j for j in jobs}
        queued = sorted((j for j in jobs if j.id in positions),
                        key=lambda j: (j.placed_json.get("provider", "local"), positions[j.id]))
        slices = sorted(self.store.slices(live_only=True), key=lambda r: (r.job_id, r.name))
        in_use = {SliceState.READY, SliceState.PREEMPTING}
        chips = {True: 0, False: 0}
        for rec in slices:
            chips[rec.state in in_use] += _chips_of(rec.accelerator)
        states: dict[str, int] = {}
        for j in jobs:
            states[j.state.value] = states.get(j.state.value, 0) + 1
        return {"now": now, "jobs": rows, "page": page, "pages": pages, "page_size": PAGE_SIZE,
                "slices": [self._slice_row(rec, jobs_by_id=by_id) for rec in slices[:LIST_MAX]],
                "queue": [self._queue_row(j, positions[j.id]) for j in queued[:LIST_MAX]],
                "totals": {"chips_in_use": chips[True], "chips_requested": chips[False],
                           "usd_page": sum(r["usd"] for r in rows), "jobs": len(jobs),
                           "active": sum(1 for j in jobs if not j.state.terminal), "by_state": states,
                           "slices": len(slices), "queued": len(queued)}}

    @staticmethod
    def _queue_row(job: JobRecord, position: int) -> dict:
        spec = job.placed_json
        try:
            hosts: int | None = catalog.lookup(spec.get("accelerator", "")).hosts
        except ValueError:  # a type not in this version's catalog, or none
            hosts = None
        return {"position": position, "pool": spec.get("provider", "local"), "id": job.id, "name": job.name,
                "accelerator": spec.get("accelerator", "?"), "tier": spec.get("tier", "?"), "hosts": hosts,
                "since": job.updated_at, "reason": job.reason}

    def job_row(self, job: JobRecord, *, now: float, queue_position: int | None = None) -> dict:
        """One job's line: state, step of total, loss, tokens/s, goodput, dollars so far and expected, wall time."""
        spec = job.placed_json
        last = self.store.last_step(job.id)
        g = self.goodput(job, now=now)
        total = (spec.get("workload") or {}).get("steps")
        step = last.step + 1 if last else 0
        try:
            hosts = catalog.lookup(spec.get("accelerator", "")).hosts
        except ValueError:  # a type not in this version's catalog (UnknownAcceleratorError), or none
            hosts = None
        return {
            "id": job.id, "name": job.name, "state": job.state.value, "done": job.state.terminal,
            "cause": job.cause.value if job.state is JobState.FAILED and job.cause else None,
            "reason": job.reason, "queue_position": queue_position, "pool": spec.get("provider", "local"),
            "accelerator": spec.get("accelerator", "?"), "tier": spec.get("tier", "?"), "hosts": hosts,
            "step": step, "total_steps": total,
            "loss": last.loss if last else None, "tokens_per_s": last.tokens_per_s if last else None,
            "goodput": g.goodput_fraction, "usd": g.usd_total,
            "usd_expected": self._expected_usd(job, g, step, total),
            "wall_s": g.wall_s, "created_at": job.created_at, "state_since": job.updated_at,
            "preemptions": job.preemptions, "failures": job.failures, "moving": move_line(self.store, job),
            "warning": deadline_line(self.store, job),
        }

    def goodput(self, job: JobRecord, *, now: float) -> Goodput:
        with self._lock:
            cached = self._ended.get(job.id)
        if cached is not None and cached[0] == job.updated_at:
            return cached[1]
        g = compute_goodput(job, self.store.events(job.id), self.store.steps(job.id), now=now)
        if job.state.terminal:
            with self._lock:
                self._ended[job.id] = (job.updated_at, g)
        return g

    def _expected_usd(self, job: JobRecord, g: Goodput, step: int, total: int | None) -> float | None:
        """Dollars at the end: so far, plus the steps left at the recent pace on the slices held now."""
        if job.state.terminal:
            return g.usd_total
        if not total or step <= 0:
            return None
        recent = [m.step_time_s for m in self.store.steps(job.id)[-20:] if m.step_time_s]
        if not recent:
            return None
        per_hour = 0.0
        for rec in self.store.slices(job_id=job.id, live_only=True):
            if rec.state in (SliceState.READY, SliceState.PROVISIONING, SliceState.PREEMPTING):  # billed
                try:
                    per_hour += catalog.lookup(rec.accelerator).usd_per_hour(rec.tier)
                except ValueError:  # a type or tier this version does not price: the estimate leaves it out
                    continue
        left_s = max(0, total - step) * statistics.median(recent)
        return g.usd_total + per_hour * left_s / 3600.0

    def _slice_row(self, rec: SliceRow, *, jobs_by_id: dict[str, JobRecord]) -> dict:
        job = jobs_by_id.get(rec.job_id)
        try:
            t = catalog.lookup(rec.accelerator)
            chips, hosts, price = t.chips, t.hosts, t.usd_per_hour(rec.tier)
        except ValueError:  # a type or tier this version does not know: shown with no figures
            chips, hosts, price = 0, 0, 0.0
        return {"name": rec.name, "job_id": rec.job_id, "job_name": job.name if job else "?",
                "accelerator": rec.accelerator, "tier": rec.tier, "state": rec.state.value,
                "in_use": rec.state in (SliceState.READY, SliceState.PREEMPTING), "chips": chips, "hosts": hosts,
                "usd_per_hour": price, "provider": rec.provider, "zone": _zone(rec, job),
                "since": rec.updated_at}

    # -- one job --------------------------------------------------------------------

    def job(self, job_id: str, *, now: float | None = None) -> dict:
        """One job's page: its line, curves, events, goodput breakdown, slices and what it may be resized to."""
        now = time.time() if now is None else now
        job = self.store.job(job_id)
        events, steps = self.store.events(job.id), self.store.steps(job.id)
        position = None
        if job.state is JobState.QUEUED:
            position = self.queue_positions(self.store.jobs(active_only=True)).get(job.id)
        row = self.job_row(job, now=now, queue_position=position)
        g = self.goodput(job, now=now)
        wall = g.wall_s or 1.0
        row.update({
            "spec": {k: v for k, v in job.stored_spec.items() if not k.startswith("_")},
            "error": job.error if job.state is JobState.FAILED else None,
            "curves": _curves(steps),
            "chips": _chips(events, start=g.start, end=max(g.end, now if not job.state.terminal else g.end)),
            "cost": _cost(events, start=g.start, end=g.end),
            "markers": [{"at": m.at, "step": m.step, "kind": m.kind, "title": MARKER_TITLES[m.kind],
                         "label": m.label, "reason": m.reason} for m in markers(events, steps)],
            "events": [_event_row(e) for e in events],
            "goodput_breakdown": [{"category": c, "seconds": s, "share": s / wall} for c, s in g.seconds().items()],
            "counts": {"preemptions": g.preemptions, "failures": g.failures, "restarts": g.restarts,
                       "lost_steps": g.lost_steps, "productive_steps": g.productive_steps},
            "slices": [self._slice_row(r, jobs_by_id={job.id: job}) | _billed(r.name, events, g.end)
                       for r in sorted(self.store.slices(job_id=job.id), key=lambda r: r.updated_at)],
            "resize_to": _resize_choices(job),
        })
        return row

    def logs(self, job_id: str, *, tail_bytes: int = LOG_TAIL_BYTES) -> dict:
        """The last `tail_bytes` of the job's worker output, whole lines only."""
        job = self.store.job(job_id)
        path = self.home.job_dir(job.id) / "job.log"
        return {"id": job.id, "lines": _tail(path, tail_bytes)}


# -- pieces ----------------------------------------------------------------------------


def _chips_of(accelerator: str) -> int:
    try:
        return catalog.lookup(accelerator).chips
    except ValueError:  # a type this version does not know: counted as none
        return 0


def _zone(rec: SliceRow, job: JobRecord | None) -> str:
    if rec.data.get("zone"):
        return str(rec.data["zone"])
    if (known := PROVIDERS.get(rec.provider)) is not None and known.zone is not None:  # every slice's zone
        return known.zone
    spec = job.stored_spec if job else {}
    zones = (spec.get("gcp") or {}).get("zones") or []
    return spec.get("zone") or (", ".join(zones) if zones else "?")


def _thin(n: int) -> list[int]:
    """Indices of `n` points thinned to at most MAX_POINTS, the last always kept."""
    if n <= MAX_POINTS:
        return list(range(n))
    k = -(-n // MAX_POINTS)
    idx = list(range(0, n, k))
    if idx[-1] != n - 1:
        idx.append(n - 1)
    return idx


def _curves(steps: list[StepMetric]) -> dict:
    idx = _thin(len(steps))
    rows = [steps[i] for i in idx]
    return {"step": [s.step + 1 for s in rows], "at": [s.at for s in rows], "loss": [s.loss for s in rows],
            "tokens_per_s": [s.tokens_per_s for s in rows], "generation": [s.generation for s in rows],
            "mfu": [s.metrics.get("mfu") for s in rows]}


def _chips(events: list[Event], *, start: float, end: float) -> dict:
    """Chips held over time, one series per (type, tier): a step function at the times any changes."""
    slices = billed_slices(events, end=end)
    groups = sorted({(s.accelerator, s.tier) for s in slices})
    times = sorted({start, end} | {t for s in slices for t in (s.start, s.end) if start <= t <= end})
    series = []
    for acc, tier in groups:
        mine = [s for s in slices if (s.accelerator, s.tier) == (acc, tier)]
        series.append({"accelerator": acc, "tier": tier,
                       "chips": [sum(s.chips for s in mine if s.start <= t < s.end) for t in times]})
    return {"at": times, "series": series}


def _cost(events: list[Event], *, start: float, end: float) -> dict:
    slices = billed_slices(events, end=end)
    times = sorted({start, end} | {t for s in slices for t in (s.start, s.end) if start <= t <= end})
    if len(times) < 60 and end > start:  # a few more points so the line reads as a line
        times = sorted(set(times) | {start + (end - start) * i / 60 for i in range(61)})
    return {"at": times, "usd": [sum(s.usd_until(t) for s in slices) for t in times]}


def _billed(name: str, events: list[Event], end: float) -> dict:
    for s in billed_slices(events, end=end):
        if s.name == name:
            return {"billed_from": s.start, "billed_to": s.end, "usd": s.usd}
    return {"billed_from": None, "billed_to": None, "usd": 0.0}


def _event_row(e: Event) -> dict:
    """An event with the dashboard's category: a disruption's cause, restore, checkpoint, move, adoption, ..."""
    category = {EventKind.RESTORE: "restore", EventKind.CHECKPOINT: "checkpoint", EventKind.RESIZE: "move",
                EventKind.ADOPTED: "adoption", EventKind.SLICE: "slice", EventKind.AUTOSCALE: "autoscale",
                EventKind.NOTICE: "notice", EventKind.LOST_WORK: "lost work", EventKind.RESUMED: "resumed",
                EventKind.LAUNCHED: "launched", EventKind.STATE: "state"}.get(e.kind, e.kind.value)
    cause = None
    if e.kind is EventKind.DISRUPTION:
        disrupted = e.payload_as(Disrupted)
        cause = disruption_cause(disrupted.kind, disrupted.reason)
        category = MARKER_TITLES.get(cause, "disruption") if cause else "disruption"
    return {"seq": e.seq, "at": e.at, "kind": e.kind.value, "category": category, "cause": cause,
            "from_state": e.from_state and e.from_state.value, "to_state": e.to_state and e.to_state.value,
            "reason": e.reason}


def _resize_choices(job: JobRecord) -> dict:
    """The slice types and tiers a RUNNING job may be resized to (its generation's sizes)."""
    try:
        t = catalog.lookup(job.placed_json.get("accelerator", ""))
        types = [x.name for x in catalog.same_generation(t)]
    except ValueError:  # a type this version does not know: any of the catalog's
        types = list(CATALOG)
    return {"accelerators": types, "tiers": [x.value for x in catalog.Tier],
            "allowed": job.state is JobState.RUNNING}


def _tail(path: Path, tail_bytes: int) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - tail_bytes))
            data = f.read()
    except FileNotFoundError:
        return []
    lines = data.decode("utf-8", errors="replace").splitlines()
    return lines[1:] if size > tail_bytes else lines  # the first line may be cut
