"""Throughput on 1, 2 and 4 local hosts, and where the time from submit to the first step goes.

The same model and global batch on v4-8 (1 host), v4-16 (2 hosts) and v4-32 (4 hosts).
On this machine every "host" shares the same 2 cores, so tokens/s is not expected to
grow with hosts; the figures show what the multi-host machinery costs (gloo
collectives between processes) and how long each phase of bring-up takes.

    python benchmarks/scaling.py [--steps 20]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import fresh_client, machine, save, steady_tokens_per_s  # noqa: E402
from orchestrator import JobSpec, JobState  # noqa: E402

TYPES = {"1": "v4-8", "2": "v4-16", "4": "v4-32"}


def phases(job) -> dict:
    events = job.events()
    starting = next(e for e in events if e.to_state == "STARTING")
    running = next(e for e in events if e.to_state == "RUNNING")
    restore = next(e for e in events if e.kind == "restore")
    first = job.metrics()[0]
    created = events[0].at
    return {"provision_s": starting.data["provision_s"], "init_s": running.data["init_s"],
            "compile_s": restore.data["compile_s"], "restore_s": restore.data["restore_s"],
            "first_step_s": first.step_time_s, "total_s": first.at - created}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    client = fresh_client()
    out: dict = {"machine": machine()}
    try:
        for hosts, accel in TYPES.items():
            spec = JobSpec.from_dict({
                "name": f"scaling-{hosts}", "accelerator": accel,
                "workload": {"type": "lm", "steps": args.steps, "global_batch_size": 32, "seq_len": 128,
                             "model": {"d_model": 128, "n_layers": 2, "n_heads": 4, "d_ff": 512}},
                "checkpoint": {"interval_steps": args.steps}})
            job = client.submit(spec)
            st = job.wait(timeout_s=900)
            assert st.state is JobState.SUCCEEDED, st.reason
            ph = phases(job)
            out[hosts] = {"accelerator": accel,
                          "tokens_per_s": steady_tokens_per_s([m.step_time_s for m in job.metrics()],
                                                              32 * 128),
                          "submit_to_first_step_s": ph}
            print(hosts, out[hosts], flush=True)
    finally:
        client.down()
    save("scaling", out)


if __name__ == "__main__":
    main()
