"""Writing token files (`workers.tokens` describes the format and reads it): atomically, with their index.

`orchestrator data prepare` writes through `TokenWriter`; the benchmarks and tests do too.
The folder may be in a bucket (``gs://bucket/tokens``, `workers.storage`): the files are
written in a local temporary folder, then uploaded with index.json last, so a reader
(which starts from the index) never sees a part.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import numpy as np

from workers import storage
from workers.tokens import DTYPES, INDEX, SHARD_TOKENS, DataError, Index, TokenFile

if TYPE_CHECKING:
    from _hashlib import HASH

log = logging.getLogger(__name__)


def dtype_for(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def refuse_existing(out: Path | str, *, force: bool) -> None:
    """A DataError if `out` is a file, or a non-empty folder that `force` does not allow to replace."""
    if storage.is_url(out):
        if storage.isdir(out) and not force:  # a bucket has no empty folders
            raise DataError(str(out), "exists and is not empty (--force replaces it)")
        if not storage.isdir(out) and storage.exists(out):
            raise DataError(str(out), "exists and is not a folder")
        return
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise DataError(str(out), "exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise DataError(str(out), "exists and is not empty (--force replaces it)")


class TokenWriter:
    """Writes a folder of token files atomically: into a temporary folder beside `out`, renamed on success.

    Use as a context manager; `add` one document's tokens at a time (the EOS id goes
    between documents). An exception inside leaves nothing at `out`. With `force`, an
    existing `out` is replaced; without, a non-empty one is refused before anything is written.

    Example::

        with TokenWriter("out", vocab_size=8192, eos_id=0) as w:
            for doc in docs:
                w.add(tokenizer.encode(doc).ids)
            w.set_tokenizer(tokenizer.to_str())
    """

    def __init__(self, out: str | Path, *, vocab_size: int, eos_id: int, force: bool = False,
                 shard_tokens: int = SHARD_TOKENS):
        self.out = str(out).rstrip("/") if storage.is_url(out) else Path(out)
        refuse_existing(self.out, force=force)
        if not 0 <= eos_id < vocab_size:
            raise DataError(str(self.out), f"eos id {eos_id} is outside the vocabulary (size {vocab_size})")
        self.vocab_size, self.eos_id, self.shard_tokens = vocab_size, eos_id, shard_tokens
        self.dtype = dtype_for(vocab_size)
        self._tokenizer: str | None = None  # the tokenizer file's name in the folder, once set
        self._tmp: Path | None = None
        self._files: list[TokenFile] = []
        self._current: tuple[BinaryIO, str, int, int, HASH] | None = None  # (file object, name, tokens, max, hash)
        self._docs = 0

    def __enter__(self) -> "TokenWriter":
        if isinstance(self.out, str):  # a URL (a local folder is a Path): staged here, uploaded at the end
            self._tmp = Path(tempfile.mkdtemp(prefix="tokens-"))
            return self
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.tmp-", dir=self.out.parent))
        return self

    def add(self, tokens, *, continues: bool = False) -> None:
        """Append one document (a sequence of token ids), preceded by EOS unless it is the first;
        with `continues`, append more of the last document (a long one is written a part at a time)."""
        ids = np.asarray(tokens, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise DataError(str(self.out), f"document {self._docs - continues} has token ids outside "
                                           f"[0, {self.vocab_size})")
        if not (continues and self._docs):
            if self._docs:
                ids = np.concatenate([[self.eos_id], ids])
            self._docs += 1
        arr = ids.astype(DTYPES[self.dtype])
        while arr.size:
            if self._current is None or self._current[2] == self.shard_tokens:
                self._roll()
            assert self._current is not None, "_roll opened the next file"
            f, name, n, mx, h = self._current
            take = arr[:self.shard_tokens - n]
            data = take.tobytes()
            f.write(data)
            h.update(data)
            self._current = (f, name, n + take.size, max(mx, int(take.max())), h)
            arr = arr[take.size:]

    def set_tokenizer(self, tokenizer_json: str) -> None:
        """Keep the tokenizer that made the tokens (a `tokenizers` JSON text) beside them, as tokenizer.json."""
        (self._staging / "tokenizer.json").write_text(tokenizer_json)
        self._tokenizer = "tokenizer.json"

    def _roll(self) -> None:
        self._finish_file()
        name = f"tokens-{len(self._files):05d}.bin"
        self._current = (open(self._staging / name, "wb"), name, 0, -1, hashlib.sha256())

    def _finish_file(self) -> None:
        if self._current is None:
            return
        f, name, n, mx, h = self._current
        f.flush()
        os.fsync(f.fileno())
        f.close()
        self._files.append(TokenFile(name=name, num_tokens=n, max_token=mx, sha256=h.hexdigest()))
        self._current = None

    @property
    def _staging(self) -> Path:
        """The temporary folder the files are written in (`__enter__` makes it)."""
        if self._tmp is None:
            raise RuntimeError("a TokenWriter writes inside `with TokenWriter(...) as w:`")
        return self._tmp

    @property
    def num_tokens(self) -> int:
        return sum(f.num_tokens for f in self._files) + (self._current[2] if self._current else 0)

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            if self._current is not None:
                self._current[0].close()
            shutil.rmtree(self._staging, ignore_errors=True)
            return
        try:
            self._commit()
        except BaseException:
            shutil.rmtree(self._staging, ignore_errors=True)
            raise

    def _commit(self) -> None:
        self._finish_file()
        if not self._files:
            raise DataError(str(self.out), "no tokens to write")
        index = Index(dtype=self.dtype, vocab_size=self.vocab_size, eos_id=self.eos_id, files=tuple(self._files),
                      tokenizer=self._tokenizer)
        (self._staging / INDEX).write_text(json.dumps(index.to_dict(), indent=2) + "\n")
        self.index = index
        if isinstance(self.out, str):  # a URL (a local folder is a Path)
            storage.remove_tree(self.out)  # --force: what was there goes before the new files arrive
            storage.upload_folder(self._staging, self.out, last=(INDEX,))  # the index last: then the folder is whole
            shutil.rmtree(self._staging, ignore_errors=True)
            log.info("wrote %s: %d tokens in %d file(s)", self.out, index.num_tokens, len(index.files))
            return
        if self.out.exists():  # --force: the old folder goes only once the new one is complete
            old = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.old-", dir=self.out.parent))
            self.out.rename(old / "replaced")
            self._staging.rename(self.out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            self._staging.rename(self.out)
        log.info("wrote %s: %d tokens in %d file(s)", self.out, index.num_tokens, len(index.files))
