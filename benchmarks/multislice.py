"""A lost slice of a multi-slice job against today's recovery of a one-slice job, on the local cluster.

Two jobs of the same model through the real controller, each with a host killed at step
`--kill-at` (the host's whole process group, SIGKILL: a vanished VM, no notice):

- `two_slices`: v4-16 x 2; the survivors go on from their memory. The program for one slice
  was never compiled on this machine before: it is compiled while the job trains
  (`workers.ahead`), and the kill comes once it is (`ahead_s`: how long that took, beside
  training). A user's first shrink.
- `one_slice`: one v4-16 (the baseline, today's recovery): a new slice, a restore from storage.

For each: the time from the kill to the first step done after it, to the disruption being
recorded, to the new generation starting, the restore and compile times, steps recomputed
and where the state came from; for the two-slice job also the copy's cost per step (what
`workers.memory` measured). The ratio is against `one_slice`, measured in the same run.

    python benchmarks/multislice.py [--steps 24] [--kill-at 10]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import fresh_client, machine, save, wait_until  # noqa: E402
from orchestrator import JobSpec, JobState  # noqa: E402
from orchestrator.cluster import kill_host  # noqa: E402


def spec(name: str, steps: int, slices: int) -> JobSpec:
    return JobSpec.from_dict({
        "name": name, "accelerator": "v4-16", "slices": slices,
        "workload": {"type": "lm", "steps": steps, "global_batch_size": 16, "seq_len": 64,
                     "model": {"d_model": 128, "n_layers": 2, "n_heads": 4, "d_ff": 512}},
        "checkpoint": {"interval_steps": 5}, "recovery": {"max_preemptions": 10}})


def disrupted(client, name: str, steps: int, slices: int, kill_at: int) -> dict:
    job = client.submit(spec(name, steps, slices))
    ahead = lambda: slices == 1 or any(e.kind == "ahead" for e in job.events())  # noqa: E731
    wait_until(lambda: job.status().state is JobState.RUNNING and job.status().step >= kill_at and ahead())
    live = sorted(client.store.slices(job_id=job.id, live_only=True), key=lambda r: r.name)
    killed, killed_step = time.time(), job.status().step
    kill_host(client.home, live[-1].data["pgids"][1])
    st = job.wait(timeout_s=900)
    assert st.state is JobState.SUCCEEDED, st.reason
    ev = job.events()
    after = [e for e in ev if e.at >= killed]
    first = lambda pred: next(e for e in after if pred(e))  # noqa: E731
    disruption = first(lambda e: e.kind == "disruption")
    starting = first(lambda e: e.to_state == "STARTING")
    restore = first(lambda e: e.kind == "restore")
    resumed = first(lambda e: e.kind == "resumed")
    lost = first(lambda e: e.kind == "lost_work")
    memory = [e for e in ev if e.kind == "memory"]
    compiled_ahead = [e for e in ev if e.kind == "ahead"]
    return {
        "kill_to_next_step_s": resumed.at - killed, "detect_s": disruption.at - killed,
        "kill_to_starting_s": starting.at - killed, "restore_s": restore.data["restore_s"],
        "compile_s": restore.data["compile_s"], "source": restore.data.get("source", "storage"),
        "steps_recomputed": lost.data["steps"], "restored_step": restore.data["restored_step"],
        "ahead_s": compiled_ahead[0].data["seconds"] if compiled_ahead else None,
        "killed_at_step": killed_step,
        "copy_every": memory[0].data["every"] if memory else None,
        "copy_s": memory[0].data["copy_s"] if memory else None,
        "copy_share_of_step": memory[0].data["copy_s"] / memory[0].data["step_s"] if memory else None,
        "timeline": [(round(e.at - killed, 2), e.kind, e.reason[:100]) for e in after[:12]],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--kill-at", type=int, default=10)
    args = p.parse_args()
    client = fresh_client()
    try:  # the two-slice job first: the one-slice job would leave the one-slice program in the cache
        runs = {"two_slices": disrupted(client, "two", args.steps, 2, args.kill_at),
                "one_slice": disrupted(client, "one", args.steps, 1, args.kill_at)}
    finally:
        client.down()
    result = {**runs, "ratio_to_one_slice": runs["two_slices"]["kill_to_next_step_s"] / runs["one_slice"][
                  "kill_to_next_step_s"],
              "steps": args.steps, "kill_at": args.kill_at, "machine": machine()}
    save("multislice", result)
    for name, r in runs.items():
        print(f"{name:18s} kill->next step {r['kill_to_next_step_s']:5.1f} s  (detect {r['detect_s']:.1f}, "
              f"starting {r['kill_to_starting_s']:.1f}, restore {r['restore_s']:.2f} from {r['source']}, "
              f"compile {r['compile_s']:.2f}), {r['steps_recomputed']} steps recomputed")
    print(f"ratio {result['ratio_to_one_slice']:.2f}; the one-slice program compiled ahead in "
          f"{runs['two_slices']['ahead_s']:.1f} s while the job trained")


if __name__ == "__main__":
    main()
