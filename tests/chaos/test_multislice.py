"""Several slices, one job, on the local cluster: each slice its own hosts (Ray nodes), one JAX runtime.

A job on two 2-host slices (v4-16 x 2) trains with the per-step losses of the same job on one
4-host slice (v4-32) through the controller, at the same global batch (1e-5). A job on three
slices (one host each) loses them one by one: a host of one vanishes with no notice, and the job goes on on the
other two from their own memory (0 steps recomputed, no checkpoint read), in the worker processes that
waited on their hosts (`orchestrator.control.spares`); another gets a notice,
every host stops at the same step, and the last one goes on from its memory; then the last slice
goes, and the job falls back to storage. Its losses and final parameters equal an undisturbed
run's (1e-5).
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import ray

from orchestrator import JobSpec, JobState
from orchestrator.cluster import kill_host
from tests.conftest import assert_losses_close, start_reference
from tests.waiting import wait_for, wait_step

STEPS, INTERVAL = 22, 6
LOSE_STEPS = 36  # room for three losses after the program for two slices is compiled ahead
MODEL = {"d_model": 64, "n_layers": 2, "n_heads": 2, "d_ff": 256}


def spec(name: str, root, *, accelerator: str = "v4-16", slices: int = 2, batch: int = 16, steps: int = STEPS,
         memory: int | str = 1, **recovery) -> JobSpec:
    return JobSpec.from_dict({
        "name": name, "accelerator": accelerator, "slices": slices,
        "workload": {"type": "lm", "steps": steps, "global_batch_size": batch, "seq_len": 32, "model": MODEL,
                     "learning_rate": {"warmup_steps": 2}},
        # A copy in memory every step, whatever it costs on this machine: a lost slice loses no step.
        "checkpoint": {"interval_steps": INTERVAL, "keep": 5, "directory": str(root / name),
                       "memory_interval_steps": memory},
        "recovery": {"start_timeout_s": 180, "heartbeat_timeout_s": 120, "max_preemptions": 3, **recovery}})


def outcome(job) -> dict:
    st = job.wait(timeout_s=600)
    assert st.state is JobState.SUCCEEDED, (st.reason, job.logs()[-3000:])
    return {"losses": [m.loss for m in job.metrics()], "params": job.record().result["param_sums"]}


def assert_same_model(got: dict, want: dict) -> None:
    assert_losses_close(got["losses"], want["losses"], rtol=1e-5)
    assert set(got["params"]) == set(want["params"])
    for k, v in want["params"].items():
        assert abs(got["params"][k] - v) <= 1e-5 * max(1.0, abs(v)), (k, got["params"][k], v)


def kinds(job, kind: str) -> list:
    return [e for e in job.events() if e.kind == kind]


def live_slices(client, job) -> list:
    return sorted(client.store.slices(job_id=job.id, live_only=True), key=lambda r: r.name)


@pytest.fixture(scope="module")
def one_slice(client, tmp_path_factory):
    """The same job on one 4-host v4-32 slice: 16 chips, as two v4-16 slices have."""
    return outcome(client.submit(spec("ms-one", tmp_path_factory.mktemp("one"), accelerator="v4-32", slices=1,
                                      steps=8)))


def test_two_slices_train_as_one_slice_of_as_many_hosts(client, tmp_path, one_slice):
    job = client.submit(spec("ms-two", tmp_path, steps=8))
    assert_same_model(outcome(job), one_slice)
    (launched,) = kinds(job, "launched")
    assert len(launched.data["nodes"]) == len(set(launched.data["nodes"])) == 4  # a host each, over 2 slices
    assert "2 slices" in launched.reason
    cadence = kinds(job, "memory")
    assert cadence and cadence[0].data["every"] == 1 and "a lost slice loses no step" in cadence[0].reason


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The three-slice job's model trained in one plain process (the equality of the two is what
    `test_two_slices_train_as_one_slice_of_as_many_hosts` shows for a job on the cluster). It trains while
    the job waits on its slices, and is read at the end."""
    tmp = tmp_path_factory.mktemp("ref")
    return start_reference(spec("ms-ref", tmp, accelerator="v4-8", slices=3, batch=48, steps=LOSE_STEPS), devices=4,
                           tmp_path=tmp)


def test_lost_slices_cost_no_step_and_the_last_one_falls_back_to_storage(client, tmp_path, reference):
    """Three one-host slices (v4-8 x 3: the losses below do not depend on a slice's host count, which
    the two-slice test above covers): the third vanishes (no notice), then the second gets a notice,
    then the last one goes. The first two losses are survived from memory, the last from storage."""
    job = client.submit(spec("ms-lose", tmp_path, accelerator="v4-8", slices=3, batch=48, steps=LOSE_STEPS,
                             regrow=False,  # adding one back: tests/unit/test_driver.py
                             spare_workers=True))  # the survivors take the workers waiting on their hosts
    wait_step(job, 6)
    # The survivors' program is compiled while the job trains (`workers.ahead`): they load it, not compile it.
    wait_for(lambda: kinds(job, "ahead"), timeout_s=300, what="the program for two slices compiled ahead")
    first, second, third = live_slices(client, job)
    killed_at = time.time()
    kill_host(client.home, third.data["pgids"][0])  # the third slice's host, with no notice
    wait_for(lambda: len(kinds(job, "resumed")) == 1, timeout_s=300, what="the first step on two slices")
    resumed_after = kinds(job, "resumed")[0].at - killed_at
    memory = [e for e in kinds(job, "restore") if e.data.get("source") == "memory"]
    assert len(memory) == 1, "\n".join(f"{e.kind}: {e.reason}" for e in job.events())
    assert "no checkpoint read" in memory[0].reason
    lost = kinds(job, "lost_work")[0].data
    assert lost["steps"] == 0 and lost["to_step"] == memory[0].data["restored_step"] >= 6, lost
    assert [s.name for s in live_slices(client, job)] == [first.name, second.name]  # the lost one released
    assert "the train step for 2 slice(s) was kept (compiled ahead" in job.logs(), job.logs()[-3000:]
    assert "; 2 of them the spares that waited on their hosts" in kinds(job, "launched")[1].reason

    wait_step(job, lost["to_step"] + 4)  # a notice to the second slice: it stops at a step, the first goes on
    launched = kinds(job, "launched")[-1].data
    assert len(launched["pids"]) == 2
    os.kill(launched["pids"][1], signal.SIGTERM)  # the second slice's host
    wait_for(lambda: len(kinds(job, "resumed")) == 2, timeout_s=300, what="the first step on one slice")
    d = kinds(job, "disruption")[1]
    assert d.data["kind"] == "preempted", d.reason
    assert [e.data.get("source") for e in kinds(job, "restore")] == ["storage", "memory", "memory"]
    assert kinds(job, "lost_work")[1].data["steps"] == 0
    assert [s.name for s in live_slices(client, job)] == [first.name]
    assert "; 1 of them the spares that waited on their hosts" in kinds(job, "launched")[2].reason

    wait_step(job, kinds(job, "restore")[-1].data["restored_step"] + 4)  # the last slice goes
    kill_host(client.home, live_slices(client, job)[0].data["pgids"][0])
    out = reference.result()
    assert_same_model(outcome(job), {"losses": out["losses"], "params": out["param_sums"]})
    restores = kinds(job, "restore")
    assert [r.data.get("source") for r in restores] == ["storage", "memory", "memory", "storage"], \
        [r.reason for r in restores]
    stopped = restores[2].data["restored_step"]  # the notice's step: every host stopped there, its checkpoint committed
    # After each restore from memory, its next step was committed to storage: storage never fell behind it.
    behind = {r.data["restored_step"] + 1 for r in restores[1:3]}
    saved = {e.data.get("step") for e in kinds(job, "checkpoint")}
    assert behind <= saved, (behind, sorted(s for s in saved if s is not None))
    last = restores[-1].data["restored_step"]
    assert last % INTERVAL == 0 or last == stopped or last in behind, (last, stopped, behind)
    print(f"from the kill to the next step on the surviving slices: {resumed_after:.1f} s")


def test_a_two_slice_job_outlives_its_controller_and_is_adopted_whole(client, tmp_path):
    """The controller is killed while a job on two slices trains; Ray restarts it, and the new one adopts
    both slices' workers (in launch order) instead of stopping them: no second launch, no restore, no step
    computed twice, and the job finishes on the same two slices."""
    job = client.submit(spec("ms-adopt", tmp_path, accelerator="v4-8", steps=STEPS))
    wait_step(job, 6)
    before = [s.name for s in live_slices(client, job)]
    ray.kill(client.controller(), no_restart=False)  # Ray restarts it; the new one finds the running workers
    st = job.wait(timeout_s=600)
    assert st.state is JobState.SUCCEEDED, (st.reason, job.logs()[-3000:])
    assert len(kinds(job, "launched")) == 1, [e.reason for e in job.events()]
    adopted = [e for e in job.events() if e.kind == "adopted"]
    assert adopted, [e.reason for e in job.events()]
    assert len(kinds(job, "restore")) == 1  # the first start's only
    assert [m.step for m in job.metrics()] == list(range(STEPS))
    assert not kinds(job, "disruption")
    assert len(before) == 2


ADOPT_LOSE_STEPS = 14


@pytest.fixture(scope="module")
def two_slice_reference(tmp_path_factory):
    """The two-slice job below trained undisturbed in one plain process (started now, read at the end)."""
    tmp = tmp_path_factory.mktemp("ref-two")
    return start_reference(spec("ms-ref-two", tmp, accelerator="v4-8", steps=ADOPT_LOSE_STEPS), devices=4,
                           tmp_path=tmp)


def test_a_slice_lost_while_the_controller_is_down_is_a_shrink_from_memory(client, tmp_path, two_slice_reference):
    """The controller is killed while a job on two slices trains, and while no controller runs a host of the
    second slice vanishes (no notice). The new controller adopts the generation, finds the host gone (its beats
    judged from the adoption) and shrinks to the first slice from its memory, as any lost slice: no checkpoint
    read, 0 steps recomputed, and the losses and parameters of the undisturbed run (1e-5)."""
    job = client.submit(spec("ms-adopt-lose", tmp_path, accelerator="v4-8", steps=ADOPT_LOSE_STEPS, regrow=False))
    wait_step(job, 4)
    first, second = live_slices(client, job)
    ray.kill(client.controller(), no_restart=False)  # Ray restarts it; the host goes before the new one is up
    kill_host(client.home, second.data["pgids"][0])
    out = two_slice_reference.result()
    assert_same_model(outcome(job), {"losses": out["losses"], "params": out["param_sums"]})
    events = "\n".join(f"{e.kind}: {e.reason}" for e in job.events())
    assert kinds(job, "adopted"), events
    assert [e.data.get("source") for e in kinds(job, "restore")] == ["storage", "memory"], events
    (lost,) = [e.data for e in kinds(job, "lost_work")]
    assert lost["steps"] == 0, (lost, events)
    launched = kinds(job, "launched")
    assert len(launched) == 2 and launched[-1].data["slice_names"] == [first.name], events  # on the survivor
    (d,) = kinds(job, "disruption")
    assert d.data["kind"] == "infra_lost", events
