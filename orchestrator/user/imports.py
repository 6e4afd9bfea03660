"""What a user program imports, and which of it the hosts would not have (`preflight.import_problems`).

The program's own modules are the entrypoint's module and, transitively, every module of the
job's folder it imports (with the packages above each). Their imports are read from the source
(nothing of the program runs here), so an import inside a function counts as much as one at the
top; an import guarded by ``try: ... except ImportError`` (an optional one) or under
``if TYPE_CHECKING:`` does not. Each module outside the folder must then be found in a clean
environment of the hosts' packages: a subprocess of the hosts' image (`worker_image`), isolated
from this machine's path, or be provided by a package the folder's ``requirements.txt`` declares.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

OPTIONAL = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}
SHIPPED = ("workers", "kernels", "policies")  # `orchestrator.control.shipping.PROJECT_PACKAGES`, on every host


@dataclass
class Program:
    """The program's own modules (by file) and the modules from outside its folder they import (where first)."""

    files: list[Path] = field(default_factory=list)
    outside: dict[str, str] = field(default_factory=dict)  # top-level module name -> "file:line" of its first import
    unreadable: dict[str, str] = field(default_factory=dict)  # "file:line" -> why it cannot be parsed


def _local(folder: Path, dotted: str) -> list[Path]:
    """The files importing module `dotted` of the folder runs (each package's __init__ on the way), or []."""
    files, here = [], folder
    for part in dotted.split("."):
        if (here / part / "__init__.py").is_file():
            here = here / part
            files.append(here / "__init__.py")
        elif (here / part).is_dir():  # a namespace package
            here = here / part
        elif (here / f"{part}.py").is_file():
            files.append(here / f"{part}.py")
            break
        else:
            break
    return files


def _optional(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """Inside ``try`` with an ImportError handler, or under ``if TYPE_CHECKING``."""
    child, up = node, parents.get(node)
    while up is not None:
        if isinstance(up, ast.Try) and child in up.body:
            for h in up.handlers:
                names = h.type.elts if isinstance(h.type, ast.Tuple) else [h.type]
                if h.type is None or any(isinstance(n, ast.Name) and n.id in OPTIONAL for n in names):
                    return True
        if isinstance(up, ast.If) and child in up.body and "TYPE_CHECKING" in ast.unparse(up.test):
            return True
        child, up = up, parents.get(up)
    return False


def _imports(path: Path, package: str) -> list[tuple[str, int]]:
    """The absolute module names `path` (a module of `package`) imports, each with its line."""
    tree = ast.parse(path.read_bytes(), filename=str(path))
    parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
    out: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and not _optional(node, parents):
            out.extend((a.name, node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not _optional(node, parents):
            if node.level:
                base = package.split(".") if package else []
                base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
                stem = ".".join([*base, *([node.module] if node.module else [])])
            else:
                stem = node.module or ""
            if not stem:
                continue
            out.append((stem, node.lineno))
            out.extend((f"{stem}.{a.name}", node.lineno) for a in node.names if a.name != "*")
    return out


def program(folder: str | Path, module: str) -> Program:
    """The modules of the program whose entrypoint is `module` in `folder`, and what they import from outside."""
    folder = Path(folder).resolve()
    prog = Program()
    todo, seen = [module], set()
    while todo:
        dotted = todo.pop()
        if dotted in seen:
            continue
        seen.add(dotted)
        for path in _local(folder, dotted):
            if path in prog.files:
                continue
            prog.files.append(path)
            rel = path.relative_to(folder)
            package = ".".join(rel.parts[:-1])  # of a.py: the folder's top; of a/b.py and a/__init__.py: a
            try:
                found = _imports(path, package)
            except SyntaxError as e:
                prog.unreadable[f"{rel}:{e.lineno or 0}"] = e.msg
                continue
            except (UnicodeDecodeError, ValueError) as e:  # not UTF-8, or a NUL byte
                prog.unreadable[f"{rel}:0"] = str(e).splitlines()[0]
                continue
            for name, line in found:
                top = name.split(".")[0]
                if _local(folder, top) or (folder / top).is_dir():
                    todo.append(name)
                elif top not in sys.stdlib_module_names and top != "__future__" and top not in SHIPPED:
                    prog.outside.setdefault(top, f"{rel}:{line}")
    return prog


def missing_on_hosts(names: list[str], python: Path) -> list[str]:
    """Which top-level modules `names` the interpreter `python` (isolated: its own environment only) cannot find."""
    code = ("import importlib.util, json, sys\n"
            "print(json.dumps([n for n in json.loads(sys.argv[1]) if importlib.util.find_spec(n) is None]))")
    out = subprocess.run([str(python), "-I", "-c", code, json.dumps(sorted(names))], capture_output=True, text=True,
                         timeout=120, check=True, cwd="/")
    return json.loads(out.stdout)


def provided_by(requirement_names: list[str]) -> set[str]:
    """Top-level modules the declared packages give a host, as far as this machine can tell: those of each one
    installed here and of everything it requires, and otherwise a module of the package's own name."""
    from orchestrator.providers.worker_env import closure, normalized

    installed = closure(tuple(requirement_names))
    dists = {normalized(n) for n in [*requirement_names, *installed]}
    modules = {normalized(n).replace("-", "_") for n in requirement_names}
    for module, owners in metadata.packages_distributions().items():
        if any(normalized(o) in dists for o in owners):
            modules.add(module)
    return modules
