"""Run a job's training in one plain process, outside the orchestrator.

The reference that tests compare orchestrated runs with (same global batch, any device
count), and the "bare script" baseline of `benchmarks/overhead.py`. It runs the launch order a
job's hosts get (`orchestrator.control.launch.launch_order`: the built-in trainer or a user
program on the training API, with its `workers.settings` as they are), pickled to a file:

    python -m workers.reference --order order.pkl --devices 8 --out losses.json
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
    p.add_argument("--order", required=True,
                   help="a host's launch order, pickled (a file path); its settings' checkpoint_dir is used if set")
    p.add_argument("--devices", type=int, required=True, help="CPU devices in this process")
    p.add_argument("--out", required=True, help="where to write {losses, step_times_s, ...} as JSON")
    p.add_argument("--compile-cache", default=None)
    args = p.parse_args(argv)

    from workers import runtime

    runtime.configure(platform="cpu", devices_per_host=args.devices, compile_cache_dir=args.compile_cache)
    from workers import api
    from workers.order import BuiltInTrainer, LaunchOrder
    from workers.protocol import StepDone

    losses, times = [], []

    def send(report):
        if isinstance(report, StepDone):
            losses.append(report.loss)
            times.append(report.step_time_s)

    t0 = time.perf_counter()
    with open(args.order, "rb") as pickled:
        order: LaunchOrder = pickle.load(pickled)
    settings, program = order.settings, order.program
    if isinstance(program, BuiltInTrainer):
        from workers.train import Trainer

        ctx = api.Context(settings=settings, send=send)
        Trainer(program.lm, ctx).run()
    else:
        if program.workdir:
            sys.path.insert(0, program.workdir)
        # This process's devices, all on `data`.
        ctx = api.Context(args=program.args, settings=dataclasses.replace(settings, mesh_shape=None), send=send)
        getattr(importlib.import_module(program.module), program.function)(ctx)
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
