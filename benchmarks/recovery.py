"""Recovery after a host dies on a 2-host local slice, and goodput under repeated host loss.

For each kill (the host's whole process group, SIGKILL: a vanished VM) it measures the
time to detect it, to tear the old group down (stop the surviving hosts, release the
slice), to provision a new slice, to bring up the runtime, to restore, to
compile, and from the death to the first step completed after the restore. Goodput is
productive step time over wall time, for a run with a host killed every N steps and for
the same run undisturbed, measured in the same session.

    python benchmarks/recovery.py [--steps 40] [--every 10]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import RESULTS, fresh_client, machine, save, wait_until  # noqa: E402
from orchestrator import JobSpec, JobState  # noqa: E402
from orchestrator.cluster import kill_host  # noqa: E402


def spec(name: str, steps: int) -> JobSpec:
    return JobSpec.from_dict({
        "name": name, "accelerator": "v4-16",
        "workload": {"type": "lm", "steps": steps, "global_batch_size": 16, "seq_len": 64,
                     "model": {"d_model": 128, "n_layers": 2, "n_heads": 4, "d_ff": 512}},
        "checkpoint": {"interval_steps": 5}, "recovery": {"max_preemptions": 100}})


def goodput(job) -> float:
    events = job.events()
    wall = events[-1].at - events[0].at
    return sum(m.step_time_s for m in job.metrics()) / wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=10, help="kill a host every N steps")
    args = p.parse_args()
    client = fresh_client()
    try:
        undisturbed = client.submit(spec("undisturbed", args.steps))
        assert undisturbed.wait(timeout_s=900).state is JobState.SUCCEEDED
        job = client.submit(spec("disrupted", args.steps))
        kills = []
        for target in range(args.every, args.steps, args.every):
            wait_until(lambda: job.status().state is JobState.RUNNING and job.status().step >= target)
            live = client.store.slices(job_id=job.id, live_only=True)[0]
            kills.append(time.time())
            kill_host(client.home, live.data["pgids"][1])
            wait_until(lambda: len([e for e in job.events() if e.kind == "resumed"]) == len(kills))
        st = job.wait(timeout_s=900)
        assert st.state is JobState.SUCCEEDED, st.reason
        ev = job.events()
        disruptions = [e for e in ev if e.kind == "disruption"]
        starting = [e for e in ev if e.to_state == "STARTING"][1:]
        running = [e for e in ev if e.to_state == "RUNNING"][1:]
        restores = [e for e in ev if e.kind == "restore"][1:]
        resumed = [e for e in ev if e.kind == "resumed"]
        per_kill = {
            "detect_s": [d.at - k for d, k in zip(disruptions, kills)],
            "teardown_s": [d.data.get("teardown_s", 0.0) for d in disruptions],
            "provision_s": [e.data["provision_s"] for e in starting],
            "init_s": [e.data["init_s"] for e in running],
            "restore_s": [e.data["restore_s"] for e in restores],
            "compile_s": [e.data["compile_s"] for e in restores],
            "first_step_after_restore_s": [r.at - k for r, k in zip(resumed, kills)],
        }
        from orchestrator.observe.report import write_report

        write_report(client.store, job.id, RESULTS / "recovery-report.png", force=True)  # the README's picture
    finally:
        client.down()
    result = {k: statistics.median(v) for k, v in per_kill.items()}
    result.update(goodput_disrupted=goodput(job), goodput_undisturbed=goodput(undisturbed), kills=len(kills),
                  per_kill=per_kill, steps=args.steps, kill_every_steps=args.every, machine=machine())
    save("recovery", result)


if __name__ == "__main__":
    main()
