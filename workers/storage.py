"""Where a job's files live: a local path or an object-store URL (``gs://bucket/folder``), used the same way.

TPU VMs share no disk with the controller or with each other, so on gcp a job's
checkpoints, its fence, its token files and its exports live in Cloud Storage; locally they
may live on disk or in a bucket. Every function here takes a path as a string (or a
`pathlib.Path`): a local absolute path, or a URL, which goes through fsspec (gcsfs for
``gs://``). Orbax reaches the same buckets through etils.epath (gcsfs) for its folders and
tensorstore for its arrays.

**Pointing a process at an emulator.** `configure(endpoint)` sets, in this process, what
makes every client talk to `endpoint` (`endpoint_env` lists them) and the fsspec defaults
for ``gs://``; call it before the process first touches a bucket (tensorstore reads its
settings when it opens a ``gs://`` store; gcsfs and etils cache their file systems).
`configure(None)` keeps Google's endpoint and the machine's credentials (on a TPU VM its
service account). Either way it turns off gcsfs's cache of listings: other processes write
the same folders (orbax lists step folders that tensorstore wrote), and a cached listing
would hide their writes. The functions that a controller calls for many jobs (the fence,
`check_writable`) also take ``endpoint=`` per call, so that they need no process-wide setting.

Where the clients go (an emulator or Google's) is set in `workers.storage_clients`; `configure` is here too.

**The fence** (`workers.fence`) lives beside a job's checkpoints and is written through these clients.

Example::

    storage.configure("http://127.0.0.1:8471")          # an emulator; None: Google's
    storage.write_text(storage.join("gs://b/run", "note.txt"), "hi")
    storage.read_text(storage.join("gs://b/run", "note.txt"))
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import tempfile
from pathlib import Path

from workers.storage_clients import configure, configure_from_environment, endpoint_env, gcs_client, normal_endpoint

log = logging.getLogger(__name__)

PathLike = str | os.PathLike


class StorageError(OSError):
    """A folder or bucket that cannot be used as asked; `where` names it."""

    def __init__(self, where: str, problem: str):
        self.where, self.problem = str(where), problem
        super().__init__(f"{where}: {problem}")

    def __reduce__(self):
        return type(self), (self.where, self.problem)


# -- paths and URLs --------------------------------------------------------------------------


def is_url(path: PathLike) -> bool:
    """Whether `path` is a URL (``scheme://...``) rather than a local path."""
    return "://" in os.fspath(path)


def join(base: PathLike, *parts: str) -> str:
    """`base` with `parts` appended: ``join("gs://b/x", "y", "z") == "gs://b/x/y/z"``; local paths as os.path.join."""
    base = os.fspath(base)
    if not is_url(base):
        return os.path.join(base, *parts)
    out = base.rstrip("/")
    for p in parts:
        p = p.strip("/")
        if p:
            out = f"{out}/{p}"
    return out


def split_gcs(url: PathLike) -> tuple[str, str]:
    """``gs://bucket/some/name`` -> ``("bucket", "some/name")``; a StorageError for anything else."""
    url = os.fspath(url)
    if not url.startswith("gs://"):
        raise StorageError(url, "not a gs:// URL")
    bucket, _, name = url[len("gs://"):].partition("/")
    if not bucket:
        raise StorageError(url, "names no bucket")
    return bucket, name.strip("/")


def filesystem(path: PathLike, *, endpoint: str | None = None):
    """``(fsspec file system, path inside it)`` for `path`; `endpoint` overrides `configure`'s for a URL."""
    import fsspec

    path = os.fspath(path)
    if not is_url(path):
        return fsspec.filesystem("file"), path
    if endpoint and path.startswith("gs://"):
        from gcsfs.core import GCSFileSystem

        fs = GCSFileSystem(token="anon", endpoint_url=normal_endpoint(endpoint), use_listings_cache=False)
        return fs, fs._strip_protocol(path)
    return fsspec.core.url_to_fs(path)


# -- small files, listings, trees ---------------------------------------------------------------


def exists(path: PathLike, *, endpoint: str | None = None) -> bool:
    """Whether a file or folder is at `path` (on a bucket: an object, or any object under it)."""
    if not is_url(path):
        return os.path.exists(path)
    fs, p = filesystem(path, endpoint=endpoint)
    return fs.exists(p)


def isdir(path: PathLike, *, endpoint: str | None = None) -> bool:
    """Whether `path` is a folder (on a bucket: any object has it as a prefix)."""
    if not is_url(path):
        return os.path.isdir(path)
    fs, p = filesystem(path, endpoint=endpoint)
    return fs.isdir(p)


def read_bytes(path: PathLike, *, endpoint: str | None = None) -> bytes:
    """The whole content of the file at `path` (FileNotFoundError if there is none)."""
    if not is_url(path):
        return Path(path).read_bytes()
    fs, p = filesystem(path, endpoint=endpoint)
    return fs.cat_file(p)


def read_text(path: PathLike, *, endpoint: str | None = None) -> str:
    return read_bytes(path, endpoint=endpoint).decode("utf-8")


def write_bytes(path: PathLike, data: bytes, *, endpoint: str | None = None) -> None:
    """Replace the file at `path` with `data`, whole: a reader sees the old content or the new, never a part.

    Locally a temporary file beside it renamed over it (its folder is made if missing); on
    a bucket one object upload, which is atomic by nature.
    """
    if not is_url(path):
        replace_local(Path(path), data)
        return
    fs, p = filesystem(path, endpoint=endpoint)
    fs.pipe_file(p, data)


def write_text(path: PathLike, text: str, *, endpoint: str | None = None) -> None:
    write_bytes(path, text.encode("utf-8"), endpoint=endpoint)


def replace_local(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def makedirs(path: PathLike) -> None:
    """Make the folder `path` and its parents; on a bucket nothing (folders are only name prefixes there)."""
    if not is_url(path):
        os.makedirs(path, exist_ok=True)


def listdir(path: PathLike, *, endpoint: str | None = None) -> list[str]:
    """The names directly inside folder `path`, sorted (FileNotFoundError if there is no such folder)."""
    if not is_url(path):
        return sorted(os.listdir(path))
    fs, p = filesystem(path, endpoint=endpoint)
    if not fs.isdir(p):
        raise FileNotFoundError(f"no such folder: {path}")
    names = {os.path.basename(e.rstrip("/")) for e in fs.ls(p, detail=False)}
    return sorted(n for n in names if n)


def remove(path: PathLike, *, endpoint: str | None = None) -> None:
    """Delete the file at `path`; nothing if there is none."""
    if not is_url(path):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    fs, p = filesystem(path, endpoint=endpoint)
    with contextlib.suppress(FileNotFoundError):
        fs.rm_file(p)


def remove_tree(path: PathLike, *, endpoint: str | None = None) -> None:
    """Delete the folder `path` and everything under it; nothing if there is none."""
    if not is_url(path):
        import shutil

        shutil.rmtree(path, ignore_errors=not os.path.exists(path))
        return
    fs, p = filesystem(path, endpoint=endpoint)
    with contextlib.suppress(FileNotFoundError):
        fs.rm(p, recursive=True)


def move_tree(src: PathLike, dst: PathLike, *, endpoint: str | None = None) -> None:
    """Move folder `src` to `dst` (which must not exist).

    Locally one atomic rename. A bucket has no rename: every object is copied (a copy inside
    the bucket, no download), then the originals deleted; a move cut short leaves the whole
    of `src` in place and part of it at `dst`, and doing it again finishes it.
    """
    if is_url(src) != is_url(dst):
        raise StorageError(os.fspath(dst), f"cannot move {src} between a bucket and this machine")
    if not is_url(src):
        if os.path.exists(dst):
            raise FileExistsError(f"{dst} exists")
        os.rename(src, dst)
        return
    fs, s = filesystem(src, endpoint=endpoint)
    _, d = filesystem(dst, endpoint=endpoint)
    names = [n for n in fs.find(s) if not n.endswith("/")]
    if not names:
        raise FileNotFoundError(f"no such folder: {src}")
    root = s.split("://", 1)[-1].rstrip("/")
    dst_root = d.split("://", 1)[-1].rstrip("/")
    for name in names:  # every copy first: until the last one, `src` is whole
        fs.copy(name, dst_root + name[len(root):])
    fs.rm(names)


def upload_folder(local_dir: PathLike, dest: PathLike, *, last: tuple[str, ...] = (),
                  endpoint: str | None = None) -> None:
    """Copy the files under local folder `local_dir` to `dest` (a URL or a local folder), keeping their
    relative names; the files named in `last` (relative names) go after all others, so a reader that
    looks for them first finds the rest complete."""
    local_dir = Path(local_dir)
    files = sorted(p for p in local_dir.rglob("*") if p.is_file())
    rel = [p.relative_to(local_dir).as_posix() for p in files]
    order = sorted(range(len(files)), key=lambda i: (rel[i] in last, last.index(rel[i]) if rel[i] in last else 0))
    if not is_url(dest):
        import shutil

        for i in order:
            target = Path(dest) / rel[i]
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(files[i], target)
        return
    fs, d = filesystem(dest, endpoint=endpoint)
    first = [i for i in order if rel[i] not in last]
    then = [i for i in order if rel[i] in last]
    for group in (first, then):
        if group:
            fs.put([str(files[i]) for i in group], [join(d, rel[i]) for i in group])


def check_writable(directory: PathLike, *, endpoint: str | None = None) -> None:
    """A StorageError naming `directory` unless a file can be written there, read back and deleted.

    For a preflight check: on a bucket this is the bucket reachable, and writable with this
    machine's credentials (a small object ``.probe-<random>`` that is deleted again).
    """
    directory = os.fspath(directory)
    probe = join(directory, f".probe-{secrets.token_hex(6)}")
    data = secrets.token_bytes(16)
    try:
        if is_url(directory):
            blob = gcs_blob(probe, endpoint)
            blob.upload_from_string(data, if_generation_match=0)
            back = blob.download_as_bytes()
            blob.delete()
        else:
            makedirs(directory)
            write_bytes(probe, data)
            back = read_bytes(probe)
            remove(probe)
    except Exception as e:  # noqa: BLE001 -- what any client says is the message: no bucket, 403, unreachable
        raise StorageError(directory, f"cannot write there: {_reason(e)}") from None
    if back != data:
        raise StorageError(directory, "a file written there read back different")


def _reason(e: BaseException) -> str:
    text = getattr(e, "message", None) or str(e) or type(e).__name__
    return f"{type(e).__name__}: {text}"[:300]


def gcs_blob(url: str, endpoint: str | None):
    """The google-cloud-storage object at ``gs://`` `url` (for reads and writes with preconditions)."""
    bucket, name = split_gcs(url)
    return gcs_client(endpoint).bucket(bucket).blob(name)


def is_not_found(e: BaseException) -> bool:
    """Whether a google-cloud-storage error says the object is not there."""
    from google.api_core import exceptions

    return isinstance(e, exceptions.NotFound)


__all__ = ["StorageError", "check_writable", "configure", "configure_from_environment", "endpoint_env", "exists",
           "filesystem", "gcs_blob", "is_not_found", "is_url", "isdir", "join", "listdir", "makedirs", "move_tree",
           "read_bytes", "read_text", "remove", "remove_tree", "replace_local", "split_gcs", "upload_folder",
           "write_bytes", "write_text"]
