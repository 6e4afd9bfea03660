"""The liveness rule under load, both sides: no false loss in a long soak, and every silent kill seen.

On share-nothing hosts (the GCP provider against the TPU API emulator, whose nodes are VMs that see none of
this machine's files, checkpoints in the Cloud Storage emulator's bucket: `benchmarks.multislice.share_nothing`),
with busy processes keeping every core of this machine at 100% from the first step of phase (a) to the end:

(a) the soak: a two-slice job (v4-16 x 2, four hosts) trains for `--minutes` with its hosts' beats on and no
    host killed. Every disruption is a false loss (`orchestrator.control.liveness` states the rule: no beat
    for 1 s AND two failed probes of the node). `--minutes 0`: no soak.
(b) the kills: a job loses host 1 of its first slice `--kills` times, each time its VM powered off silently
    (processes frozen, no reset: `EmulatedVm.silence`). Each loss must be seen by the beats (the disruption's
    reason says "no beat for"); the survivors go on from their memory and the job regrows to two slices
    before the next kill. Once the last kill is behind it, it is cancelled,
    and its per-step losses from step 0 to there are compared with those of the reference (1e-5 relative, as
    tests/chaos/test_multislice.py), the same spec trained undisturbed as a second job on four VMs of its own:
    by default (`--reference after`) once the kills are done and the busy processes stopped, until it passes
    the killed job's last step, so that no four more VMs share the cores while the killed job's fresh VMs boot
    (beside it, a VM's Ray node missed Ray's fixed 30 s to register at a load of 30); `--reference beside`:
    beside the killed job from the start (its disruptions are false losses too). Not a one-process reference:
    the learning rate decays over the spec's `steps`, which such a reference would have to train in full
    (one asked for only the killed job's steps follows another schedule: 6.5e-2 apart by step 515). The
    killed job asks for `--steps` steps, more than it trains.
    No new kill after `--kill-minutes`. The burners yield (niceness 19, the cores still busy) while a job's
    fresh VMs boot (`Burners`); each kill, its detection and the survivors' next step come at their full share.

    python benchmarks/liveness_soak.py [--minutes 30] [--kills 10] [--steps 100000] [--burners 2]

Writes results/liveness_soak.json (phase (a) as soon as it ends, then both): minutes, burners, the load
average and step each minute, the false losses with their reasons, each kill's detect_s, kill-to-next-step
and steps recomputed, and the largest per-step loss difference from the reference.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import fresh_client, machine, save, wait_until  # noqa: E402
from benchmarks.multislice import Vms, share_nothing  # noqa: E402
from orchestrator import JobSpec, JobState  # noqa: E402
from orchestrator.errors import JobStateError  # noqa: E402

RTOL = 1e-5  # per-step losses against the undisturbed run, as tests/chaos/test_multislice.py
POLL_S = 0.5  # the events carry their times: polling faster measures nothing better and loads the machine
RULE = "lost only when silent for 1 s and two probes of its node 0.2 s apart both fail (0.4 s each)"
HOSTS = "share-nothing VMs (gcp provider, emulated TPU API and bucket), v4-16 x 2: four hosts a job"


def spec(name: str, steps: int, world: Vms, *, interval: int) -> JobSpec:
    return JobSpec.from_dict({
        "name": name, "accelerator": "v4-16", "slices": 2, "provider": "gcp", "gcp": world.gcp,
        "storage": {"endpoint": world.storage.url},
        "workload": {"type": "lm", "steps": steps, "global_batch_size": 16, "seq_len": 32,
                     "model": {"d_model": 64, "n_layers": 2, "n_heads": 2, "d_ff": 256},
                     "learning_rate": {"warmup_steps": 2}},
        # A copy in memory every step: a lost slice loses no step.
        "checkpoint": {"interval_steps": interval, "keep": 2, "memory_interval_steps": 1,
                       "directory": f"gs://bench/{name}-{secrets.token_hex(3)}"},
        # A fresh VM's Ray node may miss Ray's 30 s to register on this loaded machine: it is tried again
        # (`START_RETRIES`), and a slice gets 15 minutes to come up.
        "recovery": {"max_preemptions": 100, "start_timeout_s": 900}})


def events(job, kind: str, after: float = 0.0) -> list:
    return [e for e in job.events() if e.kind == kind and e.at >= after]


def disruptions(job, since: float) -> list[dict]:
    return [{"after_s": round(e.at - since, 2), "step": e.data.get("step"), "kind": e.data.get("kind"),
             "reason": e.reason} for e in events(job, "disruption")]


def back_on_two_slices(job, after: float, gap: int) -> float | None:
    """Wait until the job's newest launch, made after `after` (wall clock), is on four hosts (two slices) and
    has trained `gap` steps since it was seen; when it was launched (None if the job ended first)."""
    def four_hosts():
        launched = events(job, "launched")
        return launched and launched[-1].at >= after and len(launched[-1].data.get("nodes") or ()) == 4

    wait_until(lambda: job.status().done or four_hosts(), timeout_s=900, poll_s=POLL_S)
    if job.status().done:
        return None
    at, base = events(job, "launched")[-1].at, job.status().step
    wait_until(lambda: job.status().done or job.status().step >= base + gap, timeout_s=900, poll_s=POLL_S)
    return None if job.status().done else at


def end(job) -> None:
    """Cancel the job unless it has ended (on its own, or cancelled from outside), and wait until it has."""
    try:
        job.cancel()
    except JobStateError:  # it ended first
        pass
    wait_until(lambda: job.status().done, timeout_s=300, poll_s=POLL_S)


def losses(job) -> dict[int, float]:
    return {m.step: m.loss for m in job.metrics()}


def max_relative_difference(got: dict[int, float], want: dict[int, float]) -> float:
    """The largest |got - want| / |want| over the steps `got` ran, from step 0 on; inf if `got` ran none, skipped
    one, or ran one `want` did not."""
    if not got or set(got) != set(range(max(got) + 1)) or not set(got) <= set(want):
        return float("inf")
    return max(abs(got[s] - want[s]) / abs(want[s]) for s in got)


def spread(values: list[float]) -> dict:
    """min, median and max, rounded (None each if there are none)."""
    if not values:
        return {"min": None, "median": None, "max": None}
    return {"min": round(min(values), 2), "median": round(statistics.median(values), 2), "max": round(max(values), 2)}


class Burners:
    """Busy processes, one per core, at this process's niceness; `yielding` lowers them to the lowest priority
    (the cores stay busy) while fresh VMs boot: at an equal share, a new VM's Ray node missed Ray's 30 s to
    register (three tries a host), and the quick run's second job never got its slices up in 5 minutes."""

    def __init__(self, count: int):
        self.count, self.procs = count, []
        self.nice = os.getpriority(os.PRIO_PROCESS, 0)

    def start(self) -> None:
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(self.count)]

    def renice(self, nice: int) -> None:
        for b in self.procs:
            os.setpriority(os.PRIO_PROCESS, b.pid, nice)

    @contextlib.contextmanager
    def yielding(self):
        self.renice(19)
        try:
            yield
        finally:
            self.renice(self.nice)

    def stop(self) -> None:
        for b in self.procs:
            b.kill()
            b.wait()
        self.procs = []


def soak(client, world: Vms, minutes: float, burners: Burners) -> dict:
    """Phase (a): the soak's figures. The burners start once it trains, and stay on."""
    job = client.submit(spec("soak", 1_000_000, world, interval=200))
    wait_until(lambda: job.status().state is JobState.RUNNING and job.status().step >= 1 or job.status().done,
               timeout_s=900, poll_s=POLL_S)
    burners.start()
    started, wall, first_step = time.monotonic(), time.time(), job.status().step
    each_minute = []
    while (elapsed := time.monotonic() - started) < minutes * 60:
        time.sleep(min(60.0, minutes * 60 - elapsed))
        each_minute.append({"minute": round((time.monotonic() - started) / 60, 2),
                            "load_avg_1min": round(os.getloadavg()[0], 2), "step": job.status().step})
        print(f"soak: {each_minute[-1]}", flush=True)
    ran_s = time.monotonic() - started
    steps_done = job.status().step - first_step
    end(job)
    false = disruptions(job, wall)
    return {"minutes": round(ran_s / 60, 2), "steps_done": steps_done, "each_minute": each_minute,
            "load_avg_1min": spread([m["load_avg_1min"] for m in each_minute]),
            "false_losses": len(false), "disruptions": false}


def one_kill(client, world: Vms, job, gap: int, burners: Burners) -> dict:
    """Host 1 of the job's first slice powered off silently, the burners at their full share; the figures of
    that loss, once the job is back on two slices `gap` steps (the burners yielding while the new VMs boot)."""
    live = sorted(client.store.slices(job_id=job.id, live_only=True), key=lambda r: r.name)
    killed, killed_step = time.time(), job.status().step
    world.backing.power_off(live[0].name, 1, silent=True)  # type: ignore[attr-defined]
    wait_until(lambda: events(job, "resumed", killed) or job.status().done, timeout_s=300, poll_s=POLL_S)
    disruption = events(job, "disruption", killed)
    resumed = events(job, "resumed", killed)
    lost = events(job, "lost_work", killed)
    restore = events(job, "restore", killed)
    load = round(os.getloadavg()[0], 2)
    with burners.yielding():
        regrown = back_on_two_slices(job, killed, gap)
    d = disruption[0] if disruption else None
    return {"killed_at_step": killed_step, "slice": live[0].name,
            "detected_by_beats": d is not None and "no beat for" in d.reason and d.data.get("kind") == "infra_lost",
            "detect_s": round(d.at - killed, 2) if d else None, "disruption": d.reason if d else None,
            "kill_to_next_step_s": round(resumed[0].at - killed, 2) if resumed else None,
            "steps_recomputed": lost[0].data.get("steps") if lost else None,
            "source": restore[0].data.get("source", "storage") if restore else None,
            "load_avg_1min_at_next_step": load,
            "kill_to_two_slices_s": round(regrown - killed, 2) if regrown else None,
            "disruptions_until_then": len(events(job, "disruption", killed))}


def kills(client, world: Vms, n: int, steps: int, gap: int, burners: Burners, budget_min: float, *,
          beside: bool) -> dict:
    """Phase (b): `n` silent kills of one job (no new kill after `budget_min` minutes); its losses, step by step
    from 0 to where it is cancelled after the last kill, against those of the reference: the same job undisturbed
    on VMs of its own (`beside` it from the start, or after the kills until it passes the killed job's steps)."""
    killed_spec = spec("kills", steps, world, interval=50)
    job = client.submit(killed_spec)
    reference = client.submit(spec("reference", steps, world, interval=50)) if beside else None
    wall = time.time()
    if not burners.procs:  # no soak before
        burners.start()
    with burners.yielding():  # their VMs boot; the survivors' program compiled ahead before the first kill
        wait_until(lambda: {e.data["host"] for e in events(job, "ahead")} >= {0, 2} or job.status().done,
                   timeout_s=900, poll_s=POLL_S)
        ready = back_on_two_slices(job, 0.0, gap) is not None
    done: list[dict] = []
    while ready and len(done) < n and time.time() - wall < budget_min * 60:
        try:
            done.append(one_kill(client, world, job, gap, burners))
        except TimeoutError as e:  # recorded, not hidden: the job never went on (or never regrew)
            done.append({"error": f"kill {len(done) + 1}: {e}", "detected_by_beats": False,
                         "kill_to_next_step_s": None, "kill_to_two_slices_s": None, "steps_recomputed": None})
        print(f"kill {len(done)}: {done[-1]}", flush=True)
        ready = done[-1]["kill_to_two_slices_s"] is not None
    end(job)
    got = losses(job)
    burners.stop()  # the reference's speed is not measured
    if reference is None:  # after the kills, the same spec (its learning rate decays over `steps`): cancelled
        reference = client.submit(spec("reference", steps, world, interval=50))  # once past the killed job's steps
    wait_until(lambda: reference.status().done or reference.status().step > max(got, default=0),
               timeout_s=1800, poll_s=POLL_S)
    end(reference)
    want, ref_false = losses(reference), disruptions(reference, wall)
    ref = {"kind": "the same spec as a second job on four VMs of its own, " + (
               "beside the killed one" if beside else "after the kills, the busy processes stopped"),
           "steps_done": reference.status().step, "false_losses": len(ref_false), "disruptions": ref_false}
    diff = max_relative_difference(got, want)
    all_disruptions = disruptions(job, wall)
    detected = [k for k in done if k["detected_by_beats"]]
    return {"steps_compared": len(got), "minutes": round((time.time() - wall) / 60, 2), "budget_minutes": budget_min,
            "kills_asked": n, "kills_done": len(done), "detected_by_beats": len(detected),
            "detect_s": spread([k["detect_s"] for k in detected]),
            "kill_to_next_step_s": spread([k["kill_to_next_step_s"] for k in done if k["kill_to_next_step_s"]]),
            "kill_to_two_slices_s": spread([k["kill_to_two_slices_s"] for k in done if k["kill_to_two_slices_s"]]),
            "steps_recomputed": [k["steps_recomputed"] for k in done],
            "disruptions_not_from_a_kill": len(all_disruptions) - len(done), "disruptions": all_disruptions,
            "loss_max_relative_difference": diff if diff != float("inf") else "different steps",
            "losses_equal_reference": diff <= RTOL, "rtol": RTOL,
            "reference_job": ref,
            "per_kill": done}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--kills", type=int, default=10)
    p.add_argument("--steps", type=int, default=100_000,
                   help="the killed job's and the reference's spec (both are cancelled once the kills are done)")
    p.add_argument("--kill-minutes", type=float, default=40.0, help="no new kill after this long in phase (b)")
    p.add_argument("--gap", type=int, default=5, help="steps on two slices between a regrow and the next kill")
    p.add_argument("--reference", choices=["after", "beside"], default="after",
                   help="what the killed job's losses are compared with (see the module's docstring)")
    p.add_argument("--burners", type=int, default=os.cpu_count() or 2, help="busy processes (one per core)")
    p.add_argument("--name", default="liveness_soak", help="results/NAME.json")
    args = p.parse_args()
    client = fresh_client()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # ended early: the burners and the cluster still go
    burners = Burners(args.burners)
    result: dict = {"hosts": HOSTS, "burners": args.burners, "burners_nice": burners.nice, "rule": RULE,
                    "machine": machine()}
    down = False
    try:
        with share_nothing(client) as world:
            world.backing.START_RETRIES = 10  # type: ignore[attr-defined]  # 3 by default: see `spec`
            try:
                if args.minutes:
                    result["soak"] = soak(client, world, args.minutes, burners)
                    save(args.name, result)
                if args.kills:
                    result["kills"] = kills(client, world, args.kills, args.steps, args.gap, burners,
                                            args.kill_minutes, beside=args.reference == "beside")
            finally:
                burners.stop()
                client.down()  # while the emulator answers: the jobs' slices are released through it
                down = True
    finally:
        burners.stop()
        if not down:
            client.down()
    save(args.name, result)
    if "soak" in result:
        s = result["soak"]
        print(f"soak: {s['minutes']} min, {args.burners} busy processes, load {s['load_avg_1min']}: "
              f"{s['steps_done']} steps, {s['false_losses']} false losses")
    if "kills" in result:
        k = result["kills"]
        print(f"kills: {k['detected_by_beats']}/{k['kills_done']} seen by the beats, detect {k['detect_s']}, kill to "
              f"next step {k['kill_to_next_step_s']}, {k['disruptions_not_from_a_kill']} disruptions not from a "
              f"kill, reference job {k['reference_job']['false_losses']} false losses, steps recomputed "
              f"{k['steps_recomputed']}, losses vs reference over {k['steps_compared']} steps: "
              f"{k['loss_max_relative_difference']} ({'equal' if k['losses_equal_reference'] else 'DIFFER'})")


if __name__ == "__main__":
    main()
