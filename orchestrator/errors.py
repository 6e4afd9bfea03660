"""The orchestrator's exceptions: one base class, subclasses that carry their data.

Two families, which the CLI turns into exit codes: a `RequestError` means what was asked
cannot be done as asked (a bad job file, an unknown job or accelerator, a job in the wrong
state, an output path that cannot be written); fix the request and retry (exit 2). Every
other `OrchestratorError` is the job or the cluster failing (exit 1).

Every error survives pickling with its message and fields, so one raised inside the
controller (a Ray actor) reaches the client as itself.
"""

from __future__ import annotations

from pathlib import Path


class OrchestratorError(Exception):
    """Base of every error this package raises on purpose."""

    def __reduce__(self):
        # Exception's own reduce calls `cls(*self.args)`, and `args` holds the formatted
        # message, not the constructor's arguments: SpecError("x: y") cannot be rebuilt that
        # way. Rebuild without __init__: the message is `args`, the fields are `__dict__`.
        return _rebuild, (type(self), self.args), self.__dict__


def _rebuild(cls: type[OrchestratorError], args: tuple) -> OrchestratorError:
    error = cls.__new__(cls, *args)
    error.args = args
    return error


class RequestError(OrchestratorError):
    """What was asked cannot be done as asked; the request, not the system, has to change."""


class SpecError(RequestError):
    """A job file or spec is invalid.

    `problems` holds one `(field_path, message)` pair per problem, so callers can
    show all of them; `source` names the file (or "<spec>" for an in-memory spec).
    """

    def __init__(self, source: str, problems: list[tuple[str, str]]):
        self.source = source
        self.problems = problems
        lines = [f"{source}: {path}: {msg}" if path else f"{source}: {msg}" for path, msg in problems]
        super().__init__("\n".join(lines))


class UnknownAcceleratorError(RequestError, ValueError):
    """A TPU type name that is not in the catalog; the message lists the valid ones."""

    def __init__(self, name: str, valid: list[str]):
        self.name = name
        self.valid = valid
        super().__init__(f"unknown accelerator {name!r}; valid types are: {', '.join(valid)}")


class JobNotFoundError(RequestError, KeyError):
    def __init__(self, job_id: str):
        self.job_id = job_id
        super().__init__(f"no job {job_id!r}")

    def __str__(self) -> str:  # KeyError quotes its message otherwise
        return self.args[0]


class JobStateError(RequestError):
    """An action the job's current state does not allow, e.g. resizing a job that is not RUNNING."""

    def __init__(self, job_id: str, state: str, action: str, allowed: tuple[str, ...], *, why: str | None = None):
        self.job_id, self.state, self.action, self.allowed = job_id, state, action, allowed
        super().__init__(f"job {job_id} is {state}; " + (why or f"only a {' or '.join(allowed)} job can be {action}"))


class CheckpointFolderError(RequestError):
    """A job's checkpoint folder cannot be used as asked; `directory` names it, `problem` says why."""

    def __init__(self, directory: str, problem: str):
        self.directory, self.problem = directory, problem
        super().__init__(f"checkpoint folder {directory}: {problem}")


class FolderInUseError(CheckpointFolderError):
    """Another job that has not ended (`other_job`, in `other_state`) writes to the same checkpoint folder."""

    def __init__(self, directory: str, other_job: str, other_state: str):
        self.other_job, self.other_state = other_job, other_state
        super().__init__(directory, f"in use by job {other_job} ({other_state}); one folder takes one job at a "
                                    "time: wait for that job to end or cancel it, or set checkpoint.directory "
                                    "to another folder")


class FolderMismatchError(CheckpointFolderError):
    """The folder holds checkpoints of a run with other settings: `differences` holds one
    `(field, theirs, mine)` per setting, `last_step` its newest step, `owner` the job that wrote it (if known)."""

    def __init__(self, directory: str, problem: str, *, differences: list[tuple[str, object, object]],
                 last_step: int, owner: str | None):
        self.differences, self.last_step, self.owner = differences, last_step, owner
        super().__init__(directory, problem)


class OutputFileError(RequestError, ValueError):
    """A file the user asked us to write cannot be written there (wrong suffix, missing folder, a directory)."""

    def __init__(self, path: str | Path, problem: str):
        self.path, self.problem = str(path), problem
        super().__init__(f"{path}: {problem}")


class ProfileError(RequestError, ValueError):
    """A profile capture asked for with a bad step count or host, or while another is under way."""


class CaptureError(OrchestratorError):
    """A profile capture that was asked for did not come back: no host began it in time, or it failed."""


class IllegalTransitionError(OrchestratorError):
    def __init__(self, kind: str, key: str, current: str, target: str):
        self.kind, self.key, self.current, self.target = kind, key, current, target
        super().__init__(f"{kind} {key}: cannot go from {current} to {target}")


class ClusterError(OrchestratorError):
    """The Ray cluster could not be started, reached or stopped."""


class ProvisioningError(OrchestratorError):
    """A slice could not be provisioned or its workers could not all start."""

    def __init__(self, message: str, *, slice_name: str | None = None, transient: bool = False):
        self.slice_name = slice_name
        self.transient = transient
        super().__init__(message)


class StoreFaultError(OrchestratorError):
    """The state store cannot be written now: its disk is full, it is read-only, or the file was
    deleted or replaced while this process had it open.

    `cause` is one of `STORE_FAULT_CAUSES`; `detail` says what the system said. A disk that
    is full again has room, a file made writable again works again: the fault is not final.
    """

    def __init__(self, path: str | Path, cause: str, detail: str):
        self.path, self.cause, self.detail = str(path), cause, detail
        super().__init__(f"state store not writable: {cause} ({path}: {detail})")


STORE_FAULT_CAUSES = ("disk full", "read-only", "deleted", "replaced", "I/O error", "cannot open")
