"""Hosts that share nothing with the controller, as TPU VMs do.

Each emulated VM runs the startup script the GCP provider wrote, in namespaces where this
machine's files are hidden (`orchestrator.emulator.vm`); the job's code reaches it only by
being shipped with the job, and its checkpoints, token files and fence live in a bucket of
the Cloud Storage emulator. The same probe run on the local provider, whose hosts share this
machine's disk, sees those files: the isolation is real, not a probe that cannot fail.

Then whole jobs: the user example, with its job folder deleted right after `submit`, through a
reclaim of the slice mid-run, then the controller killed (the new one adopts the GCP slice its
workers run on), and the losses and parameters of an undisturbed run; and the built-in trainer
through a preemption notice from one VM's metadata server and a VM powered off. (The built-in
trainer through the reclaim and the controller kill is `benchmarks/share_nothing_recovery.py`.)

And VMs booted as real ones, which do not declare that their CPU stands in for their TPU chips:
their workers look for the TPU this machine lacks, and the job ends at its first launch.
"""

from __future__ import annotations

import contextlib
import re
import shutil

import pytest
import ray

from orchestrator import JobSpec, JobState
from orchestrator.cluster import read_cluster
from orchestrator.emulator.machines import MachineTimings
from orchestrator.emulator.ray_backing import RayBackedNodes
from orchestrator.emulator.server import serve
from orchestrator.state.states import FailedBecause
from orchestrator.user.data_prepare import prepare
from tests.chaos.test_faults import kinds
from tests.conftest import REPO, assert_losses_close, start_reference
from tests.integration.test_local_jobs import tiny_spec
from tests.storage_fixture import unique_folder
from tests.waiting import wait_for, wait_step
from workers.accelerator import CPU_STAND_IN_ENV

PROBE = REPO / "tests" / "integration" / "share_nothing" / "probe.py"
EXAMPLE = REPO / "examples" / "user-train"


@contextlib.contextmanager
def emulated_vms(client, *, stand_in: bool = True):
    """The TPU API emulator whose nodes are share-nothing VMs; yields it, the `gcp` section of a job file, and
    the VMs' backing. `stand_in`: the VMs declare that their CPU stands in for their TPU chips."""
    token = client.home.token_file.read_text().strip()
    backing = RayBackedNodes(client.home, read_cluster(client.home).address, share_nothing=True,
                             secrets={"ray-token": token}, stand_in=stand_in)
    # Each step of the TPU API at 0.02x its real time (a 0.6 s preemption grace, in which a reclaimed slice's
    # last checkpoint commits), but a node provisioned in 0.2 s, not 2.4 s: its VMs then boot and join Ray
    # before the provider's first look at the slice (every 5 s), and a slice is READY in 5 s, not 10 s.
    emu = serve(timings=MachineTimings(scale=0.02, provision_s=10.0), hooks=backing.hooks())
    try:
        yield emu, {"project": "test-project", "zones": ["us-central2-b"], "endpoint": emu.url,
                    "ray_token_secret": "ray-token"}, backing
    finally:
        emu.stop()
        backing.close()


@pytest.fixture
def vms(client):
    with emulated_vms(client) as world:
        yield world


def probe_spec(name: str, client, tmp_path, ckpt: str, **extra) -> tuple[JobSpec, object]:
    folder = tmp_path / f"{name}-job"
    folder.mkdir()
    shutil.copy(PROBE, folder / "probe.py")
    marker = tmp_path / "on-this-machine.txt"
    marker.write_text("only here")
    must_not_see = [str(client.home.root / "state.db"), str(client.home.token_file), str(marker),
                    str(REPO / "orchestrator" / "__init__.py"), str(REPO / "examples" / "user-train" / "train.py")]
    spec = JobSpec.from_dict({
        "name": name, "accelerator": "v4-16",
        "workload": {"type": "entrypoint", "entrypoint": "probe:main", "steps": 1,
                     "args": {"must_not_see": must_not_see}},
        "checkpoint": {"directory": ckpt},
        "recovery": {"start_timeout_s": 120, "max_failures": 0}, **extra})
    return spec, folder


def test_a_gcp_host_sees_none_of_the_submitting_machines_files(client, tmp_path, vms, request, gcs_emulator):
    spec, folder = probe_spec("probe-gcp", client, tmp_path, unique_folder(request), provider="gcp", gcp=vms[1],
                              storage={"endpoint": gcs_emulator.url})
    job = client.submit(spec, workdir=folder)
    shutil.rmtree(folder)  # the code went with the job
    st = job.wait(timeout_s=400)
    logs = job.logs()
    assert st.state is JobState.SUCCEEDED, (st.reason, logs[-3000:])
    assert "host 0 sees none of the submitting machine's files" in logs
    assert "host 1 sees none of the submitting machine's files" in logs
    assert kinds(job, "launched")[0].reason.endswith("on CPU standing in for TPU chips")  # as the VMs declare
    # The project's packages and the job's folder are the shipped copies, unpacked on the host.
    assert re.search(r"runtime_resources/node-\d+/py_modules_files", logs)
    assert str(REPO) not in logs.split("workers imported from")[1]
    assert re.search(r"runtime_resources/node-\d+/working_dir_files", logs)


def test_the_same_probe_on_the_shared_disk_sees_them(client, tmp_path):
    spec, folder = probe_spec("probe-local", client, tmp_path, str(tmp_path / "ckpt"))
    job = client.submit(spec, workdir=folder)
    st = job.wait(timeout_s=300)
    assert st.state is JobState.FAILED
    assert "sees the submitting machine's files" in st.reason and "state.db" in st.reason
    assert kinds(job, "launched")[0].reason.endswith("on CPU standing in for TPU chips")  # as local nodes declare
    # Each host runs in its own unpacked copy of the job's folder, as separate machines would: on one
    # shared copy, the second node to set the folder up deleted it under the first one's worker.
    folders = set(re.findall(r"working directory (\S+)", job.logs()))
    assert len(folders) == 2 and all("working_dir_files" in f for f in folders), folders


def test_a_vm_without_the_tpu_it_claims_fails_the_launch_once(client, tmp_path, request, gcs_emulator):
    """Booted as a real TPU VM is (no stand-in declared), a host is not forced onto its CPU: its worker gives
    JAX the TPU only, finds none, and the launch fails with the reason. It is not tried again, though the
    job's max_failures would allow it: every launch on these hosts would find the same. The slice goes."""
    with emulated_vms(client, stand_in=False) as (_, gcp, backing):
        spec, folder = probe_spec("no-tpu", client, tmp_path, unique_folder(request), provider="gcp", gcp=gcp,
                                  storage={"endpoint": gcs_emulator.url},
                                  recovery={"start_timeout_s": 120, "max_failures": 3})
        job = client.submit(spec, workdir=folder)
        st = job.wait(timeout_s=300)
        assert (st.state, st.cause, st.state_name) == (JobState.FAILED, FailedBecause.SETUP, "FAILED_SETUP"), \
            (st.reason, job.logs()[-3000:])
        assert re.match(r"host \d of slice \S+ \(v4-16\) found no TPU: Unable to initialize backend 'tpu': ",
                        st.reason), st.reason
        assert f"a host whose CPU stands in for TPU chips declares {CPU_STAND_IN_ENV}=1 in its Ray node's " \
               "environment; not tried again" in st.reason
        assert [d.data["kind"] for d in kinds(job, "disruption")] == ["platform_failed"]
        assert len(kinds(job, "launched")) == 1 and "on TPU" in kinds(job, "launched")[0].reason
        assert "found no TPU" in job.logs() and "sees none" not in job.logs()  # the job's code never ran
        [s] = client.store.slices(job_id=job.id)
        wait_for(lambda: not client.store.slices(job_id=job.id, live_only=True) and not backing.vms(s.name), 60,
                 "the slice to be released and its VMs powered off")


def reclaim_then_kill_the_controller(client, emu, job, *, reclaim_at: int, kill_at: int) -> None:
    wait_step(job, reclaim_at)
    [live] = client.store.slices(job_id=job.id, live_only=True)
    emu.reclaim(live.name)
    wait_for(lambda: len(kinds(job, "launched")) == 2 and job.status().step >= kill_at or job.status().done, 400,
             f"the second slice to train past step {kill_at}")
    assert not job.status().done, job.status().reason
    ray.kill(client.controller(), no_restart=False)  # Ray restarts it; the new one adopts the GCP slice


def assert_recovered_and_adopted(job) -> None:
    assert [d.data["kind"] for d in kinds(job, "disruption")] == ["preempted"]
    assert len(kinds(job, "launched")) == 2, "the new controller started a group instead of adopting the running one"
    assert any("adopted" in e.reason for e in job.events())
    restored = [e.data["restored_step"] for e in kinds(job, "restore")]
    assert restored[0] is None and restored[1] is not None and restored[1] > 0  # from the bucket, not from 0


def test_the_user_example_on_vms_outlives_a_reclaim_and_its_controller(client, tmp_path, vms, request,
                                                                       gcs_emulator, gcs):
    emu, gcp, _ = vms
    tokens = gcs.folder + "/tokens"
    prepare(REPO / "orchestrator", tokens, vocab_size=512, pattern="*.py")
    folder = tmp_path / "user-train"
    shutil.copytree(EXAMPLE, folder, ignore=shutil.ignore_patterns("data", "__pycache__"))

    def spec_for(name: str, ckpt: str, **where) -> JobSpec:
        return JobSpec.from_dict({
            "name": name, "accelerator": "v4-16", "workdir": str(folder), "storage": {"endpoint": gcs_emulator.url},
            "workload": {"type": "entrypoint", "entrypoint": "train:main", "steps": 20, "seq_len": 32,
                         "global_batch_size": 16, "data": {"path": tokens},
                         "args": {"d_model": 128, "n_layers": 2, "n_heads": 4, "warmup_steps": 2}},
            "checkpoint": {"interval_steps": 4, "keep": 5, "directory": ckpt},
            "recovery": {"start_timeout_s": 180}, **where})

    job = client.submit(spec_for("user-vms", gcs.folder + "/ckpt", provider="gcp", gcp=gcp))
    # It trains while the job waits on its slices, on the example's own code: the job's folder goes next.
    reference = start_reference(spec_for("user-ref", gcs.folder + "/ref", workdir=str(EXAMPLE)), devices=8,
                                tmp_path=tmp_path / "ref")
    shutil.rmtree(folder)  # the code went with the job
    reclaim_then_kill_the_controller(client, emu, job, reclaim_at=6, kill_at=12)
    st = job.wait(timeout_s=600)
    assert st.state is JobState.SUCCEEDED, (st.reason, job.logs()[-3000:])
    assert_losses_close([m.loss for m in job.metrics()], reference.result()["losses"], rtol=1e-5)
    got, want = job.record().result["param_sums"], reference.result()["param_sums"]
    assert set(got) == set(want) and all(abs(got[k] - want[k]) <= 1e-5 * max(1.0, abs(want[k])) for k in want)
    assert_recovered_and_adopted(job)


def test_a_notice_on_one_vm_and_a_vm_lost_on_share_nothing_hosts(client, tmp_path, vms, request, gcs_emulator):
    """The chaos suite's notice and host-loss cases on VMs: a preemption notice from one VM's own metadata
    server (hosts on gcp watch it by default) saves the agreed step, so nothing is lost; a VM powered off
    without notice is a host lost, and the job goes on from the bucket's last committed step."""
    emu, gcp, backing = vms
    spec = tiny_spec("lm-vm-chaos", "v4-16", tmp_path, steps=24, provider="gcp", gcp=gcp,
                     checkpoint={"interval_steps": 4, "directory": unique_folder(request)},
                     storage={"endpoint": gcs_emulator.url})
    job = client.submit(spec)
    ref = start_reference(spec, devices=8, tmp_path=tmp_path)  # trains while the job waits on its slices
    wait_step(job, 6)
    [live] = client.store.slices(job_id=job.id, live_only=True)
    backing.vms(live.name)[1].metadata.set("instance/preempted", "TRUE")
    wait_for(lambda: len(kinds(job, "launched")) == 2 and job.status().step >= 14 or job.status().done, 400,
             "the second slice to train past step 14")
    assert not job.status().done, job.status().reason
    [live] = client.store.slices(job_id=job.id, live_only=True)
    backing.vms(live.name)[0].kill()
    st = job.wait(timeout_s=600)
    assert st.state is JobState.SUCCEEDED, (st.reason, job.logs()[-3000:])
    assert_losses_close([m.loss for m in job.metrics()], ref.result()["losses"], rtol=1e-5)
    assert [d.data["kind"] for d in kinds(job, "disruption")] == ["preempted", "infra_lost"]
    assert kinds(job, "notice") and kinds(job, "lost_work")[0].data["steps"] == 0  # the notice's step, committed
