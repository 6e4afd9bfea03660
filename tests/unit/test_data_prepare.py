"""`orchestrator data prepare` on a small folder, and the token-file check `submit` makes before any slice exists."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml
from tokenizers import Tokenizer
from typer.testing import CliRunner

from orchestrator import cluster
from orchestrator.state.store import Store
from orchestrator.user.cli import app
from workers.data import open_dataset
from workers.tokens import check

TEXTS = {
    "a.txt": "The quick brown fox jumps over the lazy dog.\nPack my box with five dozen liquor jugs.\n" * 20,
    "b/c.txt": "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # naïve café, 東京\n" * 15,
    "b/d.txt": "Sphinx of black quartz, judge my vow!\n" * 30,
    "empty.txt": "",
    "notes.md": "not matched by the default pattern\n",
}


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("ORCHESTRATOR_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def src(tmp_path):
    root = tmp_path / "src"
    for name, text in TEXTS.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    return root


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def errors(r) -> list[str]:
    return [line for line in r.stderr.splitlines() if line.startswith("error:")]


def test_prepare_writes_token_files_that_decode_to_the_documents(src, tmp_path, home):
    out = tmp_path / "tokens"
    r = run("data", "prepare", src, "-o", out, "--vocab-size", 300)
    assert r.exit_code == 0, r.output
    index = json.loads((out / "index.json").read_text())
    assert r.stdout.strip() == (f"wrote {out}: 4 file(s), 3 document(s), {index['num_tokens']:,} tokens (uint16), "
                                f"vocab 300 (byte-level BPE, trained here), eos id 0")
    assert index["vocab_size"] == 300 and index["dtype"] == "uint16" and index["tokenizer"] == "tokenizer.json"
    check(str(out), vocab_size=300, seq_len=64, checksums=True)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    stream = np.fromfile(out / "tokens-00000.bin", dtype="<u2")
    assert len(stream) == index["num_tokens"] < sum(map(len, TEXTS.values()))  # merges made tokens of several bytes
    docs = np.split(stream, np.flatnonzero(stream == index["eos_id"]))
    decoded = [tok.decode([int(i) for i in d if i != index["eos_id"]]) for d in docs]
    assert decoded == [TEXTS["a.txt"], TEXTS["b/c.txt"], TEXTS["b/d.txt"]]  # sorted paths; the empty file adds none
    rows = open_dataset(str(out)).rows(0, 0, 4, 32, slice(None))
    assert rows.shape == (4, 33) and rows.max() < 300


def test_a_given_tokenizer_gives_the_same_tokens(src, tmp_path, home):
    assert run("data", "prepare", src, "-o", tmp_path / "one", "--vocab-size", 280).exit_code == 0
    r = run("data", "prepare", src, "-o", tmp_path / "two", "--tokenizer", tmp_path / "one" / "tokenizer.json")
    assert r.exit_code == 0, r.output
    assert "(byte-level BPE, given)" in r.stdout
    assert open_dataset(str(tmp_path / "one")).fingerprint == open_dataset(str(tmp_path / "two")).fingerprint


def test_a_non_empty_output_is_refused_untouched_unless_forced(src, tmp_path, home):
    out = tmp_path / "tokens"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    r = run("data", "prepare", src, "-o", out, "--vocab-size", 300)
    assert r.exit_code == 2 and errors(r) == [f"error: {out}: exists and is not empty (--force replaces it)"]
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert run("data", "prepare", src, "-o", out, "--vocab-size", 300, "--force").exit_code == 0
    assert sorted(p.name for p in out.iterdir()) == ["index.json", "tokenizer.json", "tokens-00000.bin"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src", "tokens"]  # no temporary folder left


@pytest.mark.parametrize("case, says", [
    ("missing", "{src}/nowhere: no such folder"),
    ("no match", "{src}: holds no files matching '*.rst'"),
    ("only empty", "{src}/b: the 2 file(s) matching 'd*' hold no text"),
    ("not utf-8", "{src}/bad.txt: is not UTF-8 text (line 3: invalid start byte); convert it or leave it out "
                  "with --pattern"),
    ("tiny vocab", "--vocab-size: must be between 257 (the 256 bytes and EOS) and 1,048,576, got 100"),
    ("no tokenizer", "{src}/tok.json: no such tokenizer file"),
    ("both", "{src}/tok.json: a given tokenizer has its own vocabulary: leave out --vocab-size"),
])
def test_bad_input_is_one_error_line_exit_2_and_writes_nothing(src, tmp_path, home, case, says):
    out = tmp_path / "tokens"
    args = {"missing": [src / "nowhere"], "no match": [src, "--pattern", "*.rst"],
            "only empty": [src / "b", "--pattern", "d*"], "not utf-8": [src],
            "tiny vocab": [src, "--vocab-size", 100], "no tokenizer": [src, "--tokenizer", src / "tok.json"],
            "both": [src, "--tokenizer", src / "tok.json", "--vocab-size", 300]}[case]
    if case == "only empty":
        (src / "b" / "d.txt").write_text("")
        (src / "b" / "d2.txt").write_text("")
    if case == "not utf-8":
        (src / "bad.txt").write_bytes(b"one\ntwo\nabc\xff\xfe\n")
    r = run("data", "prepare", *args, "-o", out)
    assert r.exit_code == 2, r.output
    assert errors(r) == [f"error: {says.format(src=src)}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]



# -- long lines: streamed, in bounded memory, with progress ----------------------------


def tokens_of(out) -> np.ndarray:
    index = json.loads((out / "index.json").read_text())
    return np.concatenate([np.fromfile(out / f["name"], dtype=index["dtype"]) for f in index["files"]])


def test_a_long_line_is_cut_before_spaces_and_tokenizes_as_whole(tmp_path, home, monkeypatch):
    """Chunks of a line longer than a chunk end before a space: the same tokens as the line encoded whole."""
    import orchestrator.user.data_prepare as dp

    words = ["lorem", "ipsum", "dolor", "sit", "amet,", "café", "東京", "x=1;", "  ", "\t"]
    line = " ".join(words[(i * 7) % len(words)] for i in range(3000))  # ~15,000 characters, no newline
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text(line + "\n" + line[:500], encoding="utf-8")
    monkeypatch.setattr(dp, "CHUNK_BYTES", 1000)
    monkeypatch.setattr(dp, "ENCODE_BYTES", 3000)
    chunks = list(dp.read_chunks(tmp_path / "src" / "a.txt"))
    assert "".join(chunks) == line + "\n" + line[:500] and len(chunks) >= 15
    assert all(len(c) <= 1000 for c in chunks) and all(c[0].isspace() for c in chunks[1:14])
    dp.prepare(tmp_path / "src", tmp_path / "one", vocab_size=400)
    tok = Tokenizer.from_file(str(tmp_path / "one" / "tokenizer.json"))
    assert tokens_of(tmp_path / "one").tolist() == tok.encode(line + "\n" + line[:500]).ids


def test_a_run_without_spaces_is_cut_into_words_of_max_word(tmp_path, monkeypatch):
    import orchestrator.user.data_prepare as dp

    (tmp_path / "a.txt").write_text("ab " + "x" * 2500 + " cd\n", encoding="utf-8")
    assert list(dp.read_chunks(tmp_path / "a.txt")) == ["ab ", "x" * 1024, "x" * 1024, "x" * 452, " cd\n"]


def test_the_command_shows_progress_on_a_terminal(src, tmp_path, home, monkeypatch):
    import io

    from rich.console import Console

    from orchestrator.user.commands import console

    screen = io.StringIO()
    monkeypatch.setattr(console, "err", Console(file=screen, force_terminal=True, width=100))
    r = run("data", "prepare", src, "-o", tmp_path / "tokens", "--vocab-size", 300)
    assert r.exit_code == 0, r.output
    assert "training" in screen.getvalue() and "encoding" in screen.getvalue()
    assert r.stdout.startswith(f"wrote {tmp_path / 'tokens'}: ")  # the summary alone on stdout


# -- the check at submit --------------------------------------------------------------


@pytest.fixture
def tokens(src, tmp_path):
    assert run("data", "prepare", src, "-o", tmp_path / "tokens", "--vocab-size", 300).exit_code == 0
    return tmp_path / "tokens"


def job_file(tmp_path, data_path: str, vocab_size: int = 512) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({"name": "tok", "workload": {"type": "lm", "steps": 20, "seq_len": 32,
                                                                 "model": {"vocab_size": vocab_size},
                                                                 "data": {"path": data_path}}}))
    return path


@pytest.mark.parametrize("case", ["truncated", "wrong dtype", "missing file", "missing folder", "vocabulary"])
def test_submit_refuses_bad_token_files_before_any_cluster_or_job(tokens, tmp_path, home, case):
    f = tokens / "tokens-00000.bin"
    data_path, vocab = "tokens", 512
    if case == "truncated":
        f.write_bytes(f.read_bytes()[:-7])
    elif case == "wrong dtype":
        f.write_bytes(np.fromfile(f, dtype="<u2").astype("<u4").tobytes())
    elif case == "missing file":
        f.unlink()
    elif case == "missing folder":
        data_path = "elsewhere"
    else:
        vocab = 256
    r = run("submit", job_file(tmp_path, data_path, vocab))
    assert r.exit_code == 2, r.output
    [line] = errors(r)
    where = tmp_path / "elsewhere" if case == "missing folder" else f
    assert line.startswith(f"error: {tmp_path / 'job.yaml'}: workload.data.path: {where}"), line
    assert {"truncated": "truncated", "wrong dtype": "not uint16", "missing file": "missing",
            "missing folder": "no such folder", "vocabulary": "vocab_size is 256"}[case] in line
    assert Store(cluster.Home(home).ensure().db).jobs() == []
    assert cluster.read_cluster(cluster.Home(home)) is None  # nothing was started


def test_a_good_folder_and_a_missing_url_at_submit(tokens, tmp_path):
    from orchestrator.domain.spec import JobSpec
    from orchestrator.errors import SpecError
    from orchestrator.user.client import check_data

    good = JobSpec.from_yaml(job_file(tmp_path, "tokens"))
    assert good.workload.data.path == str(tokens)  # relative to the job file's folder
    check_data(good)
    entry = JobSpec.from_dict({"name": "e", "workload": {"type": "entrypoint", "entrypoint": "m:f", "seq_len": 32,
                                                         "data": {"path": "memory://nothing-here/tokens"}}})
    with pytest.raises(SpecError) as e:
        check_data(entry, "job.yaml")
    assert str(e.value) == "job.yaml: workload.data.path: memory://nothing-here/tokens: no such folder of token files"
