"""Run a job's training in one plain process, outside the orchestrator.

The reference that tests compare orchestrated runs with (same global batch, any device
count), and the "bare script" baseline of `benchmarks/overhead.py`. It runs the workload a
job's hosts get (`orchestrator.control.launch.workload_for`: the built-in trainer or a user
program on the training API, with its `workers.settings` as they are), pickled to a file:

    python -m workers.reference --workload workload.pkl --devices 8 --out losses.json
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import pickle
import sys
import time


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", required=True,
                   help="a host's workload, pickled (a file path); its settings' checkpoint_dir is used if set")
    p.add_argument("--devices", type=int, required=True, help="CPU devices in this process")
    p.add_argument("--out", required=True, help="where to write {losses, step_times_s, ...} as JSON")
    p.add_argument("--compile-cache", default=None)
    args = p.parse_args(argv)

    from workers import runtime

    runtime.configure(platform="cpu", devices_per_host=args.devices, compile_cache_dir=args.compile_cache)
    from workers import api
    from workers.protocol import StepDone

    losses, times = [], []

    def send(report):
        if isinstance(report, StepDone):
            losses.append(report.loss)
            times.append(report.step_time_s)

    t0 = time.perf_counter()
    with open(args.workload, "rb") as pickled:
        workload = pickle.load(pickled)
    settings = workload["settings"]
    if workload["type"] == "lm":
        from workers.train import Trainer

        ctx = api.Context(settings=settings, send=send)
        Trainer(workload["lm"], ctx).run()
    else:
        if workload.get("workdir"):
            sys.path.insert(0, workload["workdir"])
        module, fn = workload["entrypoint"].split(":")
        # This process's devices, all on `data`.
        ctx = api.Context(args=workload.get("args", {}), settings=dataclasses.replace(settings, mesh_shape=None),
                          send=send)
        getattr(importlib.import_module(module), fn)(ctx)
    loop = ctx.last_loop
    if loop is None:
        sys.exit("the program ran no ctx.loop: there are no steps to compare")
    state = loop.state
    params = state["params"] if isinstance(state, dict) and "params" in state else state
    with open(args.out, "w") as f:
        json.dump({"losses": losses, "step_times_s": times, "steps": loop.step,
                   "wall_s": time.perf_counter() - t0, "tokens_per_step": settings.tokens_per_step or 0,
                   "param_sums": api.param_checksums(params)}, f)


if __name__ == "__main__":
    main()
