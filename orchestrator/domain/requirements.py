"""An entrypoint job's own packages: ``requirements.txt`` at the root of the job's folder.

A program may import packages the project does not depend on (flax, einops, ...). The hosts
have only the project's (`orchestrator.providers.worker_env`); the job's folder names the
rest in a pip requirements file, ``requirements.txt`` beside its modules, which travels with
the folder and is installed on every host through Ray's runtime environment, pinned to the
hosts' versions (`orchestrator.control.shipping.runtime_env`).

Only packages by name come from it, from the package index the hosts use: a line such as
``flax==0.12.1``, ``einops>=0.8`` or ``rich[jupyter]; python_version >= "3.11"``. Refused, each
with one line naming the file and the line: pip options (``--index-url``, ``-r``, ``-e``, ...:
they would change where every host installs from), URLs and paths (code in the job's folder
ships with it and is imported from there; nothing outside it reaches a host), and text that is
no requirement.
"""

from __future__ import annotations

from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement

FILE = "requirements.txt"
FIELD = f"workdir {FILE}"  # how an error names it: the file at the root of the job's folder (workdir)
MAX_BYTES = 64 * 1024
MAX_LINES = 200

Problem = tuple[str, str]


def parse(text: str) -> tuple[list[Requirement], list[Problem]]:
    """The requirements of a requirements file's `text`, and a problem for each line that is not one."""
    reqs: list[Requirement] = []
    problems: list[Problem] = []
    lines = text.splitlines()
    if len(text.encode()) > MAX_BYTES or len(lines) > MAX_LINES:
        return [], [(FIELD, f"holds {len(lines)} lines ({len(text.encode())} bytes); at most {MAX_LINES} lines of "
                            f"{MAX_BYTES // 1024} KiB: name the packages the program imports, not an environment")]
    for n, raw in enumerate(lines, 1):
        line = raw.split(" #", 1)[0].strip() if not raw.lstrip().startswith("#") else ""
        if not line:
            continue
        problem = _line_problem(line)
        if problem is not None:
            problems.append((FIELD, f"line {n}: {problem}"))
            continue
        reqs.append(Requirement(line))
    return reqs, problems


def _line_problem(line: str) -> str | None:
    shown = line if len(line) <= 80 else line[:77] + "..."
    if line.startswith("-"):
        return (f"{shown!r} is a pip option; only packages by name are taken (the hosts install from their package "
                f"index, pinned to the project's versions)")
    if line.endswith("\\"):
        return f"{shown!r} continues on the next line; write each requirement on one line"
    if "://" in line or line.startswith((".", "/", "~")) or line.endswith((".whl", ".tar.gz", ".zip")) \
            or ("/" in line and "@" not in line):
        return (f"{shown!r} is a URL or a path; only packages by name from the package index are taken (code in "
                f"the job's folder ships with it and is imported from there)")
    try:
        req = Requirement(line)
    except InvalidRequirement as e:
        return f"{shown!r} is not a requirement ({str(e).splitlines()[0]}); write e.g. 'flax==0.12.1'"
    if req.url:
        return (f"{shown!r} installs from a URL; only packages by name from the package index are taken (code "
                f"in the job's folder ships with it and is imported from there)")
    return None


def read(folder: str | Path) -> tuple[list[Requirement], list[Problem]]:
    """The requirements of the job's folder (none if it has no requirements file), and its problems."""
    path = Path(folder) / FILE
    if not path.exists() and not path.is_symlink():
        return [], []
    if path.is_symlink():
        return [], [(FIELD, f"{path} is a symbolic link; write the file itself in the job's folder (nothing outside "
                            f"the folder reaches a host)")]
    try:
        if not path.is_file():
            return [], [(FIELD, f"{path} is not a regular file")]
        if path.stat().st_size > MAX_BYTES:
            return [], [(FIELD, f"{path} holds {path.stat().st_size} bytes; at most {MAX_BYTES // 1024} KiB")]
        text = path.read_text()
    except UnicodeDecodeError:
        return [], [(FIELD, f"{path} is not UTF-8 text")]
    except OSError as e:
        return [], [(FIELD, f"{path} cannot be read: {e.strerror or e}")]
    return parse(text)
