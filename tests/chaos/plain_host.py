"""One host of a multi-host JAX runtime made of plain processes: the built-in trainer on the training API.

What `workers.host.HostWorker` runs, without Ray: `runtime.initialize` joins the others
over gloo, the trainer restores the newest checkpoint and trains, the loop saves and
agrees on stops. Two faults a host can meet alone are injected through the host's own
hooks, as a worker's are wired:

- ``--notice-at K``: this host gets a preemption notice at the K-th step boundary;
- ``--fence-fails K``: this host's K-th fence read fails (an unreachable bucket, say).

    python -m tests.chaos.plain_host --rank R --hosts N --port P --order order.pkl --out out.json [...]

Writes {"restored_step", "steps", "losses": {step: loss}} (every host's own reports) to --out.
"""

from __future__ import annotations

import argparse
import json
import pickle

SHARE_KEY = b"plain-hosts-of-one-test-machine!"  # process 0 compiles, the others load its program


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--hosts", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--order", required=True, help="the built-in trainer's launch order as a host gets it, pickled")
    p.add_argument("--out", required=True)
    p.add_argument("--compile-cache", default=None, help="kept programs, shared by the hosts and by launches")
    p.add_argument("--notice-at", type=int, default=None)
    p.add_argument("--fence-fails", type=int, default=None)
    args = p.parse_args()

    from workers import runtime

    runtime.configure(platform="cpu", devices_per_host=args.devices, compile_cache_dir=args.compile_cache)
    runtime.initialize(coordinator_address=f"127.0.0.1:{args.port}", num_processes=args.hosts,
                       process_id=args.rank, host_address="127.0.0.1", share_key=SHARE_KEY)
    from workers import api
    from workers.order import BuiltInTrainer
    from workers.profiling import Profiler
    from workers.protocol import StepDone
    from workers.train import Trainer

    with open(args.order, "rb") as f:
        order = pickle.load(f)
    assert isinstance(order.program, BuiltInTrainer), "these hosts run the built-in trainer"
    losses: dict[int, float] = {}
    boundaries, fence_reads = [0], [0]

    def send(report) -> None:
        if isinstance(report, StepDone):
            losses[report.step] = report.loss

    def noticed() -> bool:
        boundaries[0] += 1
        return args.notice_at is not None and boundaries[0] >= args.notice_at

    def may_write() -> bool:
        fence_reads[0] += 1
        return fence_reads[0] != args.fence_fails

    profiler = Profiler(args.rank, args.hosts, send)  # the host's vote: one all-gather a step
    ctx = api.Context(rank=args.rank, num_hosts=args.hosts, settings=order.settings, send=send,
                      may_write=may_write, agreed_stop=lambda: profiler.vote(noticed()), profiler=profiler)
    Trainer(order.program.lm, ctx).run()
    with open(args.out, "w") as f:
        json.dump({"restored_step": ctx.restored_step, "steps": ctx.last_loop.step, "losses": losses}, f)


if __name__ == "__main__":
    main()
