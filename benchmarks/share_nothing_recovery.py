"""The built-in trainer on share-nothing VMs outlives a reclaim of its slice and then its controller.

A demonstration moved here from the test suite (`tests/integration/test_share_nothing.py`, where it
took about 47 s of a clean-clone run). Its claims stay covered there by shorter or broader tests:
the same reclaim and controller kill on the same VMs with the user example's shipped code
(`test_the_user_example_on_vms_outlives_a_reclaim_and_its_controller`), the built-in trainer on those
VMs resuming from the bucket after a notice and a VM powered off
(`test_a_notice_on_one_vm_and_a_vm_lost_on_share_nothing_hosts`), and the built-in trainer on emulated
GCP surviving a reclaim (`tests/integration/test_gcp_end_to_end.py`).

On a fresh local cluster, the TPU API emulator backs its nodes with share-nothing VMs
(`orchestrator.emulator.vm`) and a Cloud Storage emulator holds the checkpoints and the fence. A
2-host v4-16 job of the built-in trainer (20 steps, a checkpoint every 4) is reclaimed at step 6;
once the new slice has trained past step 12 the controller is killed (Ray restarts it and the new
one adopts the running group). The job must succeed with one disruption, two launches (the new
controller adopts, it does not launch again), the second restored from the bucket, and every step's
loss the one-process reference's (1e-5 relative).

    python benchmarks/share_nothing_recovery.py

writes benchmarks/results/share_nothing_recovery.json: the checks, and the seconds from the reclaim
to the next step and from the controller kill to the next step.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TINY_MODEL = {"d_model": 64, "n_layers": 1, "n_heads": 4, "d_ff": 128}
STEPS, RECLAIM_AT, KILL_AT = 20, 6, 12


def job_spec(gcp: dict, bucket_folder: str, endpoint: str):
    from orchestrator import JobSpec

    return JobSpec.from_dict({
        "name": "lm-vms", "accelerator": "v4-16", "provider": "gcp", "gcp": gcp, "storage": {"endpoint": endpoint},
        "workload": {"type": "lm", "steps": STEPS, "global_batch_size": 16, "seq_len": 32, "model": TINY_MODEL,
                     "learning_rate": {"warmup_steps": 2}},
        "checkpoint": {"interval_steps": 4, "directory": bucket_folder},
        "recovery": {"start_timeout_s": 120}})


def reference_losses(spec, workdir: Path) -> list[float]:
    """Per-step losses of the same training in one plain process with 8 CPU devices (`workers.reference`)."""
    from orchestrator.control.launch import launch_order

    t = spec.tpu_type
    order = launch_order(spec, t.chips, t.hosts)
    order = dataclasses.replace(order, settings=dataclasses.replace(order.settings, checkpoint_dir=None))
    (workdir / "order.pkl").write_bytes(pickle.dumps(order))
    subprocess.run([sys.executable, "-m", "workers.reference", "--order", str(workdir / "order.pkl"), "--devices", "8",
                    "--out", str(workdir / "ref.json")], cwd=REPO, check=True, timeout=600)
    return json.loads((workdir / "ref.json").read_text())["losses"]


def main() -> None:
    import ray

    from benchmarks.common import fresh_client, machine, save, wait_until
    from orchestrator import JobState
    from orchestrator.cluster import read_cluster
    from orchestrator.emulator.machines import MachineTimings
    from orchestrator.emulator.ray_backing import RayBackedNodes
    from orchestrator.emulator.server import serve
    from orchestrator.emulator.storage import running_storage

    def kinds(job, kind):
        return [e for e in job.events() if e.kind == kind]

    client = fresh_client()
    try:
        with running_storage(buckets=("bench-bucket",)) as gcs, tempfile.TemporaryDirectory() as tmp:
            token = client.home.token_file.read_text().strip()
            backing = RayBackedNodes(client.home, read_cluster(client.home).address, share_nothing=True,
                                     secrets={"ray-token": token}, stand_in=True)
            # As the tests: the TPU API at 0.02x its real time, a node provisioned in 0.2 s.
            emu = serve(timings=MachineTimings(scale=0.02, provision_s=10.0), hooks=backing.hooks())
            try:
                gcp = {"project": "bench-project", "zones": ["us-central2-b"], "endpoint": emu.url,
                       "ray_token_secret": "ray-token"}
                spec = job_spec(gcp, "gs://bench-bucket/lm-vms", gcs.url)
                t0 = time.monotonic()
                job = client.submit(spec)
                wait_until(lambda: job.status().step >= RECLAIM_AT or job.status().done, 400)
                [live] = client.store.slices(job_id=job.id, live_only=True)
                emu.reclaim(live.name)
                reclaimed, step_then = time.monotonic(), job.status().step
                wait_until(lambda: len(kinds(job, "launched")) == 2 and job.status().step > step_then
                           or job.status().done, 400)
                reclaim_to_step = time.monotonic() - reclaimed
                wait_until(lambda: job.status().step >= KILL_AT or job.status().done, 400)
                ray.kill(client.controller(), no_restart=False)
                killed, step_then = time.monotonic(), job.status().step
                wait_until(lambda: job.status().step > step_then or job.status().done, 400)
                kill_to_step = time.monotonic() - killed
                st = job.wait(timeout_s=600)
                wall = time.monotonic() - t0
            finally:
                emu.stop()
                backing.close()
            ref = reference_losses(spec, Path(tmp))
        got = [m.loss for m in job.metrics()]
        worst = max((abs(a - e) / abs(e) for a, e in zip(got, ref, strict=True)), default=None) \
            if len(got) == len(ref) else None
        restored = [e.data["restored_step"] for e in kinds(job, "restore")]
        checks = {
            "succeeded": st.state is JobState.SUCCEEDED,
            "disruptions": [d.data["kind"] for d in kinds(job, "disruption")],  # ["preempted"]
            "launches": len(kinds(job, "launched")),  # 2: the new controller adopted, it did not launch again
            "adopted": any("adopted" in e.reason for e in job.events()),
            "restored_steps": restored,  # [None, a step > 0 from the bucket]
            "losses_worst_relative_difference": worst,  # <= 1e-5
        }
        save("share_nothing_recovery", {
            "machine": machine(), "steps": STEPS, "reclaim_at": RECLAIM_AT, "controller_killed_at": KILL_AT,
            "reclaim_to_next_step_s": round(reclaim_to_step, 1),
            "controller_kill_to_next_step_s": round(kill_to_step, 1),
            "wall_s": round(wall, 1), "checks": checks,
            "ok": checks["succeeded"] and checks["disruptions"] == ["preempted"] and checks["launches"] == 2
            and checks["adopted"] and restored[:1] == [None] and (restored[1:2] or [0])[0] > 0
            and worst is not None and worst <= 1e-5})
    finally:
        client.down()


if __name__ == "__main__":
    main()
