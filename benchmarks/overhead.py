"""Orchestration overhead: tokens/s of a job run by the orchestrator vs. the same step in a bare loop.

Two pairs, each on the same 4 CPU devices:

- the built-in trainer (`examples/tiny-lm.yaml`): orchestrated vs. `python -m
  workers.reference` (the same trainer, no Ray, no controller, same checkpoints);
- a user's own program (`examples/user-train`, on token files made by `data prepare`):
  submitted as its job file says, through the training API, vs. its own `train_step` in
  a bare jitted loop with no API (`benchmarks/user_bare.py`) saving the same checkpoints with
  orbax (the ratio's baseline, as the built-in pair's), and once without saves.

Runs alternate (bare, orchestrated, ...) and each side keeps its best, because this
machine is shared and noisy. Steady state: the first steps (compile, warm-up) are skipped.

    python benchmarks/overhead.py [--steps 60] [--rounds 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import fresh_client, machine, save, steady_tokens_per_s  # noqa: E402
from orchestrator import JobSpec, JobState  # noqa: E402
from orchestrator.control.launch import launch_order  # noqa: E402
from workers.order import LaunchOrder  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny-lm.yaml"
USER_EXAMPLE = EXAMPLE.parent / "user-train"
SKIP = 3


def user_bare(spec: JobSpec, data: str, *, saves: bool) -> float:
    """The user's step in a bare loop; `saves`: with the job's checkpoints, as the orchestrated run has."""
    w = spec.workload
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "out.json"
        ckpt = ["--checkpoint-dir", f"{d}/ckpt", "--interval", str(spec.checkpoint.interval_steps)] if saves else []
        subprocess.run([sys.executable, str(Path(__file__).parent / "user_bare.py"), "--data", data,
                        "--steps", str(w.steps), "--skip", str(SKIP), "--devices", "4", "--seq-len", str(w.seq_len),
                        "--batch", str(w.global_batch_size), "--args", json.dumps(w.args), "--out", str(out), *ckpt],
                       check=True, cwd=EXAMPLE.parents[1])
        return json.loads(out.read_text())["tokens_per_s"]


def user_spec(steps: int, data: str, name: str) -> JobSpec:
    import yaml

    d = yaml.safe_load((USER_EXAMPLE / "job.yaml").read_text())
    d["workload"].update(steps=steps, data={"path": data})
    d["checkpoint"] = {**d["checkpoint"], "interval_steps": max(1, steps // 3)}
    return JobSpec.from_dict({**d, "name": name, "workdir": str(USER_EXAMPLE)})


def bare(order: LaunchOrder) -> float:
    """The built-in trainer in a plain process (`workers.reference`), saving as the orchestrated run does."""
    settings = order.settings
    with tempfile.TemporaryDirectory() as d:
        order_file, out = Path(d) / "order.pkl", Path(d) / "out.json"
        order_file.write_bytes(pickle.dumps(dataclasses.replace(
            order, settings=dataclasses.replace(settings, checkpoint_dir=f"{d}/ckpt"))))
        subprocess.run([sys.executable, "-m", "workers.reference", "--order", str(order_file), "--devices", "4",
                        "--out", str(out)], check=True, cwd=EXAMPLE.parents[1])
        res = json.loads(out.read_text())
    return steady_tokens_per_s(res["step_times_s"], settings.tokens_per_step)


def orchestrated(client, spec: JobSpec, tokens_per_step: int) -> float:
    job = client.submit(spec)
    st = job.wait(timeout_s=900)
    assert st.state is JobState.SUCCEEDED, st.reason
    return steady_tokens_per_s([m.step_time_s for m in job.metrics()], tokens_per_step, skip=SKIP)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    spec = JobSpec.from_yaml(EXAMPLE)
    data = spec.model_dump(mode="json")
    data["workload"]["steps"] = args.steps
    spec = JobSpec.from_dict(data)
    order = launch_order(spec.model_copy(update={"checkpoint": spec.checkpoint.model_copy(
        update={"directory": "/unused"})}), 4, 1)
    from orchestrator.user.data_prepare import prepare

    tokens = tempfile.mkdtemp(prefix="overhead-tokens-") + "/data"
    prepare(EXAMPLE.parents[1] / "orchestrator", tokens, vocab_size=1024, pattern="*.py")  # as the README says
    client = fresh_client()
    bares, orchs, user_bares, user_nosave, user_apis = [], [], [], [], []
    try:
        for r in range(args.rounds):
            bares.append(bare(order))
            run_spec = JobSpec.from_dict({**data, "name": f"overhead-{r}",
                                          "checkpoint": {**data["checkpoint"], "directory": None}})
            orchs.append(orchestrated(client, run_spec, order.settings.tokens_per_step))
            print(f"round {r}: bare {bares[-1]:,.0f} tokens/s, orchestrated {orchs[-1]:,.0f} tokens/s", flush=True)
            uspec = user_spec(args.steps, tokens, f"overhead-user-{r}")
            user_bares.append(user_bare(uspec, tokens, saves=True))
            user_nosave.append(user_bare(uspec, tokens, saves=False))
            user_apis.append(orchestrated(client, uspec, uspec.workload.seq_len * uspec.workload.global_batch_size))
            print(f"round {r}: user bare loop {user_bares[-1]:,.0f} tokens/s ({user_nosave[-1]:,.0f} without saves), "
                  f"user program under the API "
                  f"{user_apis[-1]:,.0f} tokens/s", flush=True)
    finally:
        client.down()
    save("overhead", {"tokens_per_s_orchestrated": max(orchs), "tokens_per_s_bare": max(bares),
                      "ratio": max(orchs) / max(bares),
                      "tokens_per_s_user_api": max(user_apis), "tokens_per_s_user_bare": max(user_bares),
                      "user_api_ratio": max(user_apis) / max(user_bares),
                      "tokens_per_s_user_bare_no_saves": max(user_nosave),
                      "user_api_ratio_vs_no_saves": max(user_apis) / max(user_nosave),
                      "rounds": {"bare": bares, "orchestrated": orchs, "user_bare": user_bares,
                                 "user_bare_no_saves": user_nosave, "user_api": user_apis},
                      "steps": args.steps, "skip": SKIP, "machine": machine()})


if __name__ == "__main__":
    main()
