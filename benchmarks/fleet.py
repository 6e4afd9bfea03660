"""One controller, many jobs: what the control plane costs as the number of concurrent jobs N grows.

    python benchmarks/fleet.py [--jobs 10,100,300] [--quick] [--steps 40] [--step-s 3]

For each N, a fresh controller process (`benchmarks/fleet_world.py`: every job's real driver, the
SQLite store, the admission queue, the real cost policy for the jobs that autoscale, the gcp provider
with the real TPU client) runs N jobs at once against the TPU API emulator, whose nodes are API
objects only. Each launch's workers are scripted: a step every `--step-s` seconds, a checkpoint every
10 steps, a preemption notice now and then. A replayed spot trace (a 4-node preemption trace, one tick
every `--tick-s` wall seconds) sets how many spot slices the zone holds: above it, the newest are
reclaimed through the API (SUSPENDING, stateInitiator SERVICE) and new requests wait for capacity.
The run ends when every job has ended (or, past `--max-s`, they are all cancelled).

Measured at each N, from outside the controller's process (this one serves the emulator):
- the controller process's resident memory (peak, /proc VmRSS) and CPU share (its CPU seconds over
  wall seconds, sampled every second), and its threads;
- the store's size at the end (state.db and its WAL) and its write transactions per second;
- from a reclaim in the API to the job's next slice request (the store's REQUESTED event of its next
  slice), and from a slice READY to the job's launch on it (STARTING), p50/p99;
- the TPU API requests the controller made, per job-hour;
- `orchestrator list` and `orchestrator status JOB` (the CLI, a process each) and the dashboard's
  jobs JSON and the metrics endpoint: latency and bytes, sampled during the run;
- every job's end state, events, and slices left behind (in the API and in the store).

    python benchmarks/fleet.py --jobs 1000 --kill-controller [--steps 120] [--tick-s 0]

With `--kill-controller` the groups run in this process (`fleet_world.ScriptedHosts`), not the
controller's. Once every job runs, the controller's process is killed (SIGKILL) and, `--down-s` later,
a new one starts on the same store; it adopts the jobs through the controller's own pass
(`adoption.reconcile`) while their groups train on. Measured (`kill`): from the new process's start to
each job's driver running again on its group (p50/p99/max, and to the last), the jobs relaunched
instead, the steps lost (done by the hosts but never recorded, or done twice), the events lost, the
slices left behind, every job's end state. `--tick-s 0`: no spot trace (reclaims) in the run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import machine, save  # noqa: E402

PROCESS_T0 = time.time()  # a controller's process started (about: before its imports)
TRACE = ROOT / "policies/evaluation/traces/preemption/4-node"
CLK_TCK = os.sysconf("SC_CLK_TCK")


# -- the controller's process ------------------------------------------------------------------


def job_spec(i: int, endpoint: str, *, steps: int, autoscale: bool) -> dict:
    from benchmarks.fleet_world import PROJECT, ZONE

    name = f"fleet-{i:04d}"
    spec = {"name": name, "accelerator": "v4-16", "tier": "spot", "provider": "gcp",
            "gcp": {"project": PROJECT, "zones": [ZONE], "endpoint": endpoint},
            "workload": {"type": "lm", "steps": steps,
                         "model": {"d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64},
                         "seq_len": 16, "global_batch_size": 16},
            "checkpoint": {"directory": f"gs://fleet-bench/checkpoints/{name}", "interval_steps": 10}}
    if autoscale:
        spec.update(deadline="PT2H", autoscaling={"accelerators": ["v4-16", "v4-32"], "tiers": ["spot", "on-demand"]})
    return spec


def child(args: argparse.Namespace) -> int:
    """The controller: start N drivers (or, `--adopt`, adopt those an earlier one ran), run until every job
    ended, write what only it knows."""
    import logging

    from benchmarks import fleet_world
    from benchmarks.fleet_world import FleetWorld, Writes
    from orchestrator.control.job import loop

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    imported = time.time()
    loop.write_fence = lambda spec, generation, owner=None: fleet_world.FENCES.__setitem__(0, fleet_world.FENCES[0] + 1)
    out = Path(args.home)
    part = "adopter" if args.adopt else "child"
    with Writes().installed() as writes:
        world = FleetWorld(out / "home", args.endpoint, step_s=args.step_s, notice_every=args.notice_every,
                           seed=args.seed, list_over=args.list_over,
                           creates_per_minute=args.creates_per_minute or None, hosts=args.hosts)
        built = time.time()
        token = world.home.token_file.read_text().strip() if world.home.token_file.exists() else ""
        (out / "serving.json").write_text(json.dumps({"metrics": f"http://127.0.0.1:{world.metrics_port}/metrics",
                                                      "dashboard": world.dashboard_url, "token": token}))
        t0 = time.time()
        if args.adopt:
            reconciled = _reconcile(world, out, profile=args.profile_adoption)
            (out / "reconcile.json").write_text(json.dumps({**reconciled, "process_started": PROCESS_T0,
                                                            "imported": imported, "world_built": built,
                                                            "reconcile_started": t0, "reconcile_ended": time.time()}))
        else:
            for i in range(args.n):
                world.submit(f"fleet-{i:04d}", job_spec(i, args.endpoint, steps=args.steps,
                                                        autoscale=i % args.autoscale_every == 0))
        submit_s = time.time() - t0
        cancelled_at = None
        while world.running() and time.time() - t0 < args.max_s:
            time.sleep(0.5)
        if world.running():  # past the limit: cancel the rest (a mass cancellation, timed)
            cancelled_at = time.time()
            for driver in list(world.drivers.values()):
                driver.cancel()
            while world.running() and time.time() - cancelled_at < 120:
                time.sleep(0.2)
        (out / f"{part}.json").write_text(json.dumps({
            "submit_s": round(submit_s, 2), "run_s": round(time.time() - t0, 1), "writes": writes.count,
            "writes_in_batches": writes.in_batches,
            "fences_skipped": fleet_world.FENCES[0], "notices": world.notices, "still_running": world.running(),
            "cancelled_after_s": None if cancelled_at is None else round(cancelled_at - t0, 1),
            "cancel_s": None if cancelled_at is None else round(time.time() - cancelled_at, 1),
            "started_at": t0, "ended_at": time.time(),
            "create_pace": {"per_minute": world.gcp._api.pace.per_minute, "waits": world.gcp._api.pace.waits,
                            "waited_s": round(world.gcp._api.pace.waited_s, 1)}}))
        world.stop()
    return 0


def _reconcile(world, out: Path, *, profile: bool) -> dict:
    """The restarted controller's adoption pass; with `profile`, its thread's stack sampled every 20 ms (a
    sampling profiler: cProfile would slow the pass it measures), the functions most often on it to a file."""
    if not profile:
        return world.reconcile()
    main, samples, done = threading.get_ident(), [], threading.Event()

    def sample() -> None:
        while not done.wait(0.02):
            frame = sys._current_frames().get(main)
            stack = []
            while frame is not None:
                stack.append(f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_name}")
                frame = frame.f_back
            samples.append(stack)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        return world.reconcile()
    finally:
        done.set()
        sampler.join()
        inclusive: dict[str, int] = {}
        for stack in samples:
            for name in set(stack):
                inclusive[name] = inclusive.get(name, 0) + 1
        top = sorted(inclusive.items(), key=lambda kv: -kv[1])[:60]
        (out / "reconcile_profile.txt").write_text(f"{len(samples)} samples of the pass's thread, every 20 ms; "
                                                   "share of them with the function on the stack:\n" +
                                                   "\n".join(f"{n / max(1, len(samples)):6.1%}  {name}"
                                                              for name, n in top) + "\n")


# -- around it ---------------------------------------------------------------------------------


class Sampler(threading.Thread):
    """The controller process's RSS, CPU seconds and threads, once a second."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.samples, self.done = pid, [], threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            try:
                status = Path(f"/proc/{self.pid}/status").read_text()
                stat = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                return
            if "VmRSS" not in status:  # it exited: a zombie's status has no memory lines
                return
            rss = int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1]) * 1024
            threads = int(next(line for line in status.splitlines() if line.startswith("Threads")).split()[1])
            cpu = (int(stat[11]) + int(stat[12])) / CLK_TCK
            self.samples.append((time.time(), rss, cpu, threads))
            self.done.wait(1.0)


class Weather(threading.Thread):
    """The spot trace replayed on the emulator: reclaims above capacity, a stockout while at it."""

    def __init__(self, emu, n: int, tick_s: float, start: int = 0):
        super().__init__(daemon=True)
        from policies.evaluation.traces import load_trace

        files = sorted(TRACE.glob("**/*.json"))
        self.trace = load_trace(files[0])
        self.emu, self.n, self.tick_s, self.i = emu, n, tick_s, start
        self.reclaims: list[tuple[str, float]] = []
        self.stockout_ticks = 0
        self.ticks = 0
        self.done = threading.Event()

    def capacity(self) -> int:
        count = self.trace.counts[self.i % len(self.trace.counts)]
        return max(1, round(self.n * (0.5 + 0.5 * count / self.trace.nodes)))

    def run(self) -> None:
        from benchmarks.fleet_world import ZONE

        while not self.done.wait(self.tick_s):
            self.i, self.ticks = self.i + 1, self.ticks + 1
            cap = self.capacity()
            with self.emu.world._cond:  # the emulator's own records (this process serves it)
                active = sorted(((q.create_time, q.name) for q in self.emu.world._qrs.values()
                                 if q.state == "ACTIVE" and "spot" in q.spec), reverse=True)  # newest first
            for _, name in active[:max(0, len(active) - cap)]:
                try:
                    self.emu.reclaim(name)
                    self.reclaims.append((name.rsplit("/", 1)[1], time.time()))
                except Exception:  # it moved on meanwhile (deleted by its job)
                    pass
            if len(active) >= cap:
                self.emu.stockout(ZONE, mode="wait")
                self.stockout_ticks += 1
            else:
                self.emu.clear_stockout(ZONE)


def timed_get(url: str, token: str | None = None) -> tuple[float, int]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=60) as r:
        body = r.read()
    return time.perf_counter() - t, len(body)


def timed_cli(args: list[str], home: Path) -> tuple[float, int, int]:
    env = {**os.environ, "ORCHESTRATOR_HOME": str(home), "COLUMNS": "160"}
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "orchestrator", *args], env=env, capture_output=True, timeout=120)
    return time.perf_counter() - t, len(p.stdout), p.returncode


class Queries(threading.Thread):
    """`list`, `status`, the dashboard's jobs JSON and the metrics endpoint, every `every_s`."""

    def __init__(self, out: Path, every_s: float):
        super().__init__(daemon=True)
        self.out, self.every_s = out, every_s
        self.rows: dict[str, list[tuple[float, int]]] = {"list": [], "status": [], "dashboard_jobs": [], "metrics": []}
        self.errors: list[str] = []
        self.done = threading.Event()

    def run(self) -> None:
        serving = self.out / "serving.json"
        while not serving.exists() and not self.done.wait(0.5):
            pass
        if self.done.is_set():
            return
        home = self.out / "home"
        while not self.done.wait(self.every_s):
            urls = json.loads(serving.read_text())  # a restarted controller serves them anew
            for name, fn in (("list", lambda: timed_cli(["list"], home)),
                             ("status", lambda: timed_cli(["status", "fleet-0000"], home)),
                             ("dashboard_jobs", lambda: timed_get(urls["dashboard"].rstrip("/") + "/api/overview",
                                                                  urls["token"])),
                             ("metrics", lambda: timed_get(urls["metrics"]))):
                try:
                    r = fn()
                    if len(r) == 3 and r[2] != 0:
                        self.errors.append(f"{name}: exit {r[2]}")
                        continue
                    self.rows[name].append((r[0], r[1]))
                except Exception as e:  # noqa: BLE001 -- a failed look is a figure too
                    self.errors.append(f"{name}: {type(e).__name__}: {e}")


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 3)


def _stats(xs: list[float]) -> dict:
    return {"n": len(xs), "p50": pct(xs, 0.5), "p99": pct(xs, 0.99)}


def _reaction_parts(seen: float, request: float, job_states: list[tuple[float, str]]) -> dict[str, float] | None:
    """Where a job's reaction to a lost READY slice went, from seeing the loss to its next request: to
    its RECOVERING transition (the attempt's end written: its group stopped, the slice released, the
    disruption, the decision), to its PROVISIONING transition (the next attempt's checks and the policy),
    and to the request itself (the create)."""
    recovering = next((t for t, st in job_states if st == "RECOVERING" and seen <= t <= request), None)
    if recovering is None:
        return None
    provisioning = next((t for t, st in job_states if st == "PROVISIONING" and recovering <= t <= request), None)
    if provisioning is None:
        return None
    return {"seen_to_recovering": recovering - seen, "recovering_to_provisioning": provisioning - recovering,
            "provisioning_to_request": request - provisioning}


def _reclaim_latencies(reclaims: list[tuple[str, float]], slice_job: dict[str, str],
                       slice_events: dict[str, list[tuple[float, str, str]]],
                       job_states: dict[str, list[tuple[float, str]]]) -> dict:
    """From each reclaim in the API: to the job's next request, to the controller seeing it, and on."""
    reclaim_to_request, by_view, seen_s, seen_to_request = [], {}, [], []
    to_request_by_view: dict[str, list[float]] = {}
    parts: dict[str, list[float]] = {}
    for name, at in reclaims:
        job = slice_job.get(name)
        evs = slice_events.get(job, [])
        nxt = [t for t, s, st in evs if st == "REQUESTED" and t > at and s != name]
        if nxt:
            reclaim_to_request.append(min(nxt) - at)
        # What the controller held the slice for when the API took it back: READY (its workers ran on it)
        # or still a request (WAITING/PROVISIONING: a queued request the job looks at only now and then).
        before = [st for t, s, st in evs if s == name and t <= at]
        view = before[-1] if before else "unseen"
        seen = [t for t, s, st in evs if s == name and st in ("PREEMPTING", "GONE") and t >= at]
        if seen:
            by_view.setdefault(view, []).append(min(seen) - at)
            seen_s.append(min(seen) - at)
            later = [t for t in nxt if t >= min(seen)]
            if later:
                seen_to_request.append(min(later) - min(seen))
                to_request_by_view.setdefault(view, []).append(min(later) - min(seen))
                split = _reaction_parts(min(seen), min(later), job_states.get(job, [])) if view == "READY" else None
                if split is not None:
                    for part, x in split.items():
                        parts.setdefault(part, []).append(x)
    return {"reclaim_to_next_request_s": {**_stats(reclaim_to_request), "max": pct(reclaim_to_request, 1.0)},
            "reclaim_seen_s": {**_stats(seen_s),
                               "by_controller_view": {v: _stats(x) for v, x in sorted(by_view.items())}},
            # By what the controller held: a READY slice's job asks again at once (the reaction); a request
            # refused while it waited asks again after the queue's backoff (`retry_after`, 7.5-15 s and up).
            "seen_to_next_request_s": {**_stats(seen_to_request),
                                       "by_controller_view": {v: _stats(x)
                                                              for v, x in sorted(to_request_by_view.items())},
                                       # a READY slice's: where the reaction's time went (`_reaction_parts`)
                                       "ready_parts": {part: _stats(x) for part, x in parts.items()}},
            "reclaims_without_next_request": len(reclaims) - len(reclaim_to_request)}


def from_store(db: Path, reclaims: list[tuple[str, float]]) -> dict:
    """Latencies, outcomes and leftovers read back from the store after the run."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    con.row_factory = sqlite3.Row
    slice_job = {r["name"]: r["job_id"] for r in con.execute("SELECT name, job_id FROM slices")}
    slice_events: dict[str, list[tuple[float, str, str]]] = {}  # job -> (at, slice, state)
    starts: dict[str, list[tuple[float, str]]] = {}  # job -> (at, slice)
    job_states: dict[str, list[tuple[float, str]]] = {}  # job -> (at, state it moved to)
    kinds: dict[str, int] = {}
    for r in con.execute("SELECT job_id, at, kind, to_state, data FROM events ORDER BY seq"):
        kinds[r["kind"]] = kinds.get(r["kind"], 0) + 1
        data = json.loads(r["data"]) if r["data"] else {}
        if r["kind"] == "slice" and isinstance(data, dict):
            slice_events.setdefault(r["job_id"], []).append((r["at"], data.get("name"), data.get("state")))
        if r["to_state"] in ("RECOVERING", "PROVISIONING"):
            job_states.setdefault(r["job_id"], []).append((r["at"], r["to_state"]))
        if r["to_state"] == "STARTING" and isinstance(data, dict) and data.get("slice"):
            starts.setdefault(r["job_id"], []).append((r["at"], data["slice"]))
    reclaim = _reclaim_latencies(reclaims, slice_job, slice_events, job_states)
    ready_to_launch = []
    for job, evs in slice_events.items():
        for t, s, st in evs:
            if st == "READY":
                later = [a for a, sl in starts.get(job, []) if sl == s and a >= t]
                if later:
                    ready_to_launch.append(min(later) - t)
    states: dict[str, int] = {}
    for r in con.execute("SELECT state FROM jobs"):
        states[r["state"]] = states.get(r["state"], 0) + 1
    live = con.execute("SELECT COUNT(*) FROM slices WHERE state NOT IN ('RELEASED', 'GONE')").fetchone()[0]
    steps = con.execute("SELECT COUNT(*) FROM steps").fetchone()[0]
    events = con.execute("SELECT COUNT(*) FROM events").fetchone()[0]
    lifetimes = [r[0] for r in con.execute("SELECT updated_at - created_at FROM jobs")]
    con.close()
    return {**reclaim,
            "ready_to_launch_s": {"n": len(ready_to_launch), "p50": pct(ready_to_launch, 0.5),
                                  "p99": pct(ready_to_launch, 0.99), "max": pct(ready_to_launch, 1.0)},
            "job_states": states, "live_slices_in_store": live, "step_rows": steps, "events": events,
            "event_kinds": kinds, "job_hours": sum(lifetimes) / 3600}


def _store_now(db: Path) -> tuple[dict[str, str], dict[str, int]]:
    """Each job's state and newest recorded step, read while a controller writes the store."""
    con = sqlite3.connect(db, timeout=30)
    try:
        states = dict(con.execute("SELECT id, state FROM jobs").fetchall())
        steps = dict(con.execute("SELECT job_id, MAX(step) FROM steps GROUP BY job_id").fetchall())
    finally:
        con.close()
    return states, steps


def _have_run(db: Path) -> int:
    """How many jobs have been RUNNING (a notice's or a move's relaunch keeps a few between two launches at
    any time: all N RUNNING at once may not come)."""
    con = sqlite3.connect(db, timeout=30)
    try:
        return con.execute("SELECT COUNT(DISTINCT job_id) FROM events WHERE to_state='RUNNING'").fetchone()[0]
    finally:
        con.close()


def kill_and_restart(proc: subprocess.Popen, cmd: list[str], out: Path, n: int, hosts,
                     args: argparse.Namespace) -> tuple[dict, subprocess.Popen]:
    """Once all N jobs have run (or `--kill-wait-s` passed) and `--kill-after-s` more: SIGKILL the controller, and
    `--down-s` later start a new one on the same store (`--adopt`). What the store and hosts held at the kill."""
    db = out / "home" / "state.db"
    t0 = time.time()
    while time.time() - t0 < args.kill_wait_s and proc.poll() is None:
        if db.exists() and _have_run(db) >= n:
            break
        time.sleep(1.0)
    time.sleep(args.kill_after_s)
    states, steps = _store_now(db)
    with hosts._cond:
        hosts_steps = {job: s.step for (job, _), s in hosts.scripts.items() if s.ended is None}
    load, killed_at = os.getloadavg(), time.time()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    time.sleep(args.down_s)
    restarted_at = time.time()
    proc = subprocess.Popen([*cmd, "--adopt"], stdout=open(out / "adopter.log", "wb"), stderr=subprocess.STDOUT)
    running = sum(st == "RUNNING" for st in states.values())
    print(f"killed the controller {killed_at - t0:.0f} s into the run ({running} of {n} RUNNING); "
          f"restarted {restarted_at - killed_at:.1f} s later", flush=True)
    return {"waited_for_running_s": round(killed_at - t0, 1), "states_at_kill": states, "steps_at_kill": steps,
            "host_steps_at_kill": hosts_steps, "load_at_kill": [round(x, 1) for x in load],
            "killed_at": killed_at, "restarted_at": restarted_at}, proc


def kill_figures(db: Path, out: Path, kill: dict, hosts, steps: int) -> dict:
    """What the restart cost: when each job was adopted again, which were relaunched, and what was lost."""
    rec = json.loads((out / "reconcile.json").read_text()) if (out / "reconcile.json").exists() else {}
    spawn = kill["restarted_at"]
    active = sorted(j for j, st in kill["states_at_kill"].items() if st not in ("SUCCEEDED", "FAILED", "CANCELLED"))
    adopted, started = set(rec.get("adopted", [])), rec.get("started", {})
    running = [j for j in active if kill["states_at_kill"][j] in ("RUNNING", "STARTING")]
    to_adopt = [started[j] - spawn for j in adopted if j in started]
    to_find = [t - spawn for t in rec.get("found", {}).values()]  # each group found by the pass
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    lost: dict[str, dict] = {}
    doubled = unrecorded = redone = lost_before = 0
    for job in active:
        counts = dict(con.execute("SELECT step, COUNT(*) FROM steps WHERE job_id=? GROUP BY step", (job,)).fetchall())
        high = max(counts, default=-1)
        gaps = [s for s in range(high + 1) if s not in counts]  # done (a later step was) but never recorded
        before = kill["steps_at_kill"].get(job)
        gone = [s for s in range(before + 1) if s not in counts] if before is not None else []
        twice = sum(c - 1 for c in counts.values())
        again = hosts.steps_done.get(job, 0) - (high + 1)  # steps the hosts did more than once (a relaunch's)
        doubled, unrecorded, redone, lost_before = doubled + twice, unrecorded + len(gaps), redone + again, \
            lost_before + len(gone)
        if gaps or twice or again or gone:
            lost[job] = {"unrecorded": gaps[:20], "recorded_twice": twice, "done_again": again,
                         "recorded_before_kill_gone": len(gone)}
    adopted_events = dict(con.execute("SELECT job_id, COUNT(*) FROM events WHERE kind='adopted' GROUP BY job_id"))
    saves_recorded = dict(con.execute("SELECT job_id, COUNT(*) FROM events WHERE kind='checkpoint' GROUP BY job_id"))
    ends = dict(con.execute("SELECT job_id, COUNT(*) FROM events WHERE to_state IN ('SUCCEEDED', 'FAILED', "
                            "'CANCELLED') GROUP BY job_id"))
    bad_slices = []
    for name, job, state in con.execute("SELECT name, job_id, state FROM slices").fetchall():
        seen = [s for (s,) in con.execute("SELECT json_extract(data, '$.state') FROM events WHERE kind='slice' AND "
                                          "job_id=? AND json_extract(data, '$.name')=? ORDER BY seq", (job, name))]
        if not (seen and seen[0] == "REQUESTED" and seen[-1] == state):
            bad_slices.append((name, seen, state))
    con.close()
    unsaved = {j: hosts.saves.get(j, 0) - saves_recorded.get(j, 0) for j in active
               if hosts.saves.get(j, 0) != saves_recorded.get(j, 0)}
    return {
        "jobs_active_at_kill": len(active), "running_at_kill": len(running), "adopted": len(adopted & set(active)),
        # a job RUNNING (or STARTING) at the kill whose group was not adopted: relaunched, its steps since its
        # last checkpoint done again
        "relaunched": sorted(set(running) - adopted),
        # the others (between two launches: a notice's, a move's) start their next launch as they would have
        "not_running_at_kill": {st: sum(kill["states_at_kill"][j] == st for j in active if j not in running)
                                for st in sorted({kill["states_at_kill"][j] for j in active}) if st not in
                                ("RUNNING", "STARTING")},
        "process_start_to_reconcile_s": round(rec["reconcile_started"] - spawn, 2) if rec else None,
        "reconcile_s": round(rec["reconcile_ended"] - rec["reconcile_started"], 2) if rec else None,
        "to_adopt_s": {"n": len(to_adopt), "p50": pct(to_adopt, 0.5), "p99": pct(to_adopt, 0.99),
                       "max": pct(to_adopt, 1.0)},
        "to_find_s": {"n": len(to_find), "p50": pct(to_find, 0.5), "p99": pct(to_find, 0.99), "max": pct(to_find, 1.0)},
        "down_s": round(spawn - kill["killed_at"], 2), "waited_for_running_s": kill["waited_for_running_s"],
        "load_at_kill": kill["load_at_kill"],
        "steps": {"recorded_twice": doubled, "unrecorded": unrecorded, "done_again": redone,
                  "recorded_before_kill_gone": lost_before, "by_job": dict(list(lost.items())[:20])},
        "events": {"adopted_recorded": sum(adopted_events.values()),
                   "jobs_adopted_twice": sorted(j for j, c in adopted_events.items() if c > 1),
                   "ends_not_once": sorted(j for j in active if ends.get(j, 0) != 1),
                   "slices_with_broken_history": bad_slices[:10],
                   "checkpoints_unrecorded": sum(max(0, d) for d in unsaved.values()),
                   "checkpoints_unrecorded_jobs": len(unsaved)},
        "hosts": {"steps_done": sum(hosts.steps_done.values()), "dropped_messages": hosts.dropped,
                  "notices": hosts.notices, "still_training": hosts.running()},
    }


def run_one(n: int, args: argparse.Namespace) -> dict:
    from benchmarks.fleet_world import ZONE, ScriptedHosts
    from orchestrator.emulator import running_emulator

    out = Path(tempfile.mkdtemp(prefix=f"fleet-{n}-"))
    with running_emulator(time_scale=args.time_scale, zones=(ZONE,)) as emu:
        counts: dict[str, int] = {}
        record = emu.record_request

        def counted(rec) -> None:
            counts[rec.method] = counts.get(rec.method, 0) + 1
            record(rec)

        emu.record_request = counted
        cmd = ["nice", "-n", "5", sys.executable, str(Path(__file__).resolve()), "--child", "--home", str(out),
               "--endpoint", emu.url, "--n", str(n), "--steps", str(args.steps), "--step-s", str(args.step_s),
               "--max-s", str(args.max_s), "--notice-every", str(args.notice_every),
               "--autoscale-every", str(args.autoscale_every), "--seed", str(args.seed),
               "--creates-per-minute", str(args.creates_per_minute),
               *(["--list-over", str(args.list_over)] if args.list_over is not None else []),
               *(["--profile-adoption"] if args.profile_adoption else [])]
        hosts = None
        if args.kill_controller:  # the groups here, where they outlive the controller's process
            hosts = ScriptedHosts(step_s=args.step_s, notice_every=args.notice_every, seed=args.seed)
            cmd += ["--hosts", hosts.address]
        weather, queries = Weather(emu, n, args.tick_s), Queries(out, args.query_every_s)
        log = open(out / "child.log", "wb")
        t0 = time.time()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        sampler = Sampler(proc.pid)
        threads = [sampler, queries, *([weather] if args.tick_s > 0 else [])]
        for t in threads:
            t.start()
        kill, first = None, None
        if hosts is not None:
            kill, proc = kill_and_restart(proc, cmd, out, n, hosts, args)
            sampler.done.set()
            first, sampler = sampler, Sampler(proc.pid)
            sampler.start()
            threads.append(sampler)
        try:
            proc.wait(timeout=args.max_s + 240)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        wall = time.time() - t0
        if proc.returncode != 0:
            print(f"the controller's process ended with {proc.returncode}; its log's end:\n"
                  + (out / ("adopter.log" if kill else "child.log")).read_text()[-3000:], flush=True)
        for t in threads:
            t.done.set()
        queries.join(timeout=150)
        with emu.world._cond:
            left_in_api = [q.name for q in emu.world._qrs.values() if q.state != "DELETING"]
        api_total = sum(counts.values())
    part = out / ("adopter.json" if kill else "child.json")
    childj = json.loads(part.read_text()) if part.exists() else {}
    db = out / "home" / "state.db"
    store = from_store(db, weather.reclaims)
    if kill is not None:
        kill = kill_figures(db, out, kill, hosts, args.steps)
        if first is not None and first.samples:
            kill["first_controller_rss_peak_mib"] = round(max(x[1] for x in first.samples) / 2**20, 1)
    size = sum(p.stat().st_size for p in db.parent.glob("state.db*"))
    samples = sampler.samples
    run_s = childj.get("run_s") or wall
    cpu_share = (samples[-1][2] - samples[0][2]) / (samples[-1][0] - samples[0][0]) if len(samples) > 1 else None
    q = {k: {"n": len(v), "p50_s": pct([x[0] for x in v], 0.5), "max_s": pct([x[0] for x in v], 1.0),
             "bytes_max": max((x[1] for x in v), default=None)} for k, v in queries.rows.items()}
    return {
        "jobs": n, "exit_code": proc.returncode, "wall_s": round(wall, 1), "run_s": run_s,
        "controller": {"rss_peak_mib": round(max(s[1] for s in samples) / 2**20, 1) if samples else None,
                       "rss_end_mib": round(samples[-1][1] / 2**20, 1) if samples else None,
                       "cpu_share": round(cpu_share, 3) if cpu_share is not None else None,
                       "threads_peak": max((s[3] for s in samples), default=None)},
        "store": {"bytes": size, "writes": childj.get("writes"),  # transactions
                  "writes_per_s": round(childj["writes"] / run_s, 1) if childj.get("writes") else None,
                  "writes_in_batches": childj.get("writes_in_batches"),
                  "events": store["events"], "step_rows": store["step_rows"]},
        "reclaim_to_next_request_s": store["reclaim_to_next_request_s"],
        "reclaim_seen_s": store["reclaim_seen_s"], "seen_to_next_request_s": store["seen_to_next_request_s"],
        "reclaimed": [(name, round(at, 3)) for name, at in weather.reclaims],
        "ready_to_launch_s": store["ready_to_launch_s"],
        "reclaims": len(weather.reclaims), "reclaims_without_next_request": store["reclaims_without_next_request"],
        "stockout_ticks": weather.stockout_ticks, "trace_ticks": weather.ticks, "notices": childj.get("notices"),
        "tpu_api": {"requests": api_total, "by_method": counts, "job_hours": round(store["job_hours"], 3),
                    "per_job_hour": round(api_total / store["job_hours"]) if store["job_hours"] else None,
                    "per_minute": round(api_total / (wall / 60), 1),
                    "creates_per_minute": round(counts.get("queuedResources.create", 0) / (wall / 60), 1),
                    "create_pace": childj.get("create_pace")},
        "queries": q, "query_errors": queries.errors[:10],
        "job_states": store["job_states"], "live_slices_in_store": store["live_slices_in_store"],
        "left_in_api": len(left_in_api), "event_kinds": store["event_kinds"],
        "child": childj, "dir": str(out), **({"kill": kill} if kill is not None else {}),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", default="10,100,300", help="N values, comma-separated")
    p.add_argument("--quick", action="store_true", help="N=5, 12 steps: a check that it runs")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--step-s", type=float, default=3.0)
    p.add_argument("--tick-s", type=float, default=10.0, help="wall seconds a trace tick lasts")
    p.add_argument("--time-scale", type=float, default=0.02, help="the emulator's (120 s provisioning -> 2.4 s)")
    p.add_argument("--max-s", type=float, default=420.0, help="then the jobs left are cancelled")
    p.add_argument("--notice-every", type=int, default=400, help="one notice per this many steps, about")
    p.add_argument("--autoscale-every", type=int, default=5, help="every k-th job autoscales")
    p.add_argument("--query-every-s", type=float, default=15.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--creates-per-minute", type=float, default=60.0,
                   help="the project's create pace (the provider's default); 0: none")
    p.add_argument("--list-over", type=int, default=None,
                   help="the gcp provider's Polling.list_over (default: its own); 1000000: a GET per slice per look, "
                        "as before the zone listing")
    p.add_argument("--kill-controller", action="store_true",
                   help="groups outside the controller; once all jobs run, SIGKILL it and start another (adoption)")
    p.add_argument("--kill-wait-s", type=float, default=900.0, help="the longest to wait for every job to run")
    p.add_argument("--kill-after-s", type=float, default=10.0, help="then this long before the kill")
    p.add_argument("--down-s", type=float, default=5.0, help="no controller runs for this long")
    p.add_argument("--profile-adoption", action="store_true",
                   help="sample the restarted controller's adoption pass (its stack every 20 ms)")
    p.add_argument("--out", default="fleet", help="results/<out>.json")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--adopt", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--hosts", help=argparse.SUPPRESS)
    p.add_argument("--home", help=argparse.SUPPRESS)
    p.add_argument("--endpoint", help=argparse.SUPPRESS)
    p.add_argument("--n", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    ns = [5] if args.quick else [int(x) for x in args.jobs.split(",")]
    if args.quick:
        args.steps, args.max_s, args.query_every_s, args.tick_s = 12, 120.0, 5.0, 5.0
    runs = []
    for n in ns:
        print(f"N={n} ...", flush=True)
        runs.append(run_one(n, args))
        print(json.dumps({k: runs[-1][k] for k in ("jobs", "controller", "reclaim_to_next_request_s", "tpu_api",
                                                   "job_states", "left_in_api", "live_slices_in_store", "kill")
                          if k in runs[-1]})[:4000], flush=True)
    load = os.getloadavg()
    save(args.out if not args.quick else args.out + "_quick", {
        "benchmark": "fleet", "machine": machine(), "load_average_at_end": [round(x, 1) for x in load],
        "settings": {k: getattr(args, k) for k in ("steps", "step_s", "tick_s", "time_scale", "max_s",
                                                    "notice_every", "autoscale_every", "seed", "list_over",
                                                    "creates_per_minute", "kill_controller", "kill_after_s",
                                                    "down_s", "profile_adoption")},
        "runs": runs})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
