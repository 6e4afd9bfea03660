"""Every host issues the same collectives in the same order, whatever one host decides alone.

A 4-host runtime of plain processes (`plain_host`: real JAX over gloo, real orbax, the
built-in trainer on the training API; no Ray, so no cluster is needed) saving every 2
steps. The first launch stops after step 3 on a notice to host 1 (that step committed);
the second restores it, and host 1 alone fails to read the fence at the first save after
the restore. That save used to be skipped on host 1 only, while the other hosts went into
orbax's save and its gloo barriers: the job hung or aborted in gloo ("Received data size
doesn't match expected size. Is there a distributed collective mismatch"). Now no host
writes that step, and the run ends with the losses of an undisturbed single-process run.
"""

from __future__ import annotations

import json
import pickle
import socket
import subprocess
import sys
from pathlib import Path

from orchestrator import JobSpec
from orchestrator.control.launch import launch_order
from tests.conftest import REPO, assert_losses_close, start_reference

HOSTS, STEPS = 4, 8
LAUNCH_TIMEOUT_S = 150  # a launch that hangs in a collective mismatch ends here


def _spec(ckpt: Path) -> JobSpec:
    return JobSpec.from_dict({
        "name": "collective-order", "accelerator": "v4-32",
        "workload": {"type": "lm", "steps": STEPS, "global_batch_size": 16, "seq_len": 32,
                     "model": {"d_model": 64, "n_layers": 1, "n_heads": 4, "d_ff": 256},
                     "learning_rate": {"warmup_steps": 2}},
        "checkpoint": {"interval_steps": 2, "keep": 3, "directory": str(ckpt)}})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(order_file: Path, out: Path, **faults_of_host_1) -> list[dict]:
    """Run every host to its end; each host's report. Fails on a hang, a crash, or a gloo error."""
    port = _free_port()
    procs = []
    faults = [a for k, v in faults_of_host_1.items() for a in (f"--{k.replace('_', '-')}", str(v))]
    for rank in range(HOSTS):
        extra = faults if rank == 1 else []
        cmd = [sys.executable, "-m", "tests.chaos.plain_host", "--rank", str(rank), "--hosts", str(HOSTS),
               "--port", str(port), "--order", str(order_file), "--out", str(out / f"host{rank}.json"),
               "--compile-cache", str(out.parent / "compile-cache"), *extra]
        procs.append(subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=LAUNCH_TIMEOUT_S)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise AssertionError(f"the hosts did not finish within {LAUNCH_TIMEOUT_S} s "
                             "(a collective mismatch hangs)") from None
    for rank, (p, text) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"host {rank} exited {p.returncode}:\n{text[-3000:]}"
        assert "enforce fail" not in text and "collective mismatch" not in text, text[-3000:]
    return [dict(json.loads((out / f"host{rank}.json").read_text()), log=outputs[rank]) for rank in range(HOSTS)]


def test_a_restored_slice_whose_host_alone_declines_a_save_stays_in_step(tmp_path):
    spec = _spec(tmp_path / "ckpt")
    order_file = tmp_path / "order.pkl"
    order_file.write_bytes(pickle.dumps(launch_order(spec, spec.tpu_type.chips, spec.tpu_type.hosts)))
    reference = start_reference(spec, devices=HOSTS * 4, tmp_path=tmp_path / "ref")  # trains beside the hosts

    (tmp_path / "a").mkdir()
    first = _launch(order_file, tmp_path / "a", notice_at=3)  # every host stops after step 3, committed
    assert [h["steps"] for h in first] == [3] * HOSTS

    (tmp_path / "b").mkdir()
    second = _launch(order_file, tmp_path / "b", fence_fails=1)  # host 1 alone cannot read the fence at step 4
    assert [h["restored_step"] for h in second] == [3] * HOSTS
    assert [h["steps"] for h in second] == [STEPS] * HOSTS
    for h in second:  # no host wrote step 4; each says why
        assert "not saving step 4" in h["log"], h["log"][-2000:]
    assert sorted(int(p.name) for p in (tmp_path / "ckpt").iterdir() if p.name.isdigit()) == [3, 6, 8]

    losses = {int(k): v for h in (first[0], second[0]) for k, v in h["losses"].items()}
    assert sorted(losses) == list(range(STEPS))
    assert_losses_close([losses[s] for s in range(STEPS)], reference.result()["losses"], rtol=1e-5)
