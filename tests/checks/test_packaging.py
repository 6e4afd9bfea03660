"""What the code imports is what pyproject.toml declares, and tools stay out of the product.

The files are read with `ast`, not imported, so every import counts, the ones inside
functions too. A third-party module is matched to the installed distribution that ships
it (`yaml` is PyYAML; in a namespace package shared by several distributions, such as
`google`, the one that ships the deeper path: `google.cloud.tpu_v2` is google-cloud-tpu,
`google.api_core` is google-api-core).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.metadata
import re
import sys
import tomllib
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("orchestrator", "workers", "kernels", "policies")  # what the wheel ships
FIRST_PARTY = {*PACKAGES, "tests", "benchmarks"}
EMULATOR = "orchestrator.emulator"
EMULATOR_DIR = REPO / "orchestrator" / "emulator"
# The one place outside the emulator that may load it: the `orchestrator emulator` command, lazily.
EMULATOR_ALLOWED_IN = (REPO / "orchestrator" / "user" / "cli.py", "emulator")


@dataclasses.dataclass(frozen=True)
class Import:
    path: Path
    line: int
    module: str                 # absolute and dotted (relative imports resolved)
    names: tuple[str, ...]      # `from module import a, b`; empty for `import module`
    function: str | None        # the innermost enclosing function, None at module level

    @property
    def targets(self) -> list[str]:
        """Every module this import may load: `from orchestrator import emulator` loads orchestrator.emulator."""
        return [self.module, *(f"{self.module}.{n}" for n in self.names)]

    def __str__(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line} ({self.module})"


def imports(path: Path) -> list[Import]:
    tree = ast.parse(path.read_text(), filename=str(path))
    package = path.relative_to(REPO).with_suffix("").parts[:-1]
    found: list[Import] = []

    def visit(node: ast.AST, function: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend(Import(path, child.lineno, a.name, (), function) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = package[:len(package) - child.level + 1] if child.level else ()
                module = ".".join([*base, *([child.module] if child.module else [])])
                found.append(Import(path, child.lineno, module, tuple(a.name for a in child.names), function))
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            visit(child, inner)

    visit(tree, None)
    return found


def python_files(*roots: str) -> list[Path]:
    return sorted(p for root in roots for p in (REPO / root).rglob("*.py"))


def is_first_party(imp: Import) -> bool:
    """Ours: a package of this repository, or a module beside the importing file (tests/kernels/kernel_checks)."""
    top = imp.module.split(".")[0]
    here = imp.path.parent
    return top in FIRST_PARTY or (here / f"{top}.py").exists() or (here / top / "__init__.py").exists()


def normalize(distribution: str) -> str:
    return re.sub(r"[-_.]+", "-", distribution).lower()


def declared(*extras: str) -> set[str]:
    """Distributions named in [project].dependencies and the given optional extras (versions and extras dropped)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirements = [*project["dependencies"], *(r for e in extras for r in project["optional-dependencies"][e])]
    return {normalize(re.match(r"[A-Za-z0-9._-]+", r).group()) for r in requirements}


@functools.cache
def installed() -> dict[str, importlib.metadata.Distribution]:
    found: dict[str, importlib.metadata.Distribution] = {}
    for dist in importlib.metadata.distributions():
        found.setdefault(normalize(dist.metadata["Name"]), dist)
    return found


@functools.cache
def owners_of_top_level() -> dict[str, frozenset[str]]:
    return {top: frozenset(map(normalize, dists)) for top, dists in importlib.metadata.packages_distributions().items()}


def ships(distribution: str, parts: list[str]) -> bool:
    """Whether the distribution's files include the module `.`.join(parts) (a folder, a .py or an extension)."""
    *folders, last = parts
    for f in installed()[distribution].files or ():
        if f.parts[:len(folders)] == tuple(folders) and len(f.parts) > len(folders) \
                and f.parts[len(folders)].split(".")[0] == last:
            return True
    return False


def providers(module: str) -> frozenset[str]:
    """The installed distributions that provide `module` (normalized names); empty when none does."""
    parts = module.split(".")
    owners = owners_of_top_level().get(parts[0], frozenset())
    if len(owners) > 1:  # a namespace package: the distributions that ship the deepest part of the path
        for depth in range(len(parts), 1, -1):
            deepest = frozenset(d for d in owners if d in installed() and ships(d, parts[:depth]))
            if deepest:
                return deepest
    return owners


@pytest.mark.parametrize("roots, extras", [
    (PACKAGES, ()),
    (("tests",), ("test",)),
    (("benchmarks",), ("test",)),
], ids=["shipped packages", "tests", "benchmarks"])
def test_every_third_party_import_is_declared(roots, extras):
    allowed = declared(*extras)
    undeclared: dict[tuple[str, frozenset[str]], list[Import]] = defaultdict(list)
    for path in python_files(*roots):
        for imp in imports(path):
            top = imp.module.split(".")[0]
            if top in sys.stdlib_module_names or is_first_party(imp):
                continue
            found = providers(imp.module)
            if not found & allowed:
                undeclared[(top, found)].append(imp)
    if undeclared:
        where = "[project].dependencies" + "".join(f" or the {e!r} extra" for e in extras)
        pytest.fail(f"imported but not declared in pyproject.toml's {where}:\n" + "\n".join(
            f"  {top} (from {', '.join(sorted(found)) or 'no installed distribution'}): "
            + ", ".join(map(str, sites[:3])) + (f" and {len(sites) - 3} more" if len(sites) > 3 else "")
            for (top, found), sites in sorted(undeclared.items(), key=lambda item: item[0][0])), pytrace=False)


def loads_emulator(imp: Import) -> bool:
    return any(t == EMULATOR or t.startswith(EMULATOR + ".") for t in imp.targets)


def test_the_product_loads_the_emulator_only_in_the_emulator_command():
    """The emulator is a tool beside the product: only `orchestrator emulator` loads it, inside the command."""
    refused = [imp for path in python_files(*PACKAGES) if not path.is_relative_to(EMULATOR_DIR)
               for imp in imports(path) if loads_emulator(imp) and (imp.path, imp.function) != EMULATOR_ALLOWED_IN]
    if refused:
        pytest.fail(f"{EMULATOR} imported outside it (allowed only inside {EMULATOR_ALLOWED_IN[1]}() of "
                    f"{EMULATOR_ALLOWED_IN[0].relative_to(REPO)}):\n" + "\n".join(f"  {imp}" for imp in refused),
                    pytrace=False)


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_benchmarks_import_no_tests_and_no_private_names():
    """Benchmarks use what a user could: the public names of the shipped packages, nothing from tests/."""
    refused = []
    for path in sorted((REPO / "benchmarks").glob("*.py")):
        for imp in imports(path):
            parts = imp.module.split(".")
            if parts[0] == "tests":
                refused.append(f"  {imp}: imports the tests")
            elif parts[0] in PACKAGES and any(map(is_private, [*parts, *imp.names])):
                private = [n for n in [*parts, *imp.names] if is_private(n)]
                refused.append(f"  {imp}: imports private {', '.join(private)}")
    if refused:
        pytest.fail("benchmarks reaching past the public API:\n" + "\n".join(refused), pytrace=False)
