"""The fence: the record, beside a job's checkpoints, of
which generation of the job's workers may write there, and whose folder it is (`owner`,
the job id). The controller writes it before it starts a generation; a worker reads it
before each save and writes only while it names the worker's generation. On a bucket it is
one object replaced with a generation precondition (``ifGenerationMatch``), so that of two
writers racing, one wins and the other re-reads; locally it is one file replaced by an
atomic rename under a lock on its folder. A writer never lowers the generation of its own
owner's fence, and of two writers of the same generation only one succeeds (`FenceError`
for the other). A fence of another owner, or a bare integer from before owners were recorded,
is replaced: a job resubmitted on the folder of an earlier one takes it over. A second job
on a folder whose job has not ended never gets that far: the controller refuses it at submit,
and a folder records which run its checkpoints belong to (`orchestrator.control.ownership`).

Example::

    fence.write_fence("gs://b/run", generation=3, owner="tiny-lm-3f2a1c")
    fence.read_fence("gs://b/run")                     # Fence(generation=3, owner='tiny-lm-3f2a1c', ...)
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import random
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from workers.storage import PathLike, StorageError, gcs_blob, is_not_found, is_url, join, replace_local

log = logging.getLogger(__name__)

FENCE = ".fence"  # the file's name in the folder


class FolderTaken(RuntimeError):
    """The fence beside the job's checkpoints names another job: another controller took the folder."""


@dataclass(frozen=True)
class Fence:
    """What a fence records: the generation whose workers may write, and whose folder it is."""

    generation: int
    owner: str | None = None  # the job (its id) whose folder this is; None: written before owners were
    token: str | None = None  # this write's random id: tells a writer that a write it retried was its own
    written_at: float | None = None  # seconds since the epoch

    def to_json(self) -> str:
        return json.dumps({"generation": self.generation, "owner": self.owner, "token": self.token,
                           "written_at": self.written_at}) + "\n"

    @classmethod
    def parse(cls, text: str) -> "Fence":
        """A fence's record: JSON, or the bare integer that earlier versions wrote (owner unknown)."""
        text = text.strip()
        if text.lstrip("-").isdigit():
            return cls(generation=int(text))
        data = json.loads(text)
        if not isinstance(data, dict) or not isinstance(data.get("generation"), int):
            raise ValueError(f"not a fence record: {text[:100]!r}")
        return cls(generation=data["generation"], owner=data.get("owner"), token=data.get("token"),
                   written_at=data.get("written_at"))


class FenceError(RuntimeError):
    """The fence holds what this writer must not replace (a generation as high or higher of the same owner)."""

    def __init__(self, directory: str, wanted: int, owner: str | None, current: Fence):
        self.directory, self.wanted, self.owner, self.current = directory, wanted, owner, current
        super().__init__(f"{directory}: the fence is at generation {current.generation} of {current.owner}; "
                         f"not writing generation {wanted} of {owner} over it")

    def __reduce__(self):
        return type(self), (self.directory, self.wanted, self.owner, self.current)


def _may_replace(current: Fence | None, new: Fence) -> bool:
    """Whether `new` may replace `current`: no fence (or an unreadable one), another owner's (a takeover,
    including a bare integer of an earlier version), or a higher generation of the same owner."""
    return current is None or current.owner != new.owner or new.generation > current.generation


def _parse_or_none(text: str) -> Fence | None:
    try:
        return Fence.parse(text)
    except ValueError:  # an unreadable record: the writer replaces it (a reader refuses to write under it)
        log.warning("replacing an unreadable fence record %r", text[:100])
        return None


def read_fence(directory: PathLike, *, endpoint: str | None = None) -> Fence | None:
    """The fence in `directory`, or None if there is none. ValueError for a record that cannot be read."""
    path = join(directory, FENCE)
    try:
        if is_url(path):
            text = gcs_blob(path, endpoint).download_as_bytes().decode("utf-8")
        else:
            text = Path(path).read_text()
    except FileNotFoundError:
        return None
    except Exception as e:
        if is_not_found(e):
            return None
        raise
    return Fence.parse(text)


def may_write(directory: PathLike, *, endpoint: str | None, job_id: str, generation: int) -> bool:
    """Whether the workers of the job's `generation` may write checkpoints in `directory`: only its current one.

    The controller writes the current generation into the fence beside the checkpoints (`write_fence`: a file,
    or an object in the bucket) before it launches a group, so the check needs no controller (it may be
    restarting). A fence that cannot be read, or none, says no. FolderTaken if it names another job.
    """
    try:
        fence = read_fence(directory, endpoint=endpoint)
    except Exception as e:  # noqa: BLE001 -- unreachable, unreadable: not sure it is ours, so not writing
        log.warning("cannot read the fence in %s (%s: %s); not writing", directory, type(e).__name__, e)
        return False
    if fence is None:
        log.warning("no fence in %s; not writing", directory)
        return False
    if fence.owner not in (None, job_id):  # not an older generation of this job: another job's folder now
        raise FolderTaken(f"the checkpoint folder {directory} was taken by job {fence.owner} (its generation "
                          f"{fence.generation}): another controller runs a job there; this job stops without "
                          "saving, so as not to train on with no checkpoint")
    return fence.generation == generation


def write_fence(directory: PathLike, generation: int, owner: str | None, *, endpoint: str | None = None) -> Fence:
    """Record that `generation` of `owner` (a job id) is the one whose workers may write in `directory`.

    Raises FenceError when the fence already holds a generation of `owner` as high or
    higher (another writer got there first); see the module's docstring.
    """
    directory = os.fspath(directory)
    new = Fence(generation=int(generation), owner=owner, token=secrets.token_hex(8), written_at=time.time())
    if is_url(directory):
        _write_fence_gcs(directory, new, endpoint)
    else:
        _write_fence_local(directory, new)
    return new


def _write_fence_local(directory: str, new: Fence) -> None:
    os.makedirs(directory, exist_ok=True)
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # writers of this folder one at a time: read, compare, rename
        try:
            current = _parse_or_none((Path(directory) / FENCE).read_text())
        except FileNotFoundError:
            current = None
        if current is not None and not _may_replace(current, new):  # no fence may always be replaced
            raise FenceError(directory, new.generation, new.owner, current)
        replace_local(Path(directory) / FENCE, new.to_json().encode())
    finally:
        os.close(fd)  # releases the lock


def _write_fence_gcs(directory: str, new: Fence, endpoint: str | None) -> None:
    from google.api_core import exceptions

    path = join(directory, FENCE)
    for attempt in range(50):
        blob = gcs_blob(path, endpoint)
        try:
            blob.reload()
            current, object_generation = _parse_or_none(blob.download_as_bytes(
                if_generation_match=blob.generation).decode("utf-8")), blob.generation
        except exceptions.NotFound:
            current, object_generation = None, 0
        except exceptions.PreconditionFailed:  # replaced between the two reads
            continue
        if current is not None and current.token == new.token:
            return  # a retried upload that had got through
        if current is not None and not _may_replace(current, new):  # no fence may always be replaced
            raise FenceError(directory, new.generation, new.owner, current)
        try:
            # Only if the object is still the one just read (0: only if there is none yet).
            gcs_blob(path, endpoint).upload_from_string(new.to_json(), content_type="application/json",
                                                     if_generation_match=object_generation)
            return
        except exceptions.PreconditionFailed:  # another writer got in between: read again
            time.sleep(random.uniform(0, 0.05 * min(attempt + 1, 10)))
    raise StorageError(directory, "could not write the fence: other writers kept replacing it")
