"""Token files a user brings: the on-disk format, its check and its reader (the writer: `workers.token_writer`).

The format is a folder::

    index.json          {"format": "orchestrator-tokens", "version": 1, "dtype": "uint16",
                         "vocab_size": 8192, "eos_id": 0, "tokenizer": "tokenizer.json",
                         "num_tokens": 1234567,
                         "files": [{"name": "tokens-00000.bin", "num_tokens": 1234567,
                                    "max_token": 8191, "sha256": "..."}]}
    tokens-00000.bin    the tokens, a flat little-endian array of `dtype`, no header
    tokenizer.json      the tokenizer that made them (a `tokenizers` file), if any

The dataset is the concatenation of the files in index order, documents separated by
`eos_id`. `dtype` is uint16 when the vocabulary fits (below 65,536), else uint32.

Why this and not ArrayRecord read through grain: batch `step` is a pure function of
`(seed, step)` (random row offsets drawn from a generator seeded with both), so there is
no iterator state to checkpoint beyond the step itself, every host reads only its own
rows, and a run resumed or resized onto another slice sees exactly the batches an
uninterrupted one would. A flat array is what nanoGPT's and Levanter's token caches
are; it memory-maps locally (nothing is read that no row needs), and a remote file is
read by byte ranges through fsspec (`gs://` through gcsfs, `file://`, `memory://`;
`workers.storage.configure` points gs:// at an emulator), with no heavier dependency.
The index records each file's size in tokens and its largest token, so `check` tells a
truncated file, one of another dtype, or tokens beyond the model's vocabulary without
reading the tokens; the SHA-256 is there for `check(..., checksums=True)` and for the
fingerprint recorded in checkpoints.

Example::

    ds = open_tokens("/data/my-corpus")           # or "gs://bucket/my-corpus"
    rows = ds.rows(seed=0, step=17, global_batch_size=64, seq_len=1024, rows=slice(0, 16))
    # rows: int32 [16, 1025], inputs rows[:, :-1] and targets rows[:, 1:]
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from typing import Protocol

import numpy as np

log = logging.getLogger(__name__)

FORMAT = "orchestrator-tokens"
VERSION = 1
INDEX = "index.json"
DTYPES: dict[str, np.dtype] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
SHARD_TOKENS = 1 << 28  # tokens per file: 512 MiB of uint16, small enough to copy and checksum in one go


class DataError(ValueError):
    """Token files that cannot be used as they are; `where` names the folder or the file."""

    def __init__(self, where: str, problem: str):
        self.where, self.problem = str(where), problem
        super().__init__(f"{where}: {problem}")

    def __reduce__(self):  # raised in a worker, it reaches the controller as itself
        return type(self), (self.where, self.problem)


class Dataset(Protocol):
    """What a trainer reads: token rows of a batch, a pure function of (seed, step)."""

    # Read-only (properties or plain attributes both do).
    @property
    def vocab_size(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def fingerprint(self) -> str: ...  # short; recorded in checkpoints, so a resume on other data is noticed

    def rows(self, seed: int, step: int, global_batch_size: int, seq_len: int, rows: slice) -> np.ndarray:
        """Rows `rows` of batch `step`: int32 [n, seq_len + 1] (inputs and the targets shifted by one)."""
        ...


def min_tokens(seq_len: int) -> int:
    """The fewest tokens a dataset needs for rows of `seq_len` (offsets are drawn below num_tokens - seq_len - 1)."""
    return seq_len + 2


def row_offsets(seed: int, step: int, global_batch_size: int, seq_len: int, num_tokens: int) -> np.ndarray:
    """Start offsets of every row of batch `step` (the whole global batch; cheap), uniform over the tokens."""
    rng = np.random.default_rng([seed, step])
    return rng.integers(0, num_tokens - seq_len - 1, size=global_batch_size)


# -- the index ---------------------------------------------------------------------


@dataclass(frozen=True)
class TokenFile:
    name: str
    num_tokens: int
    max_token: int
    sha256: str


@dataclass(frozen=True)
class Index:
    dtype: str
    vocab_size: int
    eos_id: int
    files: tuple[TokenFile, ...]
    tokenizer: str | None = None

    @property
    def num_tokens(self) -> int:
        return sum(f.num_tokens for f in self.files)

    @property
    def max_token(self) -> int:
        return max((f.max_token for f in self.files), default=-1)

    @property
    def fingerprint(self) -> str:
        what = [self.dtype, self.vocab_size, [(f.name, f.num_tokens, f.sha256) for f in self.files]]
        return hashlib.sha256(json.dumps(what).encode()).hexdigest()[:12]

    def to_dict(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "dtype": self.dtype, "vocab_size": self.vocab_size,
                "eos_id": self.eos_id, "tokenizer": self.tokenizer, "num_tokens": self.num_tokens,
                "files": [vars(f) for f in self.files]}

    @classmethod
    def from_dict(cls, d: object, where: str) -> "Index":
        """The index, or a DataError naming `where` and what is wrong with it."""
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise DataError(where, f"not a token index (expected \"format\": \"{FORMAT}\"; "
                                   "make one with `orchestrator data prepare`)")
        if d.get("version") != VERSION:
            raise DataError(where, f"index version {d.get('version')!r}; this version reads {VERSION}")
        if d.get("dtype") not in DTYPES:
            raise DataError(where, f"dtype {d.get('dtype')!r} is not one of {', '.join(DTYPES)}")
        try:
            files = tuple(TokenFile(name=str(f["name"]), num_tokens=int(f["num_tokens"]),
                                    max_token=int(f["max_token"]), sha256=str(f["sha256"])) for f in d["files"])
            index = cls(dtype=d["dtype"], vocab_size=int(d["vocab_size"]), eos_id=int(d["eos_id"]), files=files,
                        tokenizer=d.get("tokenizer"))
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(where, f"malformed index ({type(e).__name__}: {e})") from None
        for f in files:
            if not f.name or "/" in f.name or f.name.startswith(".") or f.num_tokens < 0:
                raise DataError(where, f"bad file entry {vars(f)}")
        return index


# -- where the files are -------------------------------------------------------------


class _Folder:
    """A folder of token files, local (memory-mapped) or a URL (byte ranges through fsspec)."""

    def __init__(self, path: str):
        import fsspec

        self.path = path.rstrip("/")
        self.fs, self.root = fsspec.core.url_to_fs(self.path)
        self.local = "file" in _protocols(self.fs)

    def file(self, name: str) -> str:
        """How a file of the folder is named in messages: the path or URL the user gave, joined."""
        return f"{self.path}/{name}"

    def _at(self, name: str) -> str:
        return f"{self.root.rstrip('/')}/{name}"

    def exists(self) -> bool:
        return self.fs.isdir(self.root)

    def read_text(self, name: str) -> str:
        return self.fs.cat_file(self._at(name)).decode()

    def size(self, name: str) -> int | None:
        """The file's size in bytes; None if it does not exist."""
        try:
            return int(self.fs.size(self._at(name)))
        except FileNotFoundError:
            return None

    def open(self, name: str):
        return self.fs.open(self._at(name), "rb")

    def memmap(self, name: str, dtype: np.dtype, count: int) -> np.ndarray:
        return np.memmap(self._at(name), dtype=dtype, mode="r", shape=(count,))

    def read_ranges(self, names: list[str], starts: list[int], ends: list[int]) -> list[bytes]:
        return self.fs.cat_ranges([self._at(n) for n in names], starts, ends)


def _protocols(fs) -> tuple[str, ...]:
    p = fs.protocol
    return (p,) if isinstance(p, str) else tuple(p)


def _read_index(folder: _Folder) -> Index:
    try:
        if not folder.exists():
            raise DataError(folder.path, "no such folder of token files")
        text = folder.read_text(INDEX)
    except FileNotFoundError:
        raise DataError(folder.file(INDEX), "missing: not a folder of token files "
                                            "(make one with `orchestrator data prepare`)") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(folder.file(INDEX), f"not valid JSON: {e}") from None
    return Index.from_dict(raw, folder.file(INDEX))


# -- the check -------------------------------------------------------------------------


def check(path: str, *, vocab_size: int | None, seq_len: int | None, checksums: bool = False) -> None:
    """Raise a `DataError` naming the folder or file if the token files at `path` cannot be trained on.

    Cheap (reads the index and each file's size): a missing folder, index or file; a file
    whose size disagrees with the index (truncated, or written with another dtype); tokens
    at or beyond `vocab_size` (the largest token is in the index); fewer tokens than a row
    of `seq_len` needs. With `checksums`, every file is also read and its SHA-256 compared.
    """
    folder = _Folder(path)
    index = _read_index(folder)
    if not index.files:
        raise DataError(folder.file(INDEX), "lists no token files")
    itemsize = DTYPES[index.dtype].itemsize
    for f in index.files:
        size = folder.size(f.name)
        if size is None:
            raise DataError(folder.file(f.name), "missing (listed in index.json)")
        if size != f.num_tokens * itemsize:
            raise DataError(folder.file(f.name),
                            f"{size:,} bytes, but index.json says {f.num_tokens:,} tokens of {index.dtype} "
                            f"({f.num_tokens * itemsize:,} bytes): the file is truncated or not {index.dtype}")
        if vocab_size is not None and f.max_token >= vocab_size:
            raise DataError(folder.file(f.name), f"holds token id {f.max_token}, but the model's vocab_size is "
                                                 f"{vocab_size} (the tokenizer's is {index.vocab_size})")
        if checksums and _sha256(folder, f.name) != f.sha256:
            raise DataError(folder.file(f.name), "its SHA-256 differs from index.json's: the file changed")
    if seq_len is not None and index.num_tokens < min_tokens(seq_len):
        raise DataError(folder.path, f"holds {index.num_tokens:,} tokens; rows of seq_len {seq_len} need at "
                                     f"least {min_tokens(seq_len):,}")


def _sha256(folder: _Folder, name: str) -> str:
    h = hashlib.sha256()
    with folder.open(name) as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


# -- the reader ------------------------------------------------------------------------


def open_tokens(path: str) -> TokenDataset:
    """The folder of token files at `path` (local or a URL), checked (`check`) before it is read."""
    check(path, vocab_size=None, seq_len=None)
    return TokenDataset(path)


class TokenDataset:
    """A folder of token files read as one stream (see the module's docstring)."""

    def __init__(self, path: str):
        self._folder = _Folder(path)
        self.index = _read_index(self._folder)
        self.vocab_size = self.index.vocab_size
        self.num_tokens = self.index.num_tokens
        self.fingerprint = self.index.fingerprint
        self._dtype = DTYPES[self.index.dtype]
        self._starts = np.cumsum([0] + [f.num_tokens for f in self.index.files])  # [files + 1]
        self._maps: dict[str, np.ndarray] = {}

    def __repr__(self) -> str:
        return f"TokenDataset({self._folder.path!r}, {self.num_tokens:,} tokens, vocab {self.vocab_size})"

    def rows(self, seed: int, step: int, global_batch_size: int, seq_len: int, rows: slice) -> np.ndarray:
        if self.num_tokens < min_tokens(seq_len):
            raise DataError(self._folder.path, f"holds {self.num_tokens:,} tokens; rows of seq_len {seq_len} "
                                               f"need at least {min_tokens(seq_len):,}")
        offsets = row_offsets(seed, step, global_batch_size, seq_len, self.num_tokens)[rows]
        pieces = [piece for start in offsets for piece in self._pieces(int(start), seq_len + 1)]
        tokens = self._read(pieces)
        return tokens.reshape(len(offsets), seq_len + 1).astype(np.int32)

    def _pieces(self, start: int, length: int) -> list[tuple[int, int, int]]:
        """(file number, first token in the file, token count) of the window [start, start + length)."""
        out = []
        i = int(np.searchsorted(self._starts, start, side="right")) - 1
        while length > 0:
            first = start - int(self._starts[i])
            n = min(length, self.index.files[i].num_tokens - first)
            if n > 0:
                out.append((i, first, n))
            start, length, i = start + n, length - n, i + 1
        return out

    def _read(self, pieces: list[tuple[int, int, int]]) -> np.ndarray:
        files = self.index.files
        if self._folder.local:
            return np.concatenate([self._map(i)[first:first + n] for i, first, n in pieces])
        size = self._dtype.itemsize
        blobs = self._folder.read_ranges([files[i].name for i, _, _ in pieces],
                                         [first * size for _, first, _ in pieces],
                                         [(first + n) * size for _, first, n in pieces])
        return np.frombuffer(b"".join(blobs), dtype=self._dtype)

    def _map(self, i: int) -> np.ndarray:
        f = self.index.files[i]
        if f.name not in self._maps:
            self._maps[f.name] = self._folder.memmap(f.name, self._dtype, f.num_tokens)
        return self._maps[f.name]
