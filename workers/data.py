"""Training data: a real byte corpus that every machine has, in a reproducible order.

The corpus is the Python standard library's own source files (sorted by path, read as
bytes, capped at `CORPUS_BYTES`), so nothing is downloaded and every host of a slice
sees the same bytes. Batch `step` is a pure function of `(seed, step)`: a resumed
run, or one on a slice of another size, sees exactly the rows an uninterrupted run
would, and each process reads only the rows its devices hold.

It is the zero-setup default dataset: `ByteCorpus` reads it through the same interface
as a folder of token files (`workers.tokens.Dataset`), with the same row offsets.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sysconfig
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from workers import tokens

CORPUS_BYTES = 4 * 1024 * 1024
_corpus_lock = threading.Lock()  # threads that ask at once (a preload and the trainer) read it once


def corpus() -> np.ndarray:
    """The corpus as a uint8 array (about 4 MiB)."""
    with _corpus_lock:
        return _read_corpus()


@functools.lru_cache(maxsize=1)
def _read_corpus() -> np.ndarray:
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in _sources(root):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= CORPUS_BYTES:
            break
    blob = b"".join(chunks)[:CORPUS_BYTES]
    if len(blob) < 1 << 20:
        raise RuntimeError(f"the standard library under {root} gave only {len(blob)} bytes of corpus")
    return np.frombuffer(blob, dtype=np.uint8)


def _sources(folder: Path) -> Iterator[Path]:
    """The `.py` files under `folder` in the order of their sorted paths, but for those under a `test` or
    `site-packages` folder, found lazily: the corpus's 4 MiB come from the first few hundred, and the whole
    tree (with its installed packages) is some 60,000 entries, a second of CPU in every process that read it.

    A folder's entries are visited by name, files and folders together, a folder's before the next name's: the
    order of the paths' parts, as `sorted` orders paths. Links to folders are not followed.
    """
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if entry.is_dir(follow_symlinks=False):
            if entry.name not in ("test", "site-packages"):
                yield from _sources(Path(entry.path))
        elif entry.name.endswith(".py"):
            yield Path(entry.path)


def corpus_fingerprint() -> str:
    """A short hash of the corpus, recorded with results so runs on other machines are not compared blindly."""
    return hashlib.sha256(corpus().tobytes()).hexdigest()[:12]


def row_offsets(seed: int, step: int, global_batch_size: int, seq_len: int) -> np.ndarray:
    """Start offsets of every row of batch `step` (the whole global batch; cheap)."""
    return tokens.row_offsets(seed, step, global_batch_size, seq_len, len(corpus()))


def batch_rows(seed: int, step: int, global_batch_size: int, seq_len: int, rows: slice) -> np.ndarray:
    """Rows `rows` of batch `step`: int32 tokens [rows, seq_len + 1] (inputs and shifted targets)."""
    data = corpus()
    offsets = row_offsets(seed, step, global_batch_size, seq_len)[rows]
    idx = offsets[:, None] + np.arange(seq_len + 1)[None, :]
    return data[idx].astype(np.int32)


class ByteCorpus:
    """The corpus as a `workers.tokens.Dataset`: byte-level tokens, vocabulary 256."""

    vocab_size = 256

    def __repr__(self) -> str:
        return f"ByteCorpus({self.num_tokens:,} bytes of the standard library)"

    @property
    def num_tokens(self) -> int:
        return len(corpus())

    @property
    def fingerprint(self) -> str:
        return corpus_fingerprint()

    def rows(self, seed: int, step: int, global_batch_size: int, seq_len: int, rows: slice) -> np.ndarray:
        return batch_rows(seed, step, global_batch_size, seq_len, rows)


def open_dataset(path: str | None) -> tokens.Dataset:
    """The dataset a job names: the token files at `path` (local or a URL), or with None
    the standard library's bytes."""
    return ByteCorpus() if path is None else tokens.open_tokens(path)
