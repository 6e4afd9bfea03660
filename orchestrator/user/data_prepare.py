"""`orchestrator data prepare`: a folder of text files into token files (`workers.tokens`).

The tokenizer is a byte-level BPE trained here, on the same files, with the `tokenizers`
library (or a `tokenizer.json` the user gives); nothing is downloaded. Byte-level means
every input, in any language or none, encodes without an unknown token. Each text file is
one document; the EOS token goes between documents, so a training row that spans two
files sees where one ends. Files are streamed as UTF-8 in chunks of whole lines (about 1 MiB),
so a large file never has to fit in memory, nor does a file of one very long line: a line
longer than a chunk is cut before a space, and a run of more than `MAX_WORD` characters
without one (which the BPE's work grows with the square of) is cut into pieces of that
length. Ordinary text is tokenized as it would be whole. `progress` hears how many bytes
of how many each pass (training the tokenizer, encoding) has read.

The output folder is written atomically (`workers.token_writer.TokenWriter`): a failure part
way leaves nothing at the output, and an existing non-empty folder is replaced only with
`force`. It may be a bucket's folder (``gs://bucket/tokens``): Google's Cloud Storage with
this machine's credentials, or the emulator that ``STORAGE_EMULATOR_HOST`` names. Where it
goes is checked before the files are read (`orchestrator.user.outputs`): a folder that cannot
be made there, or a bucket whose endpoint does not answer, is refused in seconds.

Example::

    summary = prepare("corpus/", "tokens/", vocab_size=8192, pattern="*.txt")
    print(summary.line())
"""

from __future__ import annotations

import codecs
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from orchestrator.errors import OutputFileError
from orchestrator.user.outputs import check_output_folder, check_reachable
from workers import storage
from workers.token_writer import TokenWriter, refuse_existing
from workers.tokens import DataError

log = logging.getLogger(__name__)

EOS = "<|endoftext|>"
CHUNK_BYTES = 1 << 18
MAX_WORD = 1024  # characters without whitespace; a longer run is cut (see the module's docstring)
ENCODE_BYTES = 1 << 20  # text encoded at once (about 200 MB of the library's working memory); written before the next
MIN_VOCAB = 257  # the 256 bytes and EOS
MAX_VOCAB = 1 << 20


@dataclass(frozen=True)
class Summary:
    out: Path | str  # a str for a bucket's folder
    files: int
    documents: int  # files with any text (an empty file adds nothing)
    tokens: int
    vocab_size: int
    eos_id: int
    dtype: str
    trained: bool  # the tokenizer was trained here (not given)

    def line(self) -> str:
        how = "trained here" if self.trained else "given"
        return (f"wrote {self.out}: {self.files} file(s), {self.documents} document(s), {self.tokens:,} tokens "
                f"({self.dtype}), vocab {self.vocab_size:,} (byte-level BPE, {how}), eos id {self.eos_id}")


def find_files(src: str | Path, pattern: str) -> list[Path]:
    """The text files under `src` whose names match `pattern`, in sorted order (a stable order: a stable dataset)."""
    src = Path(src)
    if not src.exists():
        raise DataError(str(src), "no such folder")
    if not src.is_dir():
        raise DataError(str(src), "is not a folder (give the folder that holds the text files)")
    files = sorted(p for p in src.rglob(pattern) if p.is_file())
    if not files:
        raise DataError(str(src), f"holds no files matching {pattern!r}")
    return files


Progress = Callable[[str, int, int], None]  # (what: "training"/"encoding", bytes read, bytes in all)


def prepare(src: str | Path, out: str | Path, *, vocab_size: int | None = None, tokenizer: str | Path | None = None,
            pattern: str = "*.txt", force: bool = False, progress: Progress | None = None) -> Summary:
    """Tokenize every file matching `pattern` under `src` into token files at `out`; see the module's docstring."""
    if tokenizer is not None and vocab_size is not None:
        raise DataError(str(tokenizer), "a given tokenizer has its own vocabulary: leave out --vocab-size")
    vocab_size = 8192 if vocab_size is None and tokenizer is None else vocab_size
    if vocab_size is not None and not MIN_VOCAB <= vocab_size <= MAX_VOCAB:
        raise DataError("--vocab-size", f"must be between {MIN_VOCAB} (the 256 bytes and EOS) and {MAX_VOCAB:,}, "
                                        f"got {vocab_size}")
    files = find_files(src, pattern)
    try:  # where it goes, before the work: a name, a folder or a bucket that cannot take it is refused now
        out = check_output_folder(os.fspath(out), force=force)
        if storage.is_url(out):  # a bucket's folder, gs://bucket/tokens; an emulator's if STORAGE_EMULATOR_HOST says
            endpoint = os.environ.get("STORAGE_EMULATOR_HOST") or None
            check_reachable(out, endpoint)
            storage.configure(endpoint)
        else:
            out = Path(out)
    except OutputFileError as e:
        raise DataError(e.path, e.problem) from None
    refuse_existing(out, force=force)
    total = sum(_size(p) for p in files)
    if tokenizer is not None:
        tok = load_tokenizer(tokenizer)
    else:
        assert vocab_size is not None, "without a tokenizer it has its default (above)"
        tok = train_tokenizer(files, vocab_size, progress=_Meter("training", total, progress))
    eos_id = tok.token_to_id(EOS)
    if eos_id is None:
        raise DataError(str(tokenizer), f"has no {EOS} token to put between documents")
    documents = 0
    meter = _Meter("encoding", total, progress)
    try:
        with TokenWriter(out, vocab_size=tok.get_vocab_size(), eos_id=eos_id, force=force) as writer:
            for path in files:
                started = False
                for batch in _batches(read_chunks(path, meter)):
                    ids = [i for enc in tok.encode_batch(batch) for i in enc.ids]
                    if ids:
                        writer.add(ids, continues=started)
                        documents += not started
                        started = True
            if not documents:
                raise DataError(str(src), f"the {len(files)} file(s) matching {pattern!r} hold no text")
            writer.set_tokenizer(tok.to_str())
    except OSError as e:  # the disk filled up, the bucket went away: the writer leaves nothing at `out`
        raise DataError(str(out), f"could not be written: {e.strerror or e}") from None
    index = writer.index
    return Summary(out=out, files=len(files), documents=documents, tokens=index.num_tokens,
                   vocab_size=index.vocab_size, eos_id=eos_id, dtype=index.dtype, trained=tokenizer is None)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError as e:
        raise DataError(str(path), f"cannot be read: {e.strerror or e}") from None


class _Meter:
    """Counts the bytes a pass has read, and tells `progress` (at most once per `CHUNK_BYTES`, and at the end)."""

    def __init__(self, what: str, total: int, progress: Progress | None):
        self.what, self.total, self.progress, self.done, self._told = what, total, progress, 0, -1

    def add(self, n: int) -> None:
        self.done += n
        if self.progress is not None and (self.done - self._told >= CHUNK_BYTES or self.done >= self.total):
            self._told = self.done
            self.progress(self.what, self.done, self.total)


def _batches(chunks: Iterator[str]) -> Iterator[list[str]]:
    """Chunks in lists of about `ENCODE_BYTES`, so a file's tokens are written a batch at a time."""
    batch, size = [], 0
    for chunk in chunks:
        batch.append(chunk)
        size += len(chunk)
        if size >= ENCODE_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


_LAST_SPACE = re.compile(r"\s(?=\S*\Z)")
_LONG_WORD = re.compile(r"\S{%d,}" % (MAX_WORD + 1))


def read_chunks(path: Path, meter: _Meter | None = None) -> Iterator[str]:
    """The file's text in chunks of about `CHUNK_BYTES`, streamed; a DataError names a file that is not UTF-8.

    A chunk ends at a line's end, or for a line longer than a chunk before a space in it;
    a run of more than `MAX_WORD` characters without whitespace comes in chunks of its own
    of at most `MAX_WORD` (see the module's docstring).
    """
    decoder = codecs.getincrementaldecoder("utf-8")()
    line, text = 1, ""
    try:
        with open(path, "rb") as f:
            while True:
                raw = f.read(CHUNK_BYTES)
                pending = len(decoder.getstate()[0])
                try:
                    text += decoder.decode(raw, final=not raw)
                except UnicodeDecodeError as e:  # which line: the newlines before the bad byte
                    line += raw[:max(0, e.start - pending)].count(b"\n")
                    raise DataError(str(path), f"is not UTF-8 text (line {line}: {e.reason}); convert it or leave "
                                               "it out with --pattern") from None
                line += raw.count(b"\n")
                if meter is not None:
                    meter.add(len(raw))
                while len(text) >= CHUNK_BYTES or (not raw and text):
                    chunk, text = _cut(text, final=not raw)
                    yield from _split_long_words(chunk)
                if not raw:
                    return
    except OSError as e:
        raise DataError(str(path), f"cannot be read: {e.strerror or e}") from None


def _cut(text: str, *, final: bool) -> tuple[str, str]:
    """The first chunk of `text` and the rest: up to a line's end, else before a space, else `CHUNK_BYTES` long."""
    if final and len(text) <= CHUNK_BYTES:
        return text, ""
    head = text[:CHUNK_BYTES]
    end = head.rfind("\n") + 1
    if not end and (space := _LAST_SPACE.search(head)) is not None and space.start() > 0:
        end = space.start()  # the space starts the next chunk, as the byte-level pre-tokenizer would group it
    end = end or CHUNK_BYTES
    return text[:end], text[end:]


def _split_long_words(chunk: str) -> Iterator[str]:
    """`chunk`, with every run of more than `MAX_WORD` non-space characters in pieces of its own."""
    start = 0
    for m in _LONG_WORD.finditer(chunk):
        if m.start() > start:
            yield chunk[start:m.start()]
        for i in range(m.start(), m.end(), MAX_WORD):
            yield chunk[i:min(i + MAX_WORD, m.end())]
        start = m.end()
    if start < len(chunk):
        yield chunk[start:]


def train_tokenizer(files: list[Path], vocab_size: int, *, progress: _Meter | None = None):
    """A byte-level BPE with `vocab_size` tokens (fewer if the text has fewer merges to offer), EOS first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((chunk for path in files for chunk in read_chunks(path, progress)), trainer)
    log.info("trained a byte-level BPE of %d tokens on %d file(s)", tok.get_vocab_size(), len(files))
    return tok


def load_tokenizer(path: str | Path):
    """A `tokenizers` tokenizer.json from a local file (never fetched from a hub)."""
    from tokenizers import Tokenizer

    path = Path(path)
    if not path.is_file():
        raise DataError(str(path), "no such tokenizer file")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 -- tokenizers raises a bare Exception for a file it cannot parse
        raise DataError(str(path), f"not a tokenizers tokenizer.json: {e}") from None
