"""How a host names what ended its program: its errors, their chain of causes, and the one line of the reason."""

from __future__ import annotations

from policies.decisions.recovery import FailureCause, failure_cause


class EntrypointError(Exception):
    """The job's entrypoint could not be imported (its module, a module it imports, or its function)."""


def error_chain(e: BaseException | None) -> list[tuple[str, int | None, str]]:
    """`e` and its causes, each as `policies.decisions.recovery.failure_cause` reads them."""
    out, seen = [], set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        out.append((type(e).__name__, getattr(e, "errno", None) if isinstance(e, OSError) else None, str(e)))
        e = e.__cause__ or e.__context__
    return out


def error_line(e: BaseException, chain: list, cause: FailureCause) -> str:
    """One line for the job's reason: the exception, and for a storage error the link of its chain that says so."""
    line = str(e) if isinstance(e, EntrypointError) else f"{type(e).__name__}: {e}"
    if cause is FailureCause.STORAGE:
        name, _, message = next((c for c in chain if failure_cause([c]) is FailureCause.STORAGE), chain[0])
        if message not in line:
            line += f" (from {name}: {message})"
    return line
