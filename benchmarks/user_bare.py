"""The user example's own train step in a bare loop: no orchestrator, no training API.

What a user would write without the tool: the program's `init`, `make_train_step` and
optimizer from `examples/user-train/train.py`, the same batches (token rows of step s
for seed 0) put on a mesh of this process's devices, one jitted step after another,
timed after `--skip` warm-up steps (with `--checkpoint-dir`, saved as the job's checkpoint
settings say, with orbax, asynchronously, as a user's script would), the loss read after each (as a loop that logs it
does; queuing every step unread also stalls XLA's CPU collectives when 4 devices share
2 busy cores). `benchmarks/overhead.py` runs it beside the same program submitted to the
orchestrator.

    python benchmarks/user_bare.py --data DIR --steps 60 --devices 4 --out bare.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_example(path: Path):
    """The user's module, loaded from its file (it is not a package of this project)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("user_train", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--skip", type=int, default=3)
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--args", default="{}", help="the job's workload.args as JSON")
    p.add_argument("--checkpoint-dir", default=None,
                   help="save as a user's script would: orbax, async, every --interval")
    p.add_argument("--interval", type=int, default=20)
    p.add_argument("--out", required=True)
    a = p.parse_args()

    from workers import runtime

    runtime.configure(platform="cpu", devices_per_host=a.devices, compile_cache_dir=None)
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from workers.data import open_dataset

    user = load_example(ROOT / "examples" / "user-train" / "train.py")

    dataset = open_dataset(a.data)
    cfg = user.Config(**{**json.loads(a.args), "vocab_size": dataset.vocab_size})
    optimizer = user.make_optimizer(cfg, a.steps)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    rows = NamedSharding(mesh, P("data"))

    def init(key):
        params = user.init_params(key, cfg)
        return {"params": params, "opt_state": optimizer.init(params)}

    state = jax.jit(init, out_shardings=NamedSharding(mesh, P()))(jax.random.key(0))
    step_fn = jax.jit(user.make_train_step(cfg, optimizer), donate_argnums=0)
    manager = None
    if a.checkpoint_dir:
        import orbax.checkpoint as ocp

        manager = ocp.CheckpointManager(a.checkpoint_dir, options=ocp.CheckpointManagerOptions(
            max_to_keep=3, enable_async_checkpointing=True, create=True))
    t0 = None
    for step in range(a.steps):
        if step == a.skip:
            jax.block_until_ready(state)
            t0 = time.perf_counter()
        batch = jax.device_put(dataset.rows(0, step, a.batch, a.seq_len, slice(None)), rows)
        state, metrics = step_fn(state, batch)
        loss = float(metrics["loss"])
        if manager and ((step + 1) % a.interval == 0 or step + 1 == a.steps):
            manager.save(step + 1, args=ocp.args.StandardSave(state))
    if manager:
        manager.wait_until_finished()
    jax.block_until_ready(state)
    seconds = time.perf_counter() - t0
    tokens = a.batch * a.seq_len * (a.steps - a.skip)
    Path(a.out).write_text(json.dumps({"tokens_per_s": tokens / seconds, "seconds": seconds,
                                       "final_loss": loss}))


if __name__ == "__main__":
    main()
