"""A running job's next shape compiled off its hosts, stored in its folder, and selected after the loss.

A job on two one-host slices (v4-8 x 2) trains on the local cluster. Its controller compiles the
step the survivors of a lost slice run (one slice: target ``cpu:4/1h/1s``, the CPU stand-ins'
path, switched on by the state directory's `compile_ahead.CPU_SWITCH`) in a process of its own,
and stores it sealed in the job's checkpoint folder before anything is lost. Then a slice's host
vanishes; the survivor's host looks for its own shape at its launch and selects that program.
At the first launch the hosts (two slices) found none for their shape, and said so.
"""

from __future__ import annotations

from orchestrator import JobSpec, JobState
from orchestrator.cluster import kill_host
from orchestrator.control.compile_ahead import CPU_SWITCH
from tests.waiting import wait_for, wait_step


def kinds(job, kind: str) -> list:
    return [e for e in job.events() if e.kind == kind]


def test_the_survivors_program_is_stored_before_the_loss_and_selected_after_it(client, tmp_path):
    switch = client.home.root / CPU_SWITCH
    switch.touch()
    try:
        job = client.submit(JobSpec.from_dict({
            "name": "ahead-stored", "accelerator": "v4-8", "slices": 2,
            "workload": {"type": "lm", "steps": 400, "global_batch_size": 8, "seq_len": 16,
                         "model": {"d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64}},
            "checkpoint": {"interval_steps": 5, "directory": str(tmp_path / "ckpt")},
            "recovery": {"start_timeout_s": 180, "heartbeat_timeout_s": 120, "max_preemptions": 3,
                         "regrow": False}}))
        stored = wait_for(lambda: [e for e in kinds(job, "program") if e.data.get("host") is None],
                          timeout_s=300, what="the survivors' program stored by the controller")
        assert stored[0].data["ok"] and stored[0].data["target"] == "cpu:4/1h/1s", stored[0].reason
        files = list((tmp_path / "ckpt" / "programs").glob("*/cpu-4-1h-1s.sealed"))
        assert len(files) == 1 and files[0].stat().st_size > stored[0].data["size"]  # before the disruption
        assert not kinds(job, "disruption")
        first = [e for e in kinds(job, "program") if e.data.get("host") == 0]
        assert len(first) == 1 and not first[0].data["ok"], first
        assert first[0].data["target"] == "cpu:4/1h/2s" and "none stored" in first[0].data["reason"]

        step = job.status().step
        slices = sorted(client.store.slices(job_id=job.id, live_only=True), key=lambda r: r.name)
        kill_host(client.home, slices[1].data["pgids"][0])  # the second slice's host, with no notice
        wait_for(lambda: len(kinds(job, "resumed")) == 1, timeout_s=300, what="the first step on one slice")
        looked = [e for e in kinds(job, "program") if e.data.get("host") == 0]  # (a regrow to two slices may follow)
        assert len(looked) >= 2 and looked[1].data["ok"], [e.reason for e in looked]
        assert looked[1].data["target"] == "cpu:4/1h/1s" and "loads the step compiled ahead" in looked[1].reason
        wait_step(job, step + 3)
        job.cancel()
        assert job.wait(timeout_s=120).state is JobState.CANCELLED
    finally:
        switch.unlink(missing_ok=True)
