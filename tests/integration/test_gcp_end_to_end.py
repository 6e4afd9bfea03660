"""`provider: gcp` end to end: the real TPU client talks to the emulator, whose nodes are local Ray nodes.

The job trains on emulator-backed hosts; the emulator reclaims the slice mid-run (its
queued resource goes SUSPENDING, its nodes PREEMPTED and their hosts vanish); the job
recovers on a new slice and ends with the losses of an undisturbed run; afterwards
nothing of the job is left in the (emulated) cloud. As on real TPU VMs, the job's
checkpoints and its fence are in a bucket (the local Cloud Storage emulator).
"""

from __future__ import annotations

import time

from orchestrator import JobState
from orchestrator.cluster import read_cluster
from orchestrator.emulator.machines import MachineTimings
from orchestrator.emulator.ray_backing import RayBackedNodes
from orchestrator.emulator.server import serve
from tests.conftest import assert_losses_close, start_reference
from tests.integration.test_local_jobs import tiny_spec
from tests.storage_fixture import unique_folder

# Each step of the TPU API at 0.02x its real time (a 0.6 s preemption grace), but a node provisioned in
# 0.2 s, not 2.4 s: its hosts then join Ray before the provider's first look at the slice (every 5 s), and a
# slice is READY in 5 s, not 10 s.
TIMINGS = MachineTimings(scale=0.02, provision_s=10.0)


def gcp_spec(name: str, accelerator: str, tmp_path, request, gcs_emulator, tpu_endpoint: str, *, interval: int,
             **extra):
    """`tiny_spec` on provider gcp: the TPU API emulator's slices, checkpoints in a bucket of the GCS emulator."""
    return tiny_spec(name, accelerator, tmp_path, provider="gcp",
                     gcp={"project": "test-project", "zones": ["us-central2-b"], "endpoint": tpu_endpoint},
                     checkpoint={"interval_steps": interval, "directory": unique_folder(request)},
                     storage={"endpoint": gcs_emulator.url}, **extra)


def test_job_on_emulated_gcp_survives_a_reclaim(client, tmp_path, request, gcs_emulator):
    backing = RayBackedNodes(client.home, read_cluster(client.home).address)
    emu = serve(timings=TIMINGS, hooks=backing.hooks())
    try:
        spec = gcp_spec("gcp-e2e", "v4-16", tmp_path, request, gcs_emulator, emu.url, steps=16, interval=4)
        job = client.submit(spec)
        ref = start_reference(spec, devices=8, tmp_path=tmp_path)  # trains while the job waits on its slices
        deadline = time.monotonic() + 300
        while not (job.status().state is JobState.RUNNING and job.status().step >= 6):
            assert time.monotonic() < deadline and not job.status().done, job.status().reason
            time.sleep(0.1)
        live = client.store.slices(job_id=job.id, live_only=True)
        assert len(live) == 1 and live[0].provider == "gcp"
        emu.reclaim(live[0].name)
        st = job.wait(timeout_s=600)
        assert st.state is JobState.SUCCEEDED, (st.reason, job.logs()[-2000:])
        disruption = [e for e in job.events() if e.kind == "disruption"]
        assert len(disruption) == 1 and disruption[0].data["kind"] == "preempted", disruption
        assert st.preemptions == 1
        # The provider told the controller each state of both slices: the reclaimed one's end, the second's start.
        states = {}
        for e in job.events():
            if e.kind == "slice":
                states.setdefault(e.data["name"], []).append(e.data["state"])
        # Under load a new slice's hosts can miss Ray's heartbeats while they start: that slice is given back and
        # another asked for (a start failure, not a preemption: the count above stays 1).
        first, *between, last = states.values()
        assert first[0] == "REQUESTED" and "READY" in first and first[-1] in ("GONE", "RELEASED"), first
        assert last[0] == "REQUESTED" and last[-2:] == ["READY", "RELEASED"], last
        assert all(s[0] == "REQUESTED" and s[-1] in ("GONE", "RELEASED") for s in between), between
        assert len(between) <= 1, states
        assert_losses_close([m.loss for m in job.metrics()], ref.result()["losses"], rtol=1e-5)
        deadline = time.monotonic() + 60
        while True:  # deletes are long-running operations: give them a moment
            state = emu.state()
            left = [r["name"] for r in state["queuedResources"] + state["nodes"] if job.id in r["name"]]
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert left == [], f"left behind in the cloud: {left}"
    finally:
        emu.stop()
        backing.close()


def test_a_gcp_job_waits_queued_while_no_zone_has_capacity(client, tmp_path, request, gcs_emulator):
    """A refusal for capacity is a wait, not a failure: the job goes back to the queue, asks
    again after a backoff, and runs once the zone has capacity; max_failures is never spent."""
    backing = RayBackedNodes(client.home, read_cluster(client.home).address)
    emu = serve(timings=TIMINGS, hooks=backing.hooks())
    try:
        emu.stockout("us-central2-b", mode="fail")
        spec = gcp_spec("gcp-queued", "v4-8", tmp_path, request, gcs_emulator, emu.url, steps=4, interval=2,
                        recovery={"start_timeout_s": 120, "max_failures": 0})
        job = client.submit(spec)
        deadline = time.monotonic() + 120
        while not (job.status().state is JobState.QUEUED and "no capacity" in job.status().reason):
            assert time.monotonic() < deadline and not job.status().done, job.status().reason
            time.sleep(0.1)
        assert job.status().failures == 0
        emu.clear_stockout()
        st = job.wait(timeout_s=420)
        assert st.state is JobState.SUCCEEDED, (st.reason, job.logs()[-2000:])
        assert st.failures == 0  # with max_failures 0, one counted refusal would have failed the job
        queued = [e for e in job.events() if e.kind == "state" and e.to_state == "QUEUED"]
        assert queued and all("no capacity" in e.reason for e in queued)
    finally:
        emu.stop()
        backing.close()


def test_a_metadata_notice_on_gcp_saves_the_agreed_step(client, tmp_path, request, gcs_emulator):
    """The metadata server's preemption event is a notice: every host stops after the same step
    with that step's checkpoint committed, so the restart loses nothing."""
    from orchestrator.emulator.metadata import FakeMetadataServer

    backing = RayBackedNodes(client.home, read_cluster(client.home).address)
    emu = serve(timings=TIMINGS, hooks=backing.hooks())
    metadata = FakeMetadataServer()
    try:
        spec = gcp_spec("gcp-notice", "v4-16", tmp_path, request, gcs_emulator, emu.url, steps=40, interval=100,
                        recovery={"start_timeout_s": 120, "metadata_url": metadata.url})
        job = client.submit(spec)
        deadline = time.monotonic() + 300
        while not (job.status().state is JobState.RUNNING and job.status().step >= 5):
            assert time.monotonic() < deadline and not job.status().done, job.status().reason
            time.sleep(0.1)
        metadata.set("instance/preempted", "TRUE")
        while not [e for e in job.events() if e.kind == "notice"]:
            assert time.monotonic() < deadline and not job.status().done, job.status().reason
            time.sleep(0.1)
        metadata.set("instance/preempted", "FALSE")  # the next slice's hosts are not preempted
        st = job.wait(timeout_s=420)
        assert st.state is JobState.SUCCEEDED, (st.reason, job.logs()[-2000:])
        disruption = [e for e in job.events() if e.kind == "disruption"]
        assert len(disruption) == 1 and disruption[0].data["kind"] == "preempted", disruption
        # The interval (100) is past the job's end: only the notice's save can have kept the steps.
        lost = [e.data["steps"] for e in job.events() if e.kind == "lost_work"]
        assert lost == [0], lost
    finally:
        metadata.close()
        emu.stop()
        backing.close()


def test_hosts_on_gcp_watch_the_metadata_server_by_default():
    from orchestrator import JobSpec
    from orchestrator.control.launch import metadata_url
    from workers.notices import GCE_METADATA_URL

    gcp = JobSpec.from_dict({"name": "x", "provider": "gcp", "gcp": {"project": "p", "zones": ["z"], "bucket": "b-1"}})
    assert metadata_url(gcp) == GCE_METADATA_URL
    assert metadata_url(JobSpec.from_dict({"name": "x"})) is None
    own = JobSpec.from_dict({"name": "x", "recovery": {"metadata_url": "http://127.0.0.1:1/v1"}})
    assert metadata_url(own) == "http://127.0.0.1:1/v1"
