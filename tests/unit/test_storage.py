"""A path or a URL (`workers.storage`) and the fence, on disk and in a bucket of the local GCS emulator.

Every bucket test goes over HTTP to the emulator process (`orchestrator.emulator.storage`)
through the real clients: gcsfs for files and listings, google-cloud-storage for the fence.
"""

from __future__ import annotations

import random
import threading

import pytest
import requests

from workers import fence as fences
from workers import storage


@pytest.fixture(params=["local", "gs"])
def where(request, tmp_path):
    """A fresh folder on disk, or in the emulator's bucket (this process pointed at it)."""
    if request.param == "local":
        yield str(tmp_path / "folder")
    else:
        yield request.getfixturevalue("gcs").folder


# -- the emulator -------------------------------------------------------------------------------


def upload(url: str, bucket: str, name: str, data: bytes, **params) -> requests.Response:
    return requests.post(f"{url}/upload/storage/v1/b/{bucket}/o",
                         params={"uploadType": "media", "name": name, **params}, data=data, timeout=10)


def test_generation_preconditions_over_http(gcs_emulator):
    """What GCS does with ifGenerationMatch and friends, which the emulator package alone ignores."""
    url, b, name = gcs_emulator.url, "test-bucket", f"pre-{random.getrandbits(32)}"
    first = upload(url, b, name, b"1", ifGenerationMatch=0)
    assert first.status_code == 200
    gen = int(first.json()["generation"])
    assert upload(url, b, name, b"2", ifGenerationMatch=0).status_code == 412  # create-only: it exists
    assert upload(url, b, name, b"2", ifGenerationMatch=gen + 1).status_code == 412
    second = upload(url, b, name, b"2", ifGenerationMatch=gen)
    assert second.status_code == 200 and int(second.json()["generation"]) > gen
    media = f"{url}/download/storage/v1/b/{b}/o/{name}"
    got = requests.get(media, params={"alt": "media"}, timeout=10)
    assert got.content == b"2" and got.headers["x-goog-generation"] == second.json()["generation"]
    assert requests.get(media, params={"alt": "media", "ifGenerationNotMatch": second.json()["generation"]},
                        timeout=10).status_code == 304
    assert requests.get(media, params={"alt": "media", "ifGenerationMatch": gen}, timeout=10).status_code == 412
    empty = upload(url, b, f"{name}-empty", b"")  # a zero-byte object (gcsfs writes them for folders)
    assert empty.status_code == 200 and empty.json()["size"] == "0"
    obj = f"{url}/storage/v1/b/{b}/o/{name}"
    assert requests.delete(obj, params={"ifGenerationMatch": gen}, timeout=10).status_code == 412
    assert requests.delete(obj, params={"ifGenerationMatch": second.json()["generation"]},
                           timeout=10).status_code in (200, 204)
    assert requests.get(obj, timeout=10).status_code == 404


def test_the_real_clients_against_the_emulator(gcs):
    """gcsfs and google-cloud-storage: multipart, resumable, ranged reads, listing by prefix and delimiter."""
    from google.cloud import storage as gcs_client

    fs, root = storage.filesystem(gcs.folder)
    big = random.randbytes(3 * 2**20 + 17)
    with fs.open(f"{root}/resumable.bin", "wb", block_size=2**20) as f:  # several chunks: a resumable upload
        f.write(big)
    with fs.open(f"{root}/resumable.bin", "rb", block_size=2**16) as f:
        f.seek(2**20 + 5)
        assert f.read(1000) == big[2**20 + 5:2**20 + 1005]  # a ranged read
    fs.pipe_file(f"{root}/sub/a.txt", b"a")
    fs.pipe_file(f"{root}/sub/deeper/b.txt", b"b")
    assert storage.listdir(gcs.folder) == ["resumable.bin", "sub"]
    assert storage.listdir(storage.join(gcs.folder, "sub")) == ["a.txt", "deeper"]
    bucket, prefix = storage.split_gcs(gcs.folder)
    client = gcs_client.Client.create_anonymous_client()
    blob = client.bucket(bucket).blob(f"{prefix}/chunked.bin", chunk_size=256 * 1024)
    blob.upload_from_string(big[:2**20])  # google-resumable-media in 256 KiB chunks
    assert storage.read_bytes(storage.join(gcs.folder, "chunked.bin")) == big[:2**20]
    blobs = client.list_blobs(bucket, prefix=f"{prefix}/sub/", delimiter="/")
    assert [b.name.rsplit("/", 1)[1] for b in blobs] == ["a.txt"] and blobs.prefixes == {f"{prefix}/sub/deeper/"}


# -- paths and URLs -------------------------------------------------------------------------------


def test_join_and_is_url():
    assert storage.join("gs://b/x/", "y", "/z/") == "gs://b/x/y/z"
    assert storage.join("/tmp/x", "y") == "/tmp/x/y"
    assert storage.is_url("gs://b/x") and not storage.is_url("/tmp/gs:/x")
    assert storage.split_gcs("gs://b/x/y/") == ("b", "x/y")
    with pytest.raises(storage.StorageError, match="not a gs:// URL"):
        storage.split_gcs("/tmp/x")


def test_files_and_folders(where):
    f = storage.join(where, "a", "b.txt")
    assert not storage.exists(where)
    storage.makedirs(storage.join(where, "a"))
    storage.write_text(f, "hello")
    storage.write_bytes(storage.join(where, "c.bin"), b"\0\1")
    assert storage.read_text(f) == "hello" and storage.read_bytes(storage.join(where, "c.bin")) == b"\0\1"
    assert storage.exists(f) and storage.isdir(storage.join(where, "a")) and not storage.isdir(f)
    assert storage.listdir(where) == ["a", "c.bin"]
    with pytest.raises(FileNotFoundError):
        storage.listdir(storage.join(where, "nothing"))
    with pytest.raises(FileNotFoundError):
        storage.read_bytes(storage.join(where, "nothing"))
    storage.move_tree(storage.join(where, "a"), storage.join(where, "a.aside"))
    assert storage.listdir(where) == ["a.aside", "c.bin"] and storage.read_text(storage.join(where, "a.aside", "b.txt"))
    storage.remove(storage.join(where, "c.bin"))
    storage.remove(storage.join(where, "c.bin"))  # nothing there: nothing to do
    storage.remove_tree(where)
    storage.remove_tree(where)
    assert not storage.exists(where)


def test_upload_folder_keeps_names_and_writes_the_marker_last(where, tmp_path):
    src = tmp_path / "src"
    (src / "nested").mkdir(parents=True)
    (src / "nested" / "w.bin").write_bytes(b"w")
    (src / "config.json").write_text("{}")
    (src / "z.txt").write_text("z")
    storage.upload_folder(src, where, last=("config.json",))
    assert storage.listdir(where) == ["config.json", "nested", "z.txt"]
    assert storage.read_bytes(storage.join(where, "nested", "w.bin")) == b"w"


def test_check_writable(where, gcs_emulator):
    storage.check_writable(where)
    assert not storage.exists(where) or storage.listdir(where) == []  # the probe is gone again
    with pytest.raises(storage.StorageError) as e:
        storage.check_writable("gs://no-such-bucket/x", endpoint=gcs_emulator.url)
    assert e.value.where == "gs://no-such-bucket/x" and "404" in e.value.problem


def test_an_endpoint_per_call_needs_no_process_setting(gcs_emulator, gcs):
    folder = gcs.folder
    storage.configure(None)  # this process now points at Google's; the calls name the emulator
    fences.write_fence(folder, 1, "job-x", endpoint=gcs_emulator.url)
    assert fences.read_fence(folder, endpoint=gcs_emulator.url).owner == "job-x"
    assert storage.listdir(folder, endpoint=gcs_emulator.url) == [fences.FENCE]


def test_configure_sets_and_clears_the_endpoint_settings():
    import os

    storage.configure("http://127.0.0.1:1/")
    try:
        assert {k: os.environ[k] for k in storage.endpoint_env("http://127.0.0.1:1")} == {
            "STORAGE_EMULATOR_HOST": "http://127.0.0.1:1", "TENSORSTORE_GCS_HTTP_URL": "http://127.0.0.1:1",
            "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
    finally:
        storage.configure(None)
    assert not any(k in os.environ for k in storage.endpoint_env("http://x"))


# -- the fence ----------------------------------------------------------------------------------------


def test_fence_round_trip_and_owner(where):
    assert fences.read_fence(where) is None
    written = fences.write_fence(where, 3, "job-a")
    got = fences.read_fence(where)
    assert got == written and (got.generation, got.owner) == (3, "job-a") and got.written_at > 0


def test_a_bare_integer_fence_of_earlier_versions_is_read_and_replaced(where):
    storage.write_text(storage.join(where, fences.FENCE), "7\n")
    assert fences.read_fence(where) == fences.Fence(generation=7, owner=None)
    fences.write_fence(where, 1, "job-new")  # a job that takes over the folder starts again at 1
    assert (fences.read_fence(where).generation, fences.read_fence(where).owner) == (1, "job-new")


def test_the_generation_of_an_owner_never_goes_down(where):
    fences.write_fence(where, 5, "job-a")
    for lower in (5, 4, 1):
        with pytest.raises(fences.FenceError) as e:
            fences.write_fence(where, lower, "job-a")
        assert e.value.current.generation == 5 and "generation 5 of job-a" in str(e.value)
    fences.write_fence(where, 6, "job-a")
    fences.write_fence(where, 2, "job-b")  # another job takes the folder over (a resubmission)
    assert (fences.read_fence(where).generation, fences.read_fence(where).owner) == (2, "job-b")


def test_an_unreadable_fence_is_refused_by_readers_and_replaced_by_writers(where):
    storage.write_text(storage.join(where, fences.FENCE), "{not json")
    with pytest.raises(ValueError):
        fences.read_fence(where)
    fences.write_fence(where, 1, "job-a")
    assert fences.read_fence(where).generation == 1


def test_two_writers_of_the_same_generation_cannot_both_win(where):
    wins, losses = [], []

    def writer(i: int) -> None:
        try:
            wins.append(fences.write_fence(where, 9, "job-a"))
        except fences.FenceError:
            losses.append(i)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1 and len(losses) == 5
    assert fences.read_fence(where).token == wins[0].token


def test_concurrent_writers_never_lower_the_generation(where):
    """Writers of generations 1..16 in random order, at once, while a reader watches: what it sees only rises."""
    generations = list(range(1, 17))
    random.Random(0).shuffle(generations)
    seen, done, won = [], threading.Event(), []

    def watch() -> None:
        while not done.is_set():
            f = fences.read_fence(where)
            if f is not None:
                seen.append(f.generation)

    def writer(g: int) -> None:
        try:
            fences.write_fence(where, g, "job-a")
            won.append(g)
        except fences.FenceError:
            pass

    watcher = threading.Thread(target=watch)
    watcher.start()
    threads = [threading.Thread(target=writer, args=(g,)) for g in generations]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    watcher.join()
    assert fences.read_fence(where).generation == 16 and 16 in won
    assert seen == sorted(seen), "a reader saw the fence go down"


def test_tensorstore_finds_the_emulator_and_its_conditional_writes_hold(gcs):
    """TENSORSTORE_GCS_HTTP_URL and GOOGLE_AUTH_TOKEN_FOR_TESTING (set by `configure`) take tensorstore, which
    writes orbax's arrays, to the emulator; a write conditional on a stale generation changes nothing."""
    import tensorstore as ts

    kv = ts.KvStore.open(f"{gcs.folder}/").result()
    kv.write("k", b"v1").result()
    stale = kv.read("k").result().stamp.generation
    kv.write("k", b"v2").result()
    assert storage.read_bytes(storage.join(gcs.folder, "k")) == b"v2"  # what gcsfs sees: the same object
    refused = kv.write("k", b"v3", if_equal=stale).result()
    assert refused.generation == b"" and kv.read("k").result().value == b"v2"
