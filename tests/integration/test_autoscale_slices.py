"""The cost policy choosing a slice count, through the real controller on a local cluster.

A tight deadline on a replayed trace with room for two v4-16 slices: the policy starts the job
on one v4-16 (before it has measured anything, one slice seems to finish in time), and once the
time spent shows one slice cannot, it chooses 2 x v4-16. The job is long enough (300 steps) that the
second slice pays for its provisioning and the relaunch by a wide margin: with 150 the choice was at
the edge, and a policy that counted the grow's pause but not the provisioning before it asked for the
slice and let it go once it was READY. Only the slice to add is requested,
beside the running one; once it is READY the job stops at a committed step and goes on on both,
the running slice kept. Nothing is lost, and every step's loss is the one-process reference's at
the same global batch. (What the policy does once it has measured two slices is its own call.)
"""

from __future__ import annotations

from benchmarks.autoscale_replay import job_spec, write_trace
from orchestrator import JobSpec, JobState
from tests.conftest import assert_losses_close, start_reference

SCALE = 40.0  # trace seconds a wall second
STEPS = 300
DEADLINE_S = 450.0  # trace seconds: once the job has run a little, one v4-16 cannot make it, the policy finds


def test_the_policy_adds_a_slice_beside_the_running_one_when_one_slice_cannot_make_the_deadline(client, tmp_path):
    (tmp_path / "4-node").mkdir()
    trace = write_trace(tmp_path / "4-node" / "room-for-two.json", [2] * 50)  # 16 spot chips: two v4-16
    raw = job_spec("slices", trace, tmp_path / "ckpt", scale=SCALE, steps=STEPS, deadline_s=DEADLINE_S)
    raw["accelerator"] = "v4-16"
    raw["autoscaling"] = {"accelerators": ["v4-16"], "tiers": ["spot", "on-demand"], "max_slices": 2}
    spec = JobSpec.from_dict(raw)
    job = client.submit(spec)
    ref = start_reference(spec, devices=8, tmp_path=tmp_path / "ref")  # trains while the job waits on its slice
    st = job.wait(timeout_s=300)
    assert st.state is JobState.SUCCEEDED, st.reason
    assert client.store.job(job.id).failures == 0
    events = job.events()
    said = [e.reason for e in events if e.kind in ("autoscale", "resize")]

    launched = [e.data for e in events if e.kind == "launched"]
    assert [d.get("slices") for d in launched][:2] == [1, 2], (launched, said)
    first = launched[0]["slice"]
    grow = [e for e in events if e.kind == "autoscale" and e.data and e.data.get("slices") == 2
            and e.reason.startswith("request 2xv4-16")]
    assert grow and "(adding 1)" in grow[0].reason, said
    resize = next(e for e in events if e.kind == "resize")
    added = resize.reason.split()[1]
    assert f"ready beside {first}" in resize.reason and added != first, said

    history: dict[str, list[tuple[float, str]]] = {}
    for e in events:
        if e.kind == "slice":
            history.setdefault(e.data["name"], []).append((e.at, e.data["state"]))
    ready = next(at for at, s in history[added] if s == "READY")
    released = next(at for at, s in history[first] if s == "RELEASED")
    # Make before break, and the running slice kept: the job trained on it alone, then on it and the one
    # added beside it (generation 2, from the step generation 1 committed); it was released only after.
    metrics = job.metrics()
    alone = [m.step for m in metrics if m.generation == launched[0]["generation"]]
    both = [m for m in metrics if m.generation == launched[1]["generation"]]
    assert alone and both and ready < released and released >= max(m.at for m in both), said
    restores = [e.data for e in events if e.kind == "restore"]
    assert restores[1]["restored_step"] == max(alone) + 1, (alone, restores)
    assert not [e for e in events if e.kind == "lost_work" and not e.reason.startswith("lost 0 steps")]
    # What it did after is the policy's call on the speed it measured on two slices (on this machine's
    # CPU "slices" two can be slower than one, and the policy may move back): nothing is lost either way.

    assert_losses_close([m.loss for m in metrics], ref.result()["losses"], rtol=1e-5)
