"""A lost slice of a multi-slice job against today's recovery of a one-slice job, on the local cluster.

Two jobs of the same model through the real controller, each with host 1 of its first slice
killed at step `--kill-at` or later (the host's whole process group, SIGKILL; with `--vms`, the
VM powered off silently, as a host that loses power: its processes frozen, so its peers see no reset
and no answer; `--reset` powers it off as before, its sockets reset: no notice either way):

- `two_slices`: v4-16 x 2; the survivors go on from their memory. The program for one slice
  was never compiled on this machine before: it is compiled while the job trains
  (`workers.ahead`), and the kill comes once it is (`ahead_s`: how long that took, beside
  training). A user's first shrink. Slice 0 is the one lost, so the survivors' process 0 is
  slice 1's first host, which has the program only from host 0 (on share-nothing VMs, whose
  disks are their own, through the runtime's key-value store).
- `one_slice`: one v4-16 (the baseline, today's recovery): a new slice, a restore from storage.

For each: the time from the kill to the first step done after it, to the disruption being
recorded (`detect_s`; `detected_by`: the hosts' beats and a probe, or Ray), to the new generation
starting, the restore and compile times, steps recomputed
and where the state came from; for the two-slice job also the copy's cost per step (what
`workers.memory` measured). The ratio is against `one_slice`, measured in the same run.

    python benchmarks/multislice.py [--steps 24] [--kill-at 10] [--vms]

`--vms`: the same on share-nothing hosts, as a user on GCP meets it: the GCP provider against
the TPU API emulator, whose nodes are VMs that see none of this machine's files, with
checkpoints in the Cloud Storage emulator's bucket (results/multislice_vms.json; with `--reset`,
results/multislice_vms_reset.json).
"""

from __future__ import annotations

import argparse
import contextlib
import secrets
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import fresh_client, machine, save, wait_until  # noqa: E402
from orchestrator import JobSpec, JobState  # noqa: E402
from orchestrator.cluster import kill_host  # noqa: E402


def spec(name: str, steps: int, slices: int, world: "Vms | None" = None, spares: bool | None = None) -> JobSpec:
    where = {} if world is None else {
        "provider": "gcp", "gcp": world.gcp, "storage": {"endpoint": world.storage.url},
        "checkpoint": {"interval_steps": 5, "directory": f"gs://bench/{name}-{secrets.token_hex(3)}"}}
    return JobSpec.from_dict({
        "name": name, "accelerator": "v4-16", "slices": slices,
        "workload": {"type": "lm", "steps": steps, "global_batch_size": 16, "seq_len": 64,
                     "model": {"d_model": 128, "n_layers": 2, "n_heads": 4, "d_ff": 512}},
        "checkpoint": {"interval_steps": 5}, "recovery": {"max_preemptions": 10, "spare_workers": spares}, **where})


@dataclass
class Vms:
    """Share-nothing hosts: the TPU API emulator's nodes are VMs that see none of this machine's files
    (`orchestrator.emulator.vm`), checkpoints in the Cloud Storage emulator's bucket."""

    backing: object
    emulator: object
    storage: object
    gcp: dict


@contextlib.contextmanager
def share_nothing(client):
    from orchestrator.cluster import read_cluster
    from orchestrator.emulator.ray_backing import RayBackedNodes
    from orchestrator.emulator.server import serve
    from orchestrator.emulator.storage import running_storage

    token = client.home.token_file.read_text().strip()
    backing = RayBackedNodes(client.home, read_cluster(client.home).address, share_nothing=True,
                             secrets={"ray-token": token})
    emu = serve(time_scale=0.02, hooks=backing.hooks())
    try:
        with running_storage(buckets=("bench",)) as storage:
            yield Vms(backing, emu, storage, {"project": "bench", "zones": ["us-central2-b"], "endpoint": emu.url,
                                              "ray_token_secret": "ray-token"})
    finally:
        emu.stop()
        backing.close()


def kill(client, world: Vms | None, live, *, reset: bool) -> None:
    """Host 1 of slice `live`, with no notice: its process group (local), or its VM powered off (silently, unless
    `reset`)."""
    if world is None:
        kill_host(client.home, live.data["pgids"][1])
    else:
        world.backing.power_off(live.name, 1, silent=not reset)  # type: ignore[attr-defined]


def disrupted(client, name: str, steps: int, slices: int, kill_at: int, world: Vms | None = None, *,
              reset: bool = False, spares: bool | None = None) -> dict:
    job = client.submit(spec(name, steps, slices, world, spares))
    # Compiled ahead on host 0, and kept by slice 1's first host (host 2), the survivors' first if slice 0 goes.
    ahead = lambda: slices == 1 or {e.data["host"] for e in job.events() if e.kind == "ahead"} == {0, 2}  # noqa: E731
    wait_until(lambda: job.status().state is JobState.RUNNING and job.status().step >= kill_at and ahead())
    live = sorted(client.store.slices(job_id=job.id, live_only=True), key=lambda r: r.name)
    killed, killed_step = time.time(), job.status().step
    # slice 0: the survivors' process 0 is slice 1's host, which took the program
    kill(client, world, live[0], reset=reset)
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
    launched = first(lambda e: e.kind == "launched")
    memory = [e for e in ev if e.kind == "memory"]
    compiled_ahead = [e for e in ev if e.kind == "ahead" and e.data["host"] == 0]
    return {
        "kill_to_next_step_s": resumed.at - killed, "detect_s": disruption.at - killed,
        "detected_by": "beats and probes" if "no beat for" in disruption.reason else "other (Ray, the provider)",
        "kill_to_starting_s": starting.at - killed, "restore_s": restore.data["restore_s"],
        "compile_s": restore.data["compile_s"], "source": restore.data.get("source", "storage"),
        "steps_recomputed": lost.data["steps"], "restored_step": restore.data["restored_step"],
        "ahead_s": compiled_ahead[0].data["seconds"] if compiled_ahead else None,
        "killed_at_step": killed_step,
        "kill_to_launched_s": launched.at - killed, "spares_taken": "the spares that waited" in launched.reason,
        "copy_every": memory[0].data["every"] if memory else None,
        "copy_s": memory[0].data["copy_s"] if memory else None,
        "copy_share_of_step": memory[0].data["copy_s"] / memory[0].data["step_s"] if memory else None,
        "timeline": [(round(e.at - killed, 2), e.kind, e.reason[:100]) for e in after[:12]],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--kill-at", type=int, default=10)
    p.add_argument("--vms", action="store_true",
                   help="on share-nothing hosts: the GCP provider against the TPU API emulator's VMs, a bucket")
    p.add_argument("--reset", action="store_true",
                   help="with --vms: the VM powered off with its sockets reset (peers fail at once), not silently")
    p.add_argument("--only", choices=("two_slices", "one_slice"), help="run one of the two jobs")
    p.add_argument("--spares", choices=("default", "on", "off"), default="default",
                   help="recovery.spare_workers: the next generation's workers started ahead on each host "
                        "(default: the provider's: on for --vms, off locally)")
    args = p.parse_args()
    client = fresh_client()
    try:  # the two-slice job first: the one-slice job would leave the one-slice program in the cache
        with share_nothing(client) if args.vms else contextlib.nullcontext() as world:
            jobs = {"two_slices": ("two", 2), "one_slice": ("one", 1)}
            spares = {"default": None, "on": True, "off": False}[args.spares]
            runs = {key: disrupted(client, name, args.steps, slices, args.kill_at, world, reset=args.reset,
                                   spares=spares)
                    for key, (name, slices) in jobs.items() if args.only in (None, key)}
    finally:
        client.down()
    result: dict = {**runs, "steps": args.steps, "kill_at": args.kill_at, "spares": args.spares,
                    "machine": machine()}
    if len(runs) == 2:
        result["ratio_to_one_slice"] = runs["two_slices"]["kill_to_next_step_s"] / runs["one_slice"][
            "kill_to_next_step_s"]
    result["hosts"] = "share-nothing VMs (gcp provider, emulated TPU API and bucket)" if args.vms else \
        "local provider (Ray nodes sharing this machine's disk)"
    if args.vms:
        result["power_off"] = "reset (sockets closed)" if args.reset else "silent (processes frozen, no reset)"
    name = ("multislice_vms_reset" if args.reset else "multislice_vms") if args.vms else "multislice"
    save(name + (f"_{args.only}" if args.only else "") + (f"_spares_{args.spares}" if args.spares != "default" else ""),
         result)
    for name, r in runs.items():
        print(f"{name:18s} kill->next step {r['kill_to_next_step_s']:5.1f} s  (detect {r['detect_s']:.1f} by "
              f"{r['detected_by']}, "
              f"starting {r['kill_to_starting_s']:.1f}, restore {r['restore_s']:.2f} from {r['source']}, "
              f"compile {r['compile_s']:.2f}), {r['steps_recomputed']} steps recomputed")
    if len(runs) == 2:
        print(f"ratio {result['ratio_to_one_slice']:.2f}; the one-slice program compiled ahead in "
              f"{runs['two_slices']['ahead_s']:.1f} s while the job trained")


if __name__ == "__main__":
    main()
