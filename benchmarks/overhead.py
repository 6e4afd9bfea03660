"""Orchestration overhead: tokens/s of the example job run by the orchestrator vs. a bare script.

Both run the same train step on the same 4 CPU devices with the same checkpoints; the
bare run is `python -m workers.reference` (no Ray, no controller). Runs alternate
(bare, orchestrated, bare, orchestrated) and each side keeps its best, because this
machine is shared and noisy. Steady state: the first steps (compile, warm-up) are skipped.

    python benchmarks/overhead.py [--steps 60]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import fresh_client, machine, save, steady_tokens_per_s  # noqa: E402
from orchestrator import JobSpec, JobState  # noqa: E402
from orchestrator.control.launch import train_config  # noqa: E402
from workers.train import TrainConfig  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny-lm.yaml"


def bare(cfg: TrainConfig) -> float:
    with tempfile.TemporaryDirectory() as d:
        cfg_file, out = Path(d) / "cfg.json", Path(d) / "out.json"
        cfg_file.write_text(json.dumps(dataclasses.replace(cfg, checkpoint_dir=f"{d}/ckpt").to_dict()))
        subprocess.run([sys.executable, "-m", "workers.reference", "--config", str(cfg_file), "--devices", "4",
                        "--out", str(out)], check=True, cwd=EXAMPLE.parents[1])
        res = json.loads(out.read_text())
    return steady_tokens_per_s(res["step_times_s"], cfg.tokens_per_step)


def orchestrated(client, spec: JobSpec, tokens_per_step: int) -> float:
    job = client.submit(spec)
    st = job.wait(timeout_s=900)
    assert st.state is JobState.SUCCEEDED, st.reason
    return steady_tokens_per_s([m.step_time_s for m in job.metrics()], tokens_per_step)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    spec = JobSpec.from_yaml(EXAMPLE)
    data = spec.model_dump(mode="json")
    data["workload"]["steps"] = args.steps
    spec = JobSpec.from_dict(data)
    cfg = train_config(spec.model_copy(update={"checkpoint": spec.checkpoint.model_copy(
        update={"directory": "/unused"})}), 4, 1)
    client = fresh_client()
    bares, orchs = [], []
    try:
        for r in range(args.rounds):
            bares.append(bare(cfg))
            run_spec = JobSpec.from_dict({**data, "name": f"overhead-{r}",
                                          "checkpoint": {**data["checkpoint"], "directory": None}})
            orchs.append(orchestrated(client, run_spec, cfg.tokens_per_step))
            print(f"round {r}: bare {bares[-1]:,.0f} tokens/s, orchestrated {orchs[-1]:,.0f} tokens/s", flush=True)
    finally:
        client.down()
    save("overhead", {"tokens_per_s_orchestrated": max(orchs), "tokens_per_s_bare": max(bares),
                      "ratio": max(orchs) / max(bares), "rounds": {"bare": bares, "orchestrated": orchs},
                      "steps": args.steps, "machine": machine()})


if __name__ == "__main__":
    main()
