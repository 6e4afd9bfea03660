"""Soak: one job on a 2-host local slice survives N random disruptions, and ends as the undisturbed run.

Disruptions, chosen at random moments (seeded): SIGKILL of one worker process, a whole
host vanishing, a preemption notice from a fake metadata server, and the controller
killed. After each, the job must recover on its own. Reported: committed steps lost
(a restore to a step older than the newest committed checkpoint at the time of the
disruption; must be 0), steps recomputed, and whether the final per-step losses and
parameters equal the undisturbed run's.

    python benchmarks/soak.py [--disruptions 50] [--seed 0]
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402

from benchmarks.common import fresh_client, machine, save, wait_until  # noqa: E402
from orchestrator import JobSpec, JobState  # noqa: E402
from orchestrator.cluster import kill_host  # noqa: E402
from orchestrator.emulator.metadata import FakeMetadataServer  # noqa: E402

KINDS = ("kill_worker", "kill_host", "notice", "kill_controller")


def spec(name: str, steps: int, metadata_url: str) -> JobSpec:
    return JobSpec.from_dict({
        "name": name, "accelerator": "v4-16",
        "workload": {"type": "lm", "steps": steps, "global_batch_size": 16, "seq_len": 32,
                     "model": {"d_model": 128, "n_layers": 2, "n_heads": 4, "d_ff": 512}},
        "checkpoint": {"interval_steps": 5, "keep": 3},
        "recovery": {"max_preemptions": 10_000, "metadata_url": metadata_url}})


def committed(ckpt: Path) -> int:
    steps = [int(p.name) for p in ckpt.iterdir() if p.name.isdigit()] if ckpt.exists() else []
    return max(steps, default=0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--disruptions", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    steps = 6 * args.disruptions + 20  # room for every disruption to land mid-run
    metadata = FakeMetadataServer()
    client = fresh_client()
    done_kinds: list[str] = []
    lost_committed = 0
    try:
        ref = client.submit(spec("soak-ref", steps, metadata.url))
        assert ref.wait(timeout_s=3600).state is JobState.SUCCEEDED
        job = client.submit(spec("soak", steps, metadata.url))
        ckpt = Path(job.record().spec.checkpoint.directory)
        for i in range(args.disruptions):
            target = min(steps - 5, job.status().step + rng.randint(1, 3))
            wait_until(lambda: (job.status().state is JobState.RUNNING and job.status().step >= target)
                 or job.status().done)
            if job.status().done:
                break
            time.sleep(rng.uniform(0, 0.5))  # mid-step, mid-save, whatever comes
            kind = rng.choice(KINDS)
            before = committed(ckpt)
            n_restores = len([e for e in job.events() if e.kind == "restore"])
            live = client.store.slices(job_id=job.id, live_only=True)
            if kind == "kill_worker":
                os.kill(rng.choice([e for e in job.events() if e.kind == "launched"][-1].data["pids"]), signal.SIGKILL)
            elif kind == "kill_host":
                kill_host(client.home, rng.choice(live[0].data["pgids"]))
            elif kind == "notice":
                seen = len([e for e in job.events() if e.kind == "disruption"])
                metadata.set("instance/preempted", "TRUE")
                wait_until(lambda: len([e for e in job.events() if e.kind == "disruption"]) > seen)
                metadata.set("instance/preempted", "FALSE")
            else:
                adopted = len([e for e in job.events() if e.kind == "adopted"])
                ray.kill(client.controller(), no_restart=False)
                done_kinds.append(kind)
                wait_until(lambda: len([e for e in job.events() if e.kind in ("adopted", "restore")]) >
                           adopted + n_restores or job.status().done)
                print(f"disruption {i + 1}: {kind}", flush=True)
                continue
            done_kinds.append(kind)
            wait_until(lambda: len([e for e in job.events() if e.kind == "restore"]) > n_restores)
            restored = [e for e in job.events() if e.kind == "restore"][-1].data["restored_step"] or 0
            lost_committed += max(0, before - restored)
            print(f"disruption {i + 1}: {kind}; committed {before}, restored {restored}", flush=True)
        st = job.wait(timeout_s=3600)
        ok = st.state is JobState.SUCCEEDED
        ref_losses = [m.loss for m in ref.metrics()]
        losses = [m.loss for m in job.metrics()]
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) if len(losses) == len(ref_losses) else None
        rp, jp = ref.record().result["param_sums"], (job.record().result or {}).get("param_sums") or {}
        params_equal = bool(jp) and all(abs(jp[k] - rp[k]) <= 1e-5 * max(1, abs(rp[k])) for k in rp)
        recomputed = sum(e.data["steps"] for e in job.events() if e.kind == "lost_work")
    finally:
        client.down()
        metadata.close()
    save("soak", {"disruptions": len(done_kinds), "by_kind": {k: done_kinds.count(k) for k in KINDS},
                  "job_succeeded": ok, "committed_steps_lost": lost_committed, "steps_recomputed": recomputed,
                  "max_loss_rel_diff": worst, "final_params_equal": params_equal, "steps": steps,
                  "seed": args.seed, "machine": machine()})


if __name__ == "__main__":
    main()
