"""The chaos suite against a user's own program: `examples/user-train` on token files.

The same disruptions as `test_faults` (a host lost, a preemption notice, the controller
killed, every host killed during an async save) and a resize 2 -> 4 -> 2 hosts, run
against the user example through the training API (`workers.api`). Each ends with the
per-step losses and final parameters of the same program run undisturbed in one plain
process (1e-5 relative): the guarantees hold for user code as for the built-in trainer.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import ray

from orchestrator import JobSpec, JobState
from orchestrator.cluster import kill_host
from orchestrator.emulator.metadata import FakeMetadataServer
from orchestrator.user.data_prepare import prepare
from tests.chaos.test_faults import host_pgids, kinds
from tests.conftest import REPO, Reference, assert_losses_close, start_reference
from tests.integration.test_resize import wait_running_at
from tests.waiting import wait_for, wait_step

EXAMPLE = REPO / "examples" / "user-train"
STEPS, INTERVAL = 20, 4
ARGS = {"d_model": 256, "n_layers": 2, "n_heads": 4, "warmup_steps": 2}  # big enough that a save takes a while


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> str:
    """Token files made by `data prepare` (a byte-level BPE trained here) from this repository's sources."""
    out = tmp_path_factory.mktemp("tokens") / "data"
    prepare(REPO / "orchestrator", out, vocab_size=512, pattern="*.py")
    return str(out)


def user_spec(name: str, ckpt_root: Path, tokens: str, *, accelerator: str = "v4-16", interval: int = INTERVAL,
              **recovery) -> JobSpec:
    return JobSpec.from_dict({
        "name": name, "accelerator": accelerator, "workdir": str(EXAMPLE),
        "workload": {"type": "entrypoint", "entrypoint": "train:main", "args": ARGS, "steps": STEPS,
                     "seq_len": 32, "global_batch_size": 16, "data": {"path": tokens}},
        "checkpoint": {"interval_steps": interval, "keep": 5, "directory": str(ckpt_root / name)},
        "recovery": {"start_timeout_s": 180, "heartbeat_timeout_s": 120, **recovery}})


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tokens) -> Reference:
    """Started at the module's first test, it trains while that test's job waits on its slice."""
    tmp = tmp_path_factory.mktemp("user-ref")
    return start_reference(user_spec("user-ref", tmp, tokens), devices=8, tmp_path=tmp)


def assert_same_model(job, reference: Reference) -> None:
    st = job.wait(timeout_s=600)
    assert st.state is JobState.SUCCEEDED, (st.reason, job.logs()[-3000:])
    out = reference.result()
    assert len(out["losses"]) == STEPS and out["losses"][-1] < out["losses"][0]
    assert_losses_close([m.loss for m in job.metrics()], out["losses"], rtol=1e-5)
    got, want = job.record().result["param_sums"], out["param_sums"]
    assert set(got) == set(want) and len(want) > 10  # every array of the user's parameter tree
    for k in want:
        assert abs(got[k] - want[k]) <= 1e-5 * max(1.0, abs(want[k])), (k, got[k], want[k])


def test_user_program_survives_a_host_loss(client, tmp_path, tokens, reference):
    job = client.submit(user_spec("user-lose-host", tmp_path, tokens))
    wait_step(job, 10)
    kill_host(client.home, host_pgids(client, job)[1])
    assert_same_model(job, reference)
    assert kinds(job, "disruption")[0].data["kind"] == "infra_lost"
    restored = kinds(job, "restore")[-1].data["restored_step"]
    assert restored is not None and restored % INTERVAL == 0 and restored >= 8


def test_user_program_saves_on_a_preemption_notice(client, tmp_path, tokens, reference):
    metadata = FakeMetadataServer()
    try:
        job = client.submit(user_spec("user-notice", tmp_path, tokens, metadata_url=metadata.url))
        wait_step(job, 9)
        metadata.set("instance/preempted", "TRUE")
        wait_for(lambda: kinds(job, "disruption"), 120, "the notice to end the attempt")
        metadata.set("instance/preempted", "FALSE")
        assert_same_model(job, reference)
    finally:
        metadata.close()
    d = kinds(job, "disruption")[0]
    assert d.data["kind"] == "preempted"
    assert kinds(job, "restore")[1].data["restored_step"] == d.data["step"] + 1  # the notice's step, committed
    assert kinds(job, "lost_work")[0].data["steps"] == 0


def test_user_program_outlives_its_controller(client, tmp_path, tokens, reference):
    job = client.submit(user_spec("user-kill-ctrl", tmp_path, tokens))
    wait_step(job, 6)
    ray.kill(client.controller(), no_restart=False)  # Ray restarts it; the new one adopts the running workers
    assert_same_model(job, reference)
    assert len(kinds(job, "launched")) == 1, "a second worker group was started"
    assert any("adopted" in e.reason for e in job.events())


def test_user_program_killed_during_an_async_save(client, tmp_path, tokens, reference):
    spec = user_spec("user-kill-in-save", tmp_path, tokens)
    ckpt = Path(spec.checkpoint.directory)
    job = client.submit(spec)
    wait_for(lambda: (ckpt / str(INTERVAL)).exists(), 300, "the first committed checkpoint")

    def partial_save():
        tmp = [p for p in ckpt.iterdir() if ".orbax-checkpoint-tmp" in p.name and int(p.name.split(".")[0]) > INTERVAL]
        return tmp[0] if tmp else None

    partial = wait_for(partial_save, 300, "an in-flight save", poll_s=0.002)
    for pgid in host_pgids(client, job):
        kill_host(client.home, pgid)
    partial_step = int(partial.name.split(".")[0])
    assert not (ckpt / str(partial_step)).exists(), "the save finished before the kill; cannot test a partial save"
    assert_same_model(job, reference)
    assert kinds(job, "restore")[1].data["restored_step"] == partial_step - INTERVAL
    assert not [p for p in ckpt.iterdir() if ".orbax-checkpoint-tmp" in p.name]


def test_user_program_resized_up_and_down(client, tmp_path, tokens, reference):
    job = client.submit(user_spec("user-elastic", tmp_path, tokens, interval=100))  # only resizes checkpoint
    ctrl = client.controller()
    wait_running_at(job, 5)
    ray.get(ctrl.resize.remote(job.id, "v4-32", "test: more speed"))
    wait_running_at(job, 11, generation=2)
    ray.get(ctrl.resize.remote(job.id, "v4-16", "test: back down"))
    assert_same_model(job, reference)
    assert [len(e.data["nodes"]) for e in kinds(job, "launched")] == [2, 4, 2]
    restored = [e.data["restored_step"] for e in kinds(job, "restore")]
    assert restored[0] is None and restored[1] >= 5 and restored[2] >= 11
