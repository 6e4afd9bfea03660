"""`orchestrator data prepare`: a folder of text files into token files (`workers.tokens`).

The tokenizer is a byte-level BPE trained here, on the same files, with the `tokenizers`
library (or a `tokenizer.json` the user gives); nothing is downloaded. Byte-level means
every input, in any language or none, encodes without an unknown token. Each text file is
one document; the EOS token goes between documents, so a training row that spans two
files sees where one ends. Files are read as UTF-8 in chunks of whole lines (about 1 MiB),
so a large file never has to fit in memory; the chunks of a file are encoded together.

The output folder is written atomically (`workers.token_writer.TokenWriter`): a failure part
way leaves nothing at the output, and an existing non-empty folder is replaced only with
`force`.

Example::

    summary = prepare("corpus/", "tokens/", vocab_size=8192, pattern="*.txt")
    print(summary.line())
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from workers.token_writer import TokenWriter, refuse_existing
from workers.tokens import DataError

log = logging.getLogger(__name__)

EOS = "<|endoftext|>"
CHUNK_BYTES = 1 << 20
MIN_VOCAB = 257  # the 256 bytes and EOS
MAX_VOCAB = 1 << 20


@dataclass(frozen=True)
class Summary:
    out: Path
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


def prepare(src: str | Path, out: str | Path, *, vocab_size: int | None = None, tokenizer: str | Path | None = None,
            pattern: str = "*.txt", force: bool = False) -> Summary:
    """Tokenize every file matching `pattern` under `src` into token files at `out`; see the module's docstring."""
    if tokenizer is not None and vocab_size is not None:
        raise DataError(str(tokenizer), "a given tokenizer has its own vocabulary: leave out --vocab-size")
    vocab_size = 8192 if vocab_size is None and tokenizer is None else vocab_size
    if vocab_size is not None and not MIN_VOCAB <= vocab_size <= MAX_VOCAB:
        raise DataError("--vocab-size", f"must be between {MIN_VOCAB} (the 256 bytes and EOS) and {MAX_VOCAB:,}, "
                                        f"got {vocab_size}")
    files = find_files(src, pattern)
    out = Path(out)
    refuse_existing(out, force=force)  # before the work, not after it
    tok = load_tokenizer(tokenizer) if tokenizer is not None else train_tokenizer(files, vocab_size)
    eos_id = tok.token_to_id(EOS)
    if eos_id is None:
        raise DataError(str(tokenizer), f"has no {EOS} token to put between documents")
    documents = 0
    with TokenWriter(out, vocab_size=tok.get_vocab_size(), eos_id=eos_id, force=force) as writer:
        for path in files:
            ids = [i for enc in tok.encode_batch(list(read_chunks(path))) for i in enc.ids]
            if ids:
                writer.add(ids)
                documents += 1
        if not documents:
            raise DataError(str(src), f"the {len(files)} file(s) matching {pattern!r} hold no text")
        writer.set_tokenizer(tok.to_str())
    index = writer.index
    return Summary(out=out, files=len(files), documents=documents, tokens=index.num_tokens,
                   vocab_size=index.vocab_size, eos_id=eos_id, dtype=index.dtype, trained=tokenizer is None)


def read_chunks(path: Path) -> Iterator[str]:
    """The file's text in chunks of whole lines of about `CHUNK_BYTES`; a DataError names a file that is not UTF-8."""
    lines = 0
    try:
        with open(path, "rb") as f:  # decoded line by line, so an error can say which line
            chunk: list[str] = []
            size = 0
            for raw in f:
                lines += 1
                line = raw.decode("utf-8")
                chunk.append(line)
                size += len(line)
                if size >= CHUNK_BYTES:
                    yield "".join(chunk)
                    chunk, size = [], 0
            if chunk:
                yield "".join(chunk)
    except UnicodeDecodeError as e:
        raise DataError(str(path), f"is not UTF-8 text (line {lines}: {e.reason}); convert it or leave it "
                                   "out with --pattern") from None
    except OSError as e:
        raise DataError(str(path), f"cannot be read: {e.strerror or e}") from None


def train_tokenizer(files: list[Path], vocab_size: int):
    """A byte-level BPE with `vocab_size` tokens (fewer if the text has fewer merges to offer), EOS first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((chunk for path in files for chunk in read_chunks(path)), trainer)
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
    except Exception as e:  # the library raises a bare Exception for a file it cannot parse
        raise DataError(str(path), f"not a tokenizers tokenizer.json: {e}") from None
