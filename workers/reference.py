"""Run the built-in trainer in one plain process, outside the orchestrator.

The reference that tests compare orchestrated runs with (same global batch, any device
count), and the "bare script" baseline of `benchmarks/overhead.py`:

    python -m workers.reference --config cfg.json --devices 8 --out losses.json
"""

from __future__ import annotations

import argparse
import json
import time


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="TrainConfig as JSON (a file path)")
    p.add_argument("--devices", type=int, required=True, help="CPU devices in this process")
    p.add_argument("--out", required=True, help="where to write {losses, step_times_s, ...} as JSON")
    p.add_argument("--compile-cache", default=None)
    args = p.parse_args(argv)

    from workers import runtime

    runtime.configure(platform="cpu", devices_per_host=args.devices, compile_cache_dir=args.compile_cache)
    from workers.protocol import StepDone
    from workers.train import TrainConfig, Trainer, context_for, param_checksums

    with open(args.config) as f:
        cfg = TrainConfig.from_dict(json.load(f))
    losses, times = [], []

    def send(report):
        if isinstance(report, StepDone):
            losses.append(report.loss)
            times.append(report.step_time_s)

    t0 = time.perf_counter()
    state, done = Trainer(cfg, context_for(cfg, send=send)).run()
    params = param_checksums(state["params"])
    with open(args.out, "w") as f:
        json.dump({"losses": losses, "step_times_s": times, "steps": done, "wall_s": time.perf_counter() - t0,
                   "tokens_per_step": cfg.tokens_per_step, "param_sums": params}, f)


if __name__ == "__main__":
    main()
