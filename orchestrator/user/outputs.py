"""Where `export` and `data prepare` may write their folder, checked before any of the work.

Both commands read (a checkpoint, a corpus) for a while and write one folder at the end,
so a place they cannot write is refused first, not after the work, and with one line:

- the name: no line breaks or other control characters (a folder named across two lines
  was written, and an error naming it would print as two lines); a URL is
  ``gs://BUCKET/FOLDER`` (``gs://`` alone became a local folder named ``gs:``, and the
  bucket's root is refused: with --force its every object would be deleted);
- a local folder: not in the kernel's trees (/proc, /sys, /dev: /proc/self took the
  command through its work to a traceback at the end), not a link, not an existing file,
  empty or `force`, and the nearest existing folder above it writable (`os.access`: the
  permissions, or a read-only file system);
- a bucket: its endpoint answers (`check_reachable`). gcsfs retries a refused connection
  six times per request with backoff, so a bucket with nothing listening took 108 s and
  ended in a traceback; a TCP connection is tried instead, `ATTEMPTS` times, in seconds.

Each problem is an `OutputFileError` (exit 2 in the CLI) naming the folder.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from urllib.parse import urlsplit

from orchestrator.domain.locations import check_gs_url, kernel_tree_problem, looks_like_url
from orchestrator.errors import OutputFileError

GOOGLE_STORAGE = "https://storage.googleapis.com"
ATTEMPTS = 3  # connections tried before a bucket's endpoint is taken as unreachable
CONNECT_TIMEOUT_S = 5.0
BACKOFF_S = 0.5  # before the second try; doubled before each next


def check_output_folder(out: str, *, force: bool) -> str:
    """`out` (a local path or ``gs://BUCKET/FOLDER``) as the folder to write; an `OutputFileError` if it cannot be.

    A URL comes back without its trailing slash. Reaching its bucket is `check_reachable`'s."""
    if not out.strip() or any(ord(c) < 32 or ord(c) == 127 for c in out):
        raise OutputFileError(repr(out), "a folder's name must not be empty nor contain line breaks or other "
                                         "control characters")
    if out.startswith("gs://"):
        bucket, _, folder = out[len("gs://"):].partition("/")
        if not bucket:
            raise OutputFileError(out, "names no bucket; give gs://BUCKET/FOLDER")
        if not folder.strip("/"):
            raise OutputFileError(out, f"names no folder in the bucket; give gs://{bucket}/FOLDER (a bucket's root "
                                       "is not written over)")
        try:
            return check_gs_url(out, folder_required=True)
        except ValueError as e:
            raise OutputFileError(out, str(e).removeprefix(f"{out!r}: ")) from None
    if looks_like_url(out):
        raise OutputFileError(out, "must be a local folder or gs://BUCKET/FOLDER")
    _check_local_folder(Path(out), force=force)
    return out


def _check_local_folder(out: Path, *, force: bool) -> None:
    if (problem := kernel_tree_problem(out)) is not None:
        raise OutputFileError(out, problem)
    if out.is_symlink():  # dangling or not: the rename at the end would replace the link, not its target
        raise OutputFileError(out, "is a symbolic link; give the path of a folder (its target is left alone)")
    if out.exists():
        if not out.is_dir():
            raise OutputFileError(out, "exists and is not a folder (even --force replaces only a folder)")
        if not force and any(out.iterdir()):
            raise OutputFileError(out, "exists and is not empty (--force replaces it)")
    above = out.absolute().parent
    while not above.exists() and above != above.parent:  # the folders missing above it are made at the end
        above = above.parent
    if not above.is_dir():
        raise OutputFileError(out, f"{above} is not a folder")
    if not os.access(above, os.W_OK | os.X_OK):  # not ours to write, or a read-only file system
        raise OutputFileError(out, f"cannot make a folder in {above}: not writable here")


def check_reachable(url: str, endpoint: str | None) -> None:
    """An `OutputFileError` naming `url` unless a TCP connection to its Cloud Storage endpoint
    (`endpoint`, an emulator's; None: Google's) opens within `ATTEMPTS` tries."""
    where = endpoint or GOOGLE_STORAGE
    parts = urlsplit(where if "://" in where else f"http://{where}")
    host = parts.hostname or ""
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise OutputFileError(url, f"the Cloud Storage endpoint {where!r} has no valid port") from None
    started, last = time.monotonic(), ""
    for attempt in range(ATTEMPTS):
        if attempt:
            time.sleep(BACKOFF_S * 2 ** (attempt - 1))
        try:
            socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S).close()
            return
        except OSError as e:  # refused, unreachable, a name that does not resolve, a timeout
            last = e.strerror or str(e) or type(e).__name__
    tries = f"{ATTEMPTS} tries in {time.monotonic() - started:.1f} s"
    if endpoint is None:
        raise OutputFileError(url, f"cannot reach Google's Cloud Storage ({host}:{port}): {last} ({tries}); is this "
                                   "machine online?")
    raise OutputFileError(url, f"cannot reach the Cloud Storage endpoint {where}: {last} ({tries}); is it running, "
                               "and is the address right?")
