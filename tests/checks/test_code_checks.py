"""The code's own checks, as CI runs them: the layers and no import cycles (import-linter's contracts
in pyproject.toml), the linter (ruff) and the type checker (mypy), each over the whole project."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

BIN = Path(sys.executable).parent  # the environment's console scripts


def _run(tool: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / tool), *args], cwd=REPO, capture_output=True, text=True, timeout=600)


def test_the_layers_hold_and_no_import_cycle_is_left():
    r = _run("lint-imports", "--no-cache")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "0 broken" in r.stdout, r.stdout[-2000:]


def test_the_linter_passes():
    r = _run("ruff", "check", "--no-cache", ".")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def test_the_types_check():
    r = _run("mypy")  # the files and settings are pyproject.toml's [tool.mypy]
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


PROVIDER_COMPARISON = re.compile(r"provider\s*(==|!=|in \()")


def test_only_the_providers_compare_provider_names():
    """The control plane asks a provider's facts (`orchestrator.domain.provider_facts`), never its name."""
    found = [f"{path.relative_to(REPO)}:{n}: {line.strip()}"
             for package in ("orchestrator", "workers", "policies", "kernels")
             for path in sorted((REPO / package).rglob("*.py"))
             if not path.is_relative_to(REPO / "orchestrator" / "providers")
             for n, line in enumerate(path.read_text().splitlines(), 1) if PROVIDER_COMPARISON.search(line)]
    assert found == []


def test_no_public_class_name_is_defined_twice():
    """One name, one class: a reader who meets `Decision` or `Timings` should not have to ask which.
    Classes private to their module (a leading underscore) are left out."""
    where: dict[str, list[str]] = {}
    for package in ("orchestrator", "workers", "policies", "kernels"):
        for path in sorted((REPO / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                    where.setdefault(node.name, []).append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert {name: paths for name, paths in where.items() if len(paths) > 1} == {}
