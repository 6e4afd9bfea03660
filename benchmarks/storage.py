"""Checkpoints in a bucket against checkpoints on disk: save and restore of the built-in ~100M model's state.

The state is what the built-in trainer checkpoints (`workers.train.Trainer`: float32
parameters, AdamW's two moments, the step; the ~100M preset of `benchmarks/mfu.py`, about
1.2 GB), saved and restored through the workers' own `workers.checkpoints.Checkpoints`
(orbax, asynchronous saves) to a folder on local disk and to a bucket of the local GCS
emulator (`orchestrator.emulator.storage`, over HTTP on 127.0.0.1), alternately, in the
same run. Each repetition saves into a fresh folder and restores from it in a fresh
manager; the figures are medians over the repetitions, and the ratios bucket / disk.

    python benchmarks/storage.py                # ~100M, 3 repetitions (a few minutes on 2 cores)
    python benchmarks/storage.py --preset tiny  # a quick check of the harness

Times: `save_blocking_s`, how long `save` holds the training loop (the device-to-host copy;
the writing goes on in the background); `save_s`, until the step is committed (`close`);
`restore_s`, until every array of the state is in memory. The emulator is a single Python
process that keeps objects in memory, so the ratio says what going through the GCS clients
and HTTP costs on this machine, not what Cloud Storage's network would.

Writes `benchmarks/results/storage.json` (`--out` elsewhere).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import machine, save  # noqa: E402

PRESETS = {  # the built-in model's shape (benchmarks/mfu.py's presets)
    "100m": dict(d_model=768, n_layers=14, n_heads=12, n_kv_heads=12, d_ff=3072, vocab_size=256),
    "tiny": dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, d_ff=128, vocab_size=256),
}


def training_state(preset: str):
    """The built-in trainer's initial state for the preset (on this process's CPU device) and its abstract twin."""
    import jax

    from policies.model.shape import ModelShape
    from workers import api
    from workers.settings import LmSettings
    from workers.train import Trainer

    lm = LmSettings(model=ModelShape(**PRESETS[preset]), lr_peak=3e-4, lr_end=3e-5, warmup_steps=2, weight_decay=0.01)
    trainer = Trainer(lm, api.local_context(steps=10, seq_len=128, global_batch_size=8, mesh_shape=(1, 1, 1)))
    state = trainer.init_state()
    jax.block_until_ready(state)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
    return state, trainer.abstract_state, nbytes, lm.model.num_params()


def save_and_restore(folder: str, state, abstract) -> dict:
    import jax

    from workers.checkpoints import Checkpoints

    ckpts = Checkpoints(folder, keep=1)
    t0 = time.perf_counter()
    assert ckpts.save(1, state, {"seed": 0})
    blocking = time.perf_counter() - t0
    ckpts.close()
    saved = time.perf_counter() - t0
    t0 = time.perf_counter()
    reader = Checkpoints(folder, keep=1)
    found, unreadable = reader.restore_newest(abstract)
    jax.block_until_ready(found.state)
    restored = time.perf_counter() - t0
    reader.close()
    assert found.step == 1 and not unreadable
    return {"save_blocking_s": blocking, "save_s": saved, "restore_s": restored}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="100m")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None, help="default: benchmarks/results/storage.json")
    args = p.parse_args()

    from orchestrator.emulator.storage import running_storage
    from workers import runtime, storage

    runtime.configure(platform="cpu", devices_per_host=1)
    t_start, load_start = time.perf_counter(), os.getloadavg()[0]
    state, abstract, nbytes, params = training_state(args.preset)
    runs: dict[str, list[dict]] = {"disk": [], "bucket": []}
    with running_storage(buckets=("bench",)) as gcs, tempfile.TemporaryDirectory(prefix="bench-ckpt-") as disk:
        storage.configure(gcs.url)
        for rep in range(args.repeats):  # alternately, so that drift on a shared machine hits both alike
            for where, folder in (("disk", f"{disk}/run-{rep}"), ("bucket", f"gs://bench/run-{rep}")):
                r = save_and_restore(folder, state, abstract)
                runs[where].append(r)
                storage.remove_tree(folder)  # the emulator keeps objects in memory
                print(json.dumps({"where": where, "rep": rep, **{k: round(v, 3) for k, v in r.items()}}), flush=True)
        storage.configure(None)
    medians = {w: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for w, rs in runs.items()}
    gib = nbytes / 2**30
    result = {
        "preset": args.preset, "params": params, "state_bytes": nbytes, "repeats": args.repeats,
        "machine": machine(),
        "median": {w: {k: round(v, 3) for k, v in m.items()} for w, m in medians.items()},
        "ratio_bucket_over_disk": {k: round(medians["bucket"][k] / medians["disk"][k], 2) for k in medians["disk"]},
        "throughput_gib_per_s": {w: {"save": round(gib / m["save_s"], 3), "restore": round(gib / m["restore_s"], 3)}
                                 for w, m in medians.items()},
        "runs": runs,
        "wall_s": round(time.perf_counter() - t_start, 1),
        "load_average_1m": [round(load_start, 1), round(os.getloadavg()[0], 1)],  # at start and end: a busy machine
                                                                                   # slows disk and bucket alike
        "note": "bucket: the local GCS emulator (gcp-storage-emulator in one Python process, in memory) over HTTP "
                "on 127.0.0.1, through tensorstore and gcsfs; disk: a temporary folder. Medians over the repeats.",
    }
    save("storage", result) if args.out is None else Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
