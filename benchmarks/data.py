"""Token files: how fast `data prepare` tokenizes, and what reading a host's rows costs against the byte corpus.

The text is the same standard-library source the byte corpus is made of (its first
4 MiB, copied as .txt files), so both datasets hold the same text. Reading is timed for
one host's rows of a batch (a quarter of the global batch, as on a 4-host slice), over
many steps, each a fresh set of random offsets: the byte corpus (the baseline, measured
in the same run), token files memory-mapped from one file and from many, and the same
files read by byte ranges through fsspec (`memory://`, the path a `gs://` URL takes,
without the network).

    python benchmarks/data.py [--vocab-size 8192] [--steps 200]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fsspec  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import machine, save  # noqa: E402
from orchestrator.user.data_prepare import prepare  # noqa: E402
from workers import data  # noqa: E402
from workers.data import open_dataset  # noqa: E402
from workers.token_writer import TokenWriter  # noqa: E402

GLOBAL_BATCH, SEQ_LEN, HOSTS = 64, 1024, 4


def write_text(folder: Path) -> int:
    """The byte corpus's text as .txt files of about 256 KiB; returns the bytes written."""
    blob = data.corpus().tobytes().decode("utf-8", errors="replace")
    size = 1 << 18
    for i in range(0, len(blob), size):
        (folder / f"part-{i // size:03d}.txt").write_text(blob[i:i + size], encoding="utf-8")
    return len(blob.encode())


def time_rows(ds, steps: int) -> float:
    """Median seconds to read one host's rows of a batch."""
    rows = slice(0, GLOBAL_BATCH // HOSTS)
    ds.rows(0, 0, GLOBAL_BATCH, SEQ_LEN, rows)  # first touch: maps, caches
    times = []
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        ds.rows(0, step, GLOBAL_BATCH, SEQ_LEN, rows)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-data-"))
    url = f"memory://bench-{uuid.uuid4().hex}"
    try:
        (root / "text").mkdir()
        text_bytes = write_text(root / "text")
        t0 = time.perf_counter()
        summary = prepare(root / "text", root / "tokens", vocab_size=args.vocab_size)
        prepare_s = time.perf_counter() - t0

        one = open_dataset(str(root / "tokens"))
        stream = np.fromfile(root / "tokens" / "tokens-00000.bin", dtype=summary.dtype)
        with TokenWriter(root / "shards", vocab_size=one.vocab_size, eos_id=summary.eos_id,
                         shard_tokens=-(-one.num_tokens // 64)) as w:  # the same tokens in 64 files
            w.add(stream)
        fs = fsspec.filesystem("memory")
        for f in (root / "tokens").iterdir():
            fs.pipe_file(f"{url}/{f.name}", f.read_bytes())

        byte_s = time_rows(open_dataset(None), args.steps)
        timed = {"token_files_one_file": time_rows(one, args.steps),
                 "token_files_64_files": time_rows(open_dataset(str(root / "shards")), args.steps),
                 "token_files_memory_url": time_rows(open_dataset(url), args.steps)}
    finally:
        shutil.rmtree(root, ignore_errors=True)
        fsspec.filesystem("memory").rm(url, recursive=True)

    rows = GLOBAL_BATCH // HOSTS
    save("data", {
        "machine": machine(),
        "prepare": {"text_bytes": text_bytes, "files": summary.files, "tokens": summary.tokens,
                    "vocab_size": summary.vocab_size, "bytes_per_token": round(text_bytes / summary.tokens, 3),
                    "seconds": round(prepare_s, 2), "text_mb_per_s": round(text_bytes / prepare_s / 1e6, 2)},
        "read": {"rows_per_host": rows, "seq_len": SEQ_LEN, "steps": args.steps,
                 "byte_corpus_ms": round(byte_s * 1e3, 3),
                 **{f"{k}_ms": round(v * 1e3, 3) for k, v in timed.items()},
                 **{f"{k}_vs_byte_corpus": round(v / byte_s, 2) for k, v in timed.items()},
                 "token_files_one_file_tokens_per_s": round(rows * (SEQ_LEN + 1) / timed["token_files_one_file"])},
    })


if __name__ == "__main__":
    main()
