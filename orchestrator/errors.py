"""The orchestrator's exceptions: one base class, subclasses that carry their data."""

from __future__ import annotations


class OrchestratorError(Exception):
    """Base of every error this package raises on purpose."""


class SpecError(OrchestratorError):
    """A job file or spec is invalid.

    `problems` holds one `(field_path, message)` pair per problem, so callers can
    show all of them; `source` names the file (or "<spec>" for an in-memory spec).
    """

    def __init__(self, source: str, problems: list[tuple[str, str]]):
        self.source = source
        self.problems = problems
        lines = [f"{source}: {path}: {msg}" if path else f"{source}: {msg}" for path, msg in problems]
        super().__init__("\n".join(lines))


class UnknownAcceleratorError(OrchestratorError, ValueError):
    """A TPU type name that is not in the catalog; the message lists the valid ones."""

    def __init__(self, name: str, valid: list[str]):
        self.name = name
        self.valid = valid
        super().__init__(f"unknown accelerator {name!r}; valid types are: {', '.join(valid)}")


class JobNotFoundError(OrchestratorError, KeyError):
    def __init__(self, job_id: str):
        self.job_id = job_id
        super().__init__(f"no job {job_id!r}")

    def __str__(self) -> str:  # KeyError quotes its message otherwise
        return self.args[0]


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
