"""An entrypoint job's `module:function`, checked at submit, before any slice is asked for.

A missing module, a syntax error in it, or a function it does not define would fail the
same way on every host of every slice. When the job's folder is on this machine, the
module's file is found there as the hosts will import it (the folder first on the path)
and parsed, never run: user code imports what only the hosts may have. A module that is
not in the folder but installed here is taken as found; a folder that is not here, or a
module that makes its names in ways a parse cannot see (`from x import *`, a module
`__getattr__`), is left to the hosts, which report an import error as its own cause.

Example::

    check_entrypoint(spec, source="job.yaml")  # SpecError on workload.entrypoint, or None
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

from orchestrator.errors import SpecError


def check_entrypoint(spec, source: str = "<spec>", workdir: str | Path | None = None) -> None:
    """A `SpecError` on `workload.entrypoint` if its module or function is not in the job's folder."""
    w = spec.workload
    if getattr(w, "type", None) != "entrypoint":
        return
    folder = spec.workdir or workdir
    problem = entrypoint_problem(Path(folder), w.entrypoint) if folder else None
    if problem:
        raise SpecError(source, [("workload.entrypoint", f"{w.entrypoint}: {problem}")])


def entrypoint_problem(folder: Path, entrypoint: str) -> str | None:
    """What is wrong with `module:function` imported from `folder`, or None (found, or not knowable here)."""
    if not folder.is_dir():
        return None  # a folder of the hosts' only: they say
    module, function = entrypoint.split(":", 1)
    parts = module.split(".")
    base = folder.joinpath(*parts)
    candidates = [base.with_suffix(".py"), base / "__init__.py"]
    file = next((c for c in candidates if c.is_file()), None)
    if file is None:
        if base.is_dir() or _installed(parts[0]):  # a namespace package, or a module installed here
            return None
        rel = "/".join(parts)
        return f"no module {module!r} in the job's folder {folder} (neither {rel}.py nor {rel}/__init__.py)"
    try:
        tree = ast.parse(file.read_bytes(), filename=str(file))
    except SyntaxError as e:
        return f"{file}, line {e.lineno}: {e.msg}"
    except (OSError, ValueError) as e:
        return f"{file}: cannot be read: {e}"
    names = _top_level_names(tree.body)
    if names is None or function in names:
        return None
    return f"module {module!r} ({file}) defines no {function!r}"


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None  # finds, does not import: a top-level name only
    except (ImportError, ValueError):
        return False


def _top_level_names(body: list[ast.stmt]) -> set[str] | None:
    """The names a module's top level binds (in `if`, `try` and `with` blocks too); None when a
    parse cannot tell (`from x import *`, a module `__getattr__`, assignments through `globals()`)."""
    names: set[str] = set()
    for node in body:
        bound = _names_bound_by(node)
        if bound is None:
            return None
        names |= bound
        if isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
            blocks = [getattr(node, attr, None) for attr in ("body", "orelse", "finalbody")]
            blocks += [h.body for h in getattr(node, "handlers", [])]
            for block in blocks:
                if block:
                    inner = _top_level_names(block)
                    if inner is None:
                        return None
                    names |= inner
    return None if "__getattr__" in names else names


def _names_bound_by(node: ast.stmt) -> set[str] | None:
    """The names one statement binds by itself (not in the blocks it holds); None when a parse cannot tell."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    names: set[str] = set()
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        for alias in node.names:
            if alias.name == "*":
                return None
            names.add(alias.asname or alias.name.split(".")[0])
    elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for t in targets:
            if isinstance(t, ast.Subscript):  # globals()["main"] = ...
                return None
            names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
    return names
