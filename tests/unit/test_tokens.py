"""Token files: written atomically, read back exactly (locally and through fsspec URLs),
checked with errors naming the file."""

from __future__ import annotations

import json
import pickle
import uuid

import fsspec
import numpy as np
import pytest

from workers import data, tokens
from workers.data import open_dataset
from workers.token_writer import TokenWriter
from workers.tokens import DataError, check

VOCAB = 300


def docs(n: int = 7, seed: int = 1) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, VOCAB, size=rng.integers(50, 400)) for _ in range(n)]


def write(out, documents, **kw) -> tokens.Index:
    with TokenWriter(out, vocab_size=kw.pop("vocab_size", VOCAB), eos_id=0, **kw) as w:
        for d in documents:
            w.add(d)
    return w.index


def stream(documents) -> np.ndarray:
    """The dataset as one array, built independently of the reader: documents joined by EOS (0)."""
    parts = []
    for i, d in enumerate(documents):
        parts += ([[0]] if i else []) + [d]
    return np.concatenate(parts)


def expected_rows(documents, seed, step, batch, seq_len, rows=slice(None)) -> np.ndarray:
    s = stream(documents)
    rng = np.random.default_rng([seed, step])  # the documented rule: uniform offsets from (seed, step)
    offsets = rng.integers(0, len(s) - seq_len - 1, size=batch)[rows]
    return np.stack([s[o:o + seq_len + 1] for o in offsets]).astype(np.int32)


def test_rows_are_the_documented_windows_of_the_stream(tmp_path):
    documents = docs()
    index = write(tmp_path / "ds", documents)
    ds = open_dataset(str(tmp_path / "ds"))
    assert ds.num_tokens == len(stream(documents)) == index.num_tokens
    assert ds.vocab_size == VOCAB and len(ds.fingerprint) == 12
    got = ds.rows(seed=3, step=5, global_batch_size=8, seq_len=32, rows=slice(None))
    assert got.dtype == np.int32 and got.shape == (8, 33)
    np.testing.assert_array_equal(got, expected_rows(documents, 3, 5, 8, 32))
    assert not np.array_equal(got, ds.rows(3, 6, 8, 32, slice(None)))  # another step, other rows


def test_each_host_reads_its_rows_of_the_same_batch(tmp_path):
    write(tmp_path / "ds", docs())
    ds = open_dataset(str(tmp_path / "ds"))
    whole = ds.rows(0, 11, 8, 16, slice(0, 8))
    halves = np.concatenate([ds.rows(0, 11, 8, 16, slice(0, 4)), ds.rows(0, 11, 8, 16, slice(4, 8))])
    quarters = np.concatenate([ds.rows(0, 11, 8, 16, slice(i, i + 2)) for i in range(0, 8, 2)])
    np.testing.assert_array_equal(whole, halves)
    np.testing.assert_array_equal(whole, quarters)
    np.testing.assert_array_equal(whole, open_dataset(str(tmp_path / "ds")).rows(0, 11, 8, 16, slice(0, 8)))


def test_windows_across_file_boundaries_read_like_one_file(tmp_path):
    documents = docs(12)
    one = write(tmp_path / "one", documents)
    many = write(tmp_path / "many", documents, shard_tokens=97)
    assert len(one.files) == 1 and len(many.files) > 10
    a, b = open_dataset(str(tmp_path / "one")), open_dataset(str(tmp_path / "many"))
    for step in range(5):
        np.testing.assert_array_equal(a.rows(1, step, 16, 64, slice(None)), b.rows(1, step, 16, 64, slice(None)))
    assert a.fingerprint != b.fingerprint  # other files: a resume on them is told apart


@pytest.mark.parametrize("scheme", ["memory", "file"])
def test_urls_are_read_by_byte_ranges_through_fsspec(tmp_path, scheme):
    documents = docs(9)
    write(tmp_path / "ds", documents, shard_tokens=200)
    if scheme == "memory":
        url = f"memory://tokens-{uuid.uuid4().hex}"
        fs = fsspec.filesystem("memory")
        for f in (tmp_path / "ds").iterdir():
            fs.pipe_file(f"{url}/{f.name}", f.read_bytes())
    else:
        url = (tmp_path / "ds").as_uri()
    try:
        ds = open_dataset(url)
        if scheme == "memory":
            assert not ds._folder.local
        np.testing.assert_array_equal(ds.rows(2, 7, 8, 48, slice(2, 6)),
                                      expected_rows(documents, 2, 7, 8, 48, slice(2, 6)))
    finally:
        if scheme == "memory":
            fsspec.filesystem("memory").rm(url, recursive=True)


def test_byte_corpus_is_a_dataset_with_the_rows_it_always_had():
    ds = open_dataset(None)
    assert isinstance(ds, data.ByteCorpus) and ds.vocab_size == 256
    assert ds.fingerprint == data.corpus_fingerprint()
    corpus = data.corpus()
    rng = np.random.default_rng([4, 9])  # the rule batch_rows had before token files existed
    offsets = rng.integers(0, len(corpus) - 64 - 1, size=6)
    want = np.stack([corpus[o:o + 65] for o in offsets]).astype(np.int32)
    np.testing.assert_array_equal(ds.rows(4, 9, 6, 64, slice(None)), want)
    np.testing.assert_array_equal(data.batch_rows(4, 9, 6, 64, slice(1, 3)), want[1:3])


def test_the_corpus_files_come_in_sorted_path_order_without_a_walk_of_the_whole_tree(tmp_path):
    """The corpus is the first files of the tree by sorted path (what `sorted(rglob)` gave); they are found
    folder by folder, skipping `test` and `site-packages` folders, and a folder's files come before a
    sibling's whose name sorts after the folder's."""
    for rel in ["a.py", "a/z.py", "a/b/c.py", "a-b.py", "ab.py", "b/test/skip.py", "b/x.py",
                "site-packages/pkg.py", "c/notes.txt", "c/site-packages/deep.py", "c/y.py", "test/t.py"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(rel)
    want = [p for p in sorted(tmp_path.rglob("*.py"))
            if "test" not in p.relative_to(tmp_path).parts and "site-packages" not in p.relative_to(tmp_path).parts]
    got = list(data._sources(tmp_path))
    assert got == want
    assert [p.relative_to(tmp_path).as_posix() for p in got] == ["a/b/c.py", "a/z.py", "a-b.py", "a.py", "ab.py",
                                                                  "b/x.py", "c/y.py"]


# -- check: every problem names the file --------------------------------------------


@pytest.fixture
def folder(tmp_path):
    write(tmp_path / "ds", docs(3), shard_tokens=300)
    return tmp_path / "ds"


def test_a_good_folder_passes(folder):
    check(str(folder), vocab_size=VOCAB, seq_len=64, checksums=True)


def problem(folder, **kw) -> str:
    with pytest.raises(DataError) as e:
        check(str(folder), **{"vocab_size": VOCAB, "seq_len": 64, **kw})
    return str(e.value)


def test_missing_folder_index_and_file(folder, tmp_path):
    assert problem(tmp_path / "nowhere") == f"{tmp_path / 'nowhere'}: no such folder of token files"
    (folder / "tokens-00001.bin").unlink()
    assert problem(folder).startswith(f"{folder}/tokens-00001.bin: missing")
    (folder / "index.json").unlink()
    assert problem(folder).startswith(f"{folder}/index.json: missing")


def test_truncated_file(folder):
    f = folder / "tokens-00000.bin"
    f.write_bytes(f.read_bytes()[:-10])
    msg = problem(folder)
    assert msg.startswith(f"{f}: 590 bytes, but index.json says 300 tokens of uint16 (600 bytes)"), msg
    assert "truncated" in msg


def test_wrong_dtype(folder):
    f = folder / "tokens-00000.bin"
    f.write_bytes(np.frombuffer(f.read_bytes(), "<u2").astype("<u4").tobytes())  # written as uint32
    assert problem(folder).startswith(f"{f}: 1,200 bytes, but index.json says 300 tokens of uint16")
    index = json.loads((folder / "index.json").read_text())
    (folder / "index.json").write_text(json.dumps({**index, "dtype": "float32"}))
    assert problem(folder) == f"{folder}/index.json: dtype 'float32' is not one of uint16, uint32"


def test_tokens_beyond_the_models_vocabulary(folder):
    msg = problem(folder, vocab_size=256)
    assert msg.startswith(f"{folder}/tokens-0000") and "vocab_size is 256" in msg


def test_too_few_tokens_for_a_row(folder):
    n = json.loads((folder / "index.json").read_text())["num_tokens"]
    assert problem(folder, seq_len=n) == f"{folder}: holds {n:,} tokens; rows of seq_len {n} need at least {n + 2:,}"
    check(str(folder), vocab_size=None, seq_len=n - 2)


def test_not_an_index_and_a_changed_file(folder):
    f = folder / "tokens-00000.bin"
    raw = bytearray(f.read_bytes())
    raw[5] ^= 1
    f.write_bytes(bytes(raw))
    check(str(folder), vocab_size=None, seq_len=None)  # sizes agree: the cheap check passes
    assert problem(folder, checksums=True) == f"{f}: its SHA-256 differs from index.json's: the file changed"
    (folder / "index.json").write_text("{nope")
    assert problem(folder).startswith(f"{folder}/index.json: not valid JSON")
    (folder / "index.json").write_text(json.dumps({"files": []}))
    assert "not a token index" in problem(folder)


def test_data_error_survives_pickling():
    e = pickle.loads(pickle.dumps(DataError("/x/tokens-00000.bin", "truncated")))
    assert isinstance(e, ValueError) and e.where == "/x/tokens-00000.bin" and str(e) == "/x/tokens-00000.bin: truncated"


# -- the writer ---------------------------------------------------------------------


def test_writer_is_atomic_and_refuses_a_non_empty_folder(tmp_path):
    out = tmp_path / "ds"
    with pytest.raises(RuntimeError, match="midway"):
        with TokenWriter(out, vocab_size=VOCAB, eos_id=0) as w:
            w.add([1, 2, 3])
            raise RuntimeError("midway")
    assert list(tmp_path.iterdir()) == []  # nothing at out, no temporary folder left
    first = write(out, docs(2))
    with pytest.raises(DataError, match="exists and is not empty"):
        TokenWriter(out, vocab_size=VOCAB, eos_id=0)
    second = write(out, docs(3, seed=2), force=True)
    assert second.fingerprint != first.fingerprint
    assert open_dataset(str(out)).fingerprint == second.fingerprint
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]


def test_writer_refuses_tokens_outside_the_vocabulary(tmp_path):
    with pytest.raises(DataError, match=r"document 1 has token ids outside \[0, 300\)"):
        write(tmp_path / "ds", [[1, 2], [5, 300]])
    assert not (tmp_path / "ds").exists()


def test_large_vocabularies_use_uint32(tmp_path):
    documents = [np.array([70_000, 1, 2] * 40), np.array([79_999, 3])]
    index = write(tmp_path / "ds", documents, vocab_size=80_000)
    assert index.dtype == "uint32" and index.max_token == 79_999
    got = open_dataset(str(tmp_path / "ds")).rows(0, 0, 4, 8, slice(None))
    np.testing.assert_array_equal(got, expected_rows(documents, 0, 0, 4, 8))
    assert got.max() == 70_000
