"""Whose checkpoint folder it is: one folder belongs to one job identity at a time.

Checkpoints are worth resuming only by a job that trains the same thing: the same model,
optimizer and data. So a folder keeps, beside its checkpoints, a record of the run that writes
there (``identity.json``: the job, and the settings that decide what a step computes), and
every submit is checked against the folder before the job is recorded (`claim`):

- a folder in use by a job that has not ended is refused (`FolderInUseError`, naming that job);
  the store checks it again when it records the job, in the same transaction, so of two
  submits at the same moment exactly one gets the folder;
- a folder that holds checkpoints of a run with other settings is refused, naming each
  setting that differs (`FolderMismatchError`), unless the submit asks to start fresh (the old
  folder is moved aside, whole, to ``<folder>.replaced-<UTC time>``) or to resume anyway;
- a folder that holds checkpoints but no record (written before records were kept, or by a
  program outside the orchestrator) is refused the same way: nothing says it is this run.

What counts as the same run (`identity_of`): the workload's type, its model (or entrypoint and
args), the optimizer's schedule, the sequence length, global batch, seed and data. Not the
number of steps (training longer resumes), nor the slice, mesh, precision, remat or kernel
blocks, which change how a step runs, not what it computes.

The fence (`workers.fence.write_fence`) names the job whose workers may write; this record
names the run those checkpoints belong to. `decide` is the pure part; `look` reads a folder,
`take` acts on the decision, and `record_job` does all of it for `Controller.submit`.

Example::

    record_job(store, job_id, spec, OnExisting.CHECK)  # FolderInUseError, FolderMismatchError; or recorded
    record_job(store, job_id, spec, OnExisting.FRESH)  # the old checkpoints moved aside, step 0
"""

from __future__ import annotations

import enum
import json
import os
import time
from dataclasses import dataclass

from orchestrator.domain.spec import JobSpec, LmWorkload
from orchestrator.errors import CheckpointFolderError, FolderInUseError, FolderMismatchError
from orchestrator.state.events import FolderClaimed
from orchestrator.state.states import FailedBecause, JobState
from orchestrator.state.store import Store
from workers import storage

IDENTITY = "identity.json"
RECORD_VERSION = 1


class OnExisting(str, enum.Enum):
    """What a submit does with a folder that holds checkpoints of a run with other settings."""

    CHECK = "check"  # resume the same run; refuse another's
    FRESH = "fresh"  # move the old checkpoints aside and start from step 0
    RESUME_ANYWAY = "resume-anyway"  # resume whatever is there


class Action(str, enum.Enum):
    NEW = "new"  # no checkpoints there
    RESUME = "resume"  # the same run's checkpoints
    RESUME_ANYWAY = "resume-anyway"  # another run's, resumed as asked
    FRESH = "fresh"  # the checkpoints there were moved aside


@dataclass(frozen=True)
class Folder:
    """What a checkpoint folder holds: its step folders and the record of the run that wrote them."""

    directory: str
    steps: tuple[int, ...] = ()
    recorded: dict | None = None  # identity.json as written; None: there is none (or it cannot be read)


@dataclass(frozen=True)
class Claim:
    """What a submit does with its folder, and the sentence its event says."""

    action: Action
    reason: str
    folder: Folder
    differences: tuple[tuple[str, object, object], ...] = ()  # (field, in the folder's record, in this job)
    set_aside_to: str | None = None  # for FRESH

    @property
    def previous_job(self) -> str | None:
        return (self.folder.recorded or {}).get("job")


def folder_key(directory: str) -> str:
    """One string per folder: a local path with its links resolved, a URL without a trailing slash."""
    if storage.is_url(directory):
        return directory.rstrip("/")
    return os.path.realpath(directory)


def identity_of(spec: JobSpec) -> dict[str, object]:
    """The settings that decide what the job's steps compute, as flat ``{"workload.model.d_model": 128, ...}``."""
    w = spec.workload
    out: dict[str, object] = {"workload.type": w.type, "workload.seq_len": w.seq_len,
                              "workload.global_batch_size": w.global_batch_size, "workload.seed": w.seed,
                              "workload.data": w.data.path if w.data else None}
    if isinstance(w, LmWorkload):
        model = w.model.model_dump(mode="json") | {"n_kv_heads": w.model.kv_heads}  # None and n_heads are one
        out |= _flat("workload.model", model) | _flat("workload.learning_rate", w.learning_rate.model_dump(mode="json"))
    else:
        out |= {"workload.entrypoint": w.entrypoint} | _flat("workload.args", w.args)
    return json.loads(json.dumps(out))  # as it reads back from the record (tuples are lists there)


def _flat(prefix: str, value: object) -> dict[str, object]:
    if isinstance(value, dict) and value:
        return {k: v for key, item in value.items() for k, v in _flat(f"{prefix}.{key}", item).items()}
    return {prefix: value}


UNSET = "(unset)"  # a setting one side has and the other has not


def differences(recorded: dict[str, object], wanted: dict[str, object]) -> list[tuple[str, object, object]]:
    """`(field, recorded value, wanted value)` for every setting that differs; one on one side only is UNSET there."""
    return [(k, recorded.get(k, UNSET), wanted.get(k, UNSET)) for k in sorted(recorded.keys() | wanted.keys())
            if recorded.get(k, UNSET) != wanted.get(k, UNSET)]


def decide(folder: Folder, wanted: dict[str, object], on_existing: OnExisting, *, now: float) -> Claim:
    """What a submit whose identity is `wanted` does with `folder`; FolderMismatchError when it must not.

    No checkpoints: the folder is the job's (NEW). Checkpoints of the same run: RESUME. Of
    another run, or of a run nobody recorded: refused, unless `on_existing` says FRESH or
    RESUME_ANYWAY. FRESH moves checkpoints aside even when they are the same run's.
    """
    where, steps = folder.directory, folder.steps
    if not steps:
        return Claim(Action.NEW, f"checkpoint folder {where}: no checkpoints there; starting from step 0", folder)
    last = steps[-1]
    record = folder.recorded
    of = f" of job {record['job']}" if record and record.get("job") else ""
    holds = f"holds checkpoints up to step {last}{of}"
    if on_existing is OnExisting.FRESH:
        aside = f"{where.rstrip('/')}.replaced-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime(now))}"
        return Claim(Action.FRESH, f"checkpoint folder {where}: {holds}; moved them aside to {aside} and starting "
                                   "from step 0, as asked", folder, set_aside_to=aside)
    recorded = record.get("identity") if record is not None else None
    found = differences(recorded if isinstance(recorded, dict) else {}, wanted) if record is not None else []
    if record is not None and not found:
        return Claim(Action.RESUME, f"checkpoint folder {where}: {holds}, the same run; resuming", folder)
    what = (f"trained with other settings: {_listed(found)}" if record is not None else
            f"with no record of the run that wrote them ({IDENTITY}: written by an older version, or by a program "
            "outside the orchestrator), so nothing says they are this run's")
    if on_existing is OnExisting.RESUME_ANYWAY:
        return Claim(Action.RESUME_ANYWAY, f"checkpoint folder {where}: {holds}, {what}; resuming anyway, as asked",
                     folder, differences=tuple(found))
    raise FolderMismatchError(
        where, f"{holds}, {what}. To start over, submit with --fresh (Python: submit(..., fresh=True)); the old "
               f"checkpoints are moved to {where.rstrip('/')}.replaced-<time>. To continue from step {last} anyway, "
               "--resume-anyway (resume_anyway=True). Or set checkpoint.directory to another folder",
        differences=found, last_step=last, owner=record.get("job") if record else None)


def _listed(found: list[tuple[str, object, object]]) -> str:
    return "; ".join(f"{field} was {_shown(was)}, is {_shown(now)}" for field, was, now in found)


def _shown(value: object) -> str:
    return UNSET if value == UNSET else json.dumps(value)


def look(directory: str, *, endpoint: str | None = None) -> Folder:
    """The step folders in `directory` and its record, read locally or from a bucket."""
    try:
        names = storage.listdir(directory, endpoint=endpoint)
    except FileNotFoundError:
        return Folder(directory)
    except Exception as e:  # noqa: BLE001 -- a bucket that cannot be reached or read, told as the folder's error
        raise CheckpointFolderError(directory, f"cannot be read: {type(e).__name__}: {e}") from None
    steps = tuple(sorted(int(n) for n in names if n.isdigit()))
    if IDENTITY not in names:
        return Folder(directory, steps)
    try:
        recorded = json.loads(storage.read_text(storage.join(directory, IDENTITY), endpoint=endpoint))
    except FileNotFoundError:
        recorded = None
    except ValueError:  # not JSON: as good as no record
        recorded = None
    except Exception as e:  # noqa: BLE001 -- any other read failure, told as the folder's error
        raise CheckpointFolderError(directory, f"cannot read its {IDENTITY}: {type(e).__name__}: {e}") from None
    return Folder(directory, steps, recorded if isinstance(recorded, dict) else None)


def claim(store: Store, spec: JobSpec, on_existing: OnExisting, *, now: float | None = None) -> Claim:
    """What submitting `spec` does with its checkpoint folder (filled in); raises if it must not be submitted."""
    directory = spec.checkpoint.directory
    assert directory is not None, "the controller fills in the default folder first"
    holder = store.job_using(folder_key(directory))
    if holder is not None:
        raise FolderInUseError(directory, holder.id, holder.state.value)
    folder = look(directory, endpoint=spec.storage.endpoint)
    return decide(folder, identity_of(spec), on_existing, now=time.time() if now is None else now)


def record_job(store: Store, job_id: str, spec: JobSpec, on_existing: OnExisting, *,
               now: float | None = None) -> Claim:
    """Record job `job_id` (`spec`, its folder filled in) in `store`, its checkpoint folder claimed: `claim`,
    then the job and its folder in one transaction, then `take` and its event (kind FOLDER).

    FolderInUseError or FolderMismatchError, and nothing is recorded, when the folder is not the job's
    to take. If the folder cannot be set up (a bucket that refuses the write), the job ends FAILED
    saying why, and CheckpointFolderError says it to the caller.
    """
    claimed = claim(store, spec, on_existing, now=now)
    directory = claimed.folder.directory
    store.create_job(job_id, spec.name, spec.model_dump(mode="json"), folder=folder_key(directory))
    try:
        event = take(spec, job_id, claimed)
    except Exception as e:  # noqa: BLE001 -- the job cannot run without its folder: say why, to the caller too
        why = f"{type(e).__name__}: {e}"
        store.transition(job_id, JobState.FAILED, f"could not set up checkpoint folder {directory}: {why}",
                         cause=FailedBecause.STORAGE.value)
        raise CheckpointFolderError(directory, f"could not be set up: {why}") from None
    store.add_event(job_id, event, claimed.reason)
    return claimed


def take(spec: JobSpec, job_id: str, claimed: Claim) -> FolderClaimed:
    """Act on `claimed` for job `job_id`: move the old checkpoints aside (FRESH), write the folder's record.

    Call it once the store holds the job with its folder, so no other job acts on the folder meanwhile.
    Returns the event to record.
    """
    directory, endpoint = claimed.folder.directory, spec.storage.endpoint
    if claimed.action is Action.FRESH:
        assert claimed.set_aside_to is not None, "decide names where a fresh start moves the old run"
        storage.move_tree(directory, claimed.set_aside_to, endpoint=endpoint)
    storage.makedirs(directory)
    record = {"version": RECORD_VERSION, "job": job_id, "name": spec.name, "written_at": time.time(),
              "identity": identity_of(spec)}
    storage.write_text(storage.join(directory, IDENTITY), json.dumps(record, indent=1) + "\n", endpoint=endpoint)
    return FolderClaimed(directory=directory, action=claimed.action.value,
                         last_step=claimed.folder.steps[-1] if claimed.folder.steps else None,
                         previous_job=claimed.previous_job, differences=[list(d) for d in claimed.differences],
                         set_aside_to=claimed.set_aside_to)


__all__ = ["Action", "Claim", "Folder", "IDENTITY", "OnExisting", "claim", "decide", "differences", "folder_key",
           "identity_of", "look", "record_job", "take"]
