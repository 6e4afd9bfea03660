"""Run a job's training in one plain process, outside the orchestrator.

The reference that tests compare orchestrated runs with (same global batch, any device
count), and the "bare script" baseline of `benchmarks/overhead.py`. Either the built-in
trainer's config, or the workload a job's hosts get (`orchestrator.control.launch.workload_for`:
the built-in trainer or a user program on the training API):

    python -m workers.reference --config cfg.json --devices 8 --out losses.json
    python -m workers.reference --workload workload.json --devices 8 --out losses.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--config", help="the built-in trainer's TrainConfig as JSON (a file path)")
    which.add_argument("--workload", help="a host's workload as JSON (a file path); its checkpoints are not used")
    p.add_argument("--devices", type=int, required=True, help="CPU devices in this process")
    p.add_argument("--out", required=True, help="where to write {losses, step_times_s, ...} as JSON")
    p.add_argument("--compile-cache", default=None)
    args = p.parse_args(argv)

    from workers import runtime

    runtime.configure(platform="cpu", devices_per_host=args.devices, compile_cache_dir=args.compile_cache)
    from workers import api
    from workers.protocol import StepDone
    from workers.train import TrainConfig, Trainer, context_for

    losses, times = [], []

    def send(report):
        if isinstance(report, StepDone):
            losses.append(report.loss)
            times.append(report.step_time_s)

    t0 = time.perf_counter()
    if args.config:
        with open(args.config) as f:
            cfg = TrainConfig.from_dict(json.load(f))
        ctx = context_for(cfg, send=send)
        Trainer(cfg, ctx).run()
        tokens_per_step = cfg.tokens_per_step
    else:
        with open(args.workload) as f:
            workload = json.load(f)
        if workload["type"] == "lm":
            cfg = TrainConfig.from_dict({**workload["config"], "checkpoint_dir": None})
            ctx = context_for(cfg, send=send)
            Trainer(cfg, ctx).run()
        else:
            if workload.get("workdir"):
                sys.path.insert(0, workload["workdir"])
            module, fn = workload["entrypoint"].split(":")
            training = {**workload["training"], "mesh_shape": None}  # this process's devices, all on `data`
            ctx = api.Context(args=workload.get("args", {}), send=send, **training)
            getattr(importlib.import_module(module), fn)(ctx)
        tokens_per_step = (ctx.seq_len or 0) * (ctx.global_batch_size or 0)
    loop = ctx.last_loop
    if loop is None:
        sys.exit("the program ran no ctx.loop: there are no steps to compare")
    state = loop.state
    params = state["params"] if isinstance(state, dict) and "params" in state else state
    with open(args.out, "w") as f:
        json.dump({"losses": losses, "step_times_s": times, "steps": loop.step,
                   "wall_s": time.perf_counter() - t0, "tokens_per_step": tokens_per_step,
                   "param_sums": api.param_checksums(params)}, f)


if __name__ == "__main__":
    main()
