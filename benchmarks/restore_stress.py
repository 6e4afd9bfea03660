"""Restore stress: a 4-host job restored again and again, saving every 2 steps, on a busy CPU.

One job of the built-in trainer on a local v4-32 slice (4 hosts of 4 CPU devices, over
gloo) with ``checkpoint.interval_steps: 2``. Two busy loops keep both cores loaded for
the whole run. Each cycle waits for a few steps after the last restore, then disrupts:
a preemption notice (every host stops after one step, that step committed) and a host
vanishing (SIGKILL of its node; the last committed save is restored), in turn. After the
last cycle the job runs to its end. Reported: worker aborts and every gloo error in the
job's log (must be none), how each attempt ended, the restored steps, and whether the
per-step losses and final parameters equal an undisturbed single-process run (1e-5).

    python benchmarks/restore_stress.py [--cycles 10] [--busy 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import fresh_client, machine, save, wait_until  # noqa: E402
from orchestrator import JobSpec, JobState  # noqa: E402
from orchestrator.cluster import kill_host  # noqa: E402
from orchestrator.emulator.metadata import FakeMetadataServer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
INTERVAL = 2
STEPS_PER_CYCLE = 4
GLOO_WORDS = ("enforce fail", "gloo/transport", "collective mismatch")


def spec(name: str, steps: int, metadata_url: str) -> JobSpec:
    return JobSpec.from_dict({
        "name": name, "accelerator": "v4-32",
        "workload": {"type": "lm", "steps": steps, "global_batch_size": 16, "seq_len": 32,
                     "model": {"d_model": 128, "n_layers": 2, "n_heads": 4, "d_ff": 512},
                     "learning_rate": {"warmup_steps": 2}},
        "checkpoint": {"interval_steps": INTERVAL, "keep": 3},
        "recovery": {"max_preemptions": 1000, "max_aborts": 0, "start_timeout_s": 300,
                     "heartbeat_timeout_s": 300, "metadata_url": metadata_url}})


def reference(job_spec: JobSpec, tmp: Path) -> dict:
    """The same training in one plain process with as many devices, nothing disturbing it."""
    from orchestrator.control.launch import launch_order

    t = job_spec.tpu_type
    order = launch_order(job_spec, t.chips, t.hosts)
    order = dataclasses.replace(order, settings=dataclasses.replace(order.settings, checkpoint_dir=None))
    (tmp / "order.pkl").write_bytes(pickle.dumps(order))
    subprocess.run([sys.executable, "-m", "workers.reference", "--order", str(tmp / "order.pkl"), "--devices",
                    str(t.chips), "--out", str(tmp / "ref.json")], check=True, cwd=REPO, timeout=1800)
    return json.loads((tmp / "ref.json").read_text())


def busy_loops(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def events(job, kind: str) -> list:
    return [e for e in job.events() if e.kind == kind]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cycles", type=int, default=10)
    p.add_argument("--busy", type=int, default=2, help="busy loops beside the job (default: 2, one per core here)")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a time limit still stops the busy loops and the cluster
    steps = STEPS_PER_CYCLE * args.cycles + 8
    tmp = Path(tempfile.mkdtemp(prefix="restore-stress-"))
    metadata = FakeMetadataServer()
    job_spec = spec("restore-stress", steps, metadata.url)
    t0 = time.monotonic()
    ref = reference(job_spec, tmp)
    loops = busy_loops(args.busy)
    client = fresh_client()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # again: connecting to Ray set a handler of its own
    cycles: list[dict] = []
    try:
        job = client.submit(job_spec)
        for i in range(args.cycles):
            wait_until(lambda: job.status().state is JobState.RUNNING or job.status().done, timeout_s=900)
            base = (events(job, "restore")[-1].data.get("restored_step") or 0) if events(job, "restore") else 0
            target = min(steps - 3, base + 3)
            wait_until(lambda: (job.status().state is JobState.RUNNING and job.status().step >= target)
                       or job.status().done, timeout_s=900)
            if job.status().done:
                break
            restores = len(events(job, "restore"))  # this attempt's own restore is in by now: it ran steps
            kind = "notice" if i % 2 == 0 else "kill_host"
            seen = len(events(job, "disruption"))
            if kind == "notice":
                metadata.set("instance/preempted", "TRUE")
                wait_until(lambda: len(events(job, "disruption")) > seen or job.status().done, timeout_s=300)
                metadata.set("instance/preempted", "FALSE")
            else:
                live = client.store.slices(job_id=job.id, live_only=True)
                kill_host(client.home, live[0].data["pgids"][i % len(live[0].data["pgids"])])
            wait_until(lambda: len(events(job, "restore")) > restores or job.status().done, timeout_s=900)
            d = events(job, "disruption")[seen:]
            restored = events(job, "restore")[-1].data.get("restored_step")
            cycles.append({"kind": kind, "ended_as": [e.data["kind"] for e in d], "restored_step": restored})
            print(f"cycle {i + 1}: {kind} -> {[e.data['kind'] for e in d]}, restored step {restored}", flush=True)
        st = job.wait(timeout_s=1800)
        losses = [m.loss for m in job.metrics()]
        logs = job.logs()
        disruptions = events(job, "disruption")
        result = (job.record().result or {}).get("param_sums") or {}
    finally:
        for proc in loops:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        client.down()
        metadata.close()
    worst = (max(abs(a - b) / abs(b) for a, b in zip(losses, ref["losses"]))
             if len(losses) == len(ref["losses"]) else None)
    params_equal = bool(result) and all(abs(result[k] - v) <= 1e-5 * max(1.0, abs(v))
                                        for k, v in ref["param_sums"].items())
    gloo_lines = [ln for ln in logs.splitlines() if any(w in ln for w in GLOO_WORDS)]
    save("restore_stress", {
        "cycles": len(cycles), "hosts": job_spec.tpu_type.hosts, "interval_steps": INTERVAL, "steps": steps,
        "busy_loops": args.busy, "job_state": st.state.value, "reason": st.reason,
        "worker_aborts": sum(1 for e in disruptions if e.data["kind"] == "worker_aborted"),
        "disruptions": [{"kind": e.data["kind"], "reason": e.reason[:300]} for e in disruptions],
        "gloo_errors_in_log": gloo_lines[:20], "per_cycle": cycles,
        "losses_equal_reference": worst is not None and worst <= 1e-5, "max_loss_rel_diff": worst,
        "final_params_equal": params_equal, "wall_s": round(time.monotonic() - t0, 1), "machine": machine()})
    ok = st.state is JobState.SUCCEEDED and not gloo_lines and worst is not None and worst <= 1e-5
    print(f"restore stress: {len(cycles)} restore cycles on {job_spec.tpu_type.hosts} hosts, job {st.state.value}, "
          f"{sum(1 for e in disruptions if e.data['kind'] == 'worker_aborted')} worker aborts, "
          f"{len(gloo_lines)} gloo errors, losses {'equal' if worst is not None and worst <= 1e-5 else 'DIFFER'} "
          f"(max rel diff {worst}), params {'equal' if params_equal else 'DIFFER'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
