"""What goes to the hosts with a job: the packed folder (excludes, size limit), its keeping, the worker environment."""

from __future__ import annotations

import ast
import io
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

from orchestrator.control import shipping
from orchestrator.errors import SpecError
from orchestrator.providers.startup import WORKER_DISTRIBUTIONS, worker_requirements
from tests.conftest import REPO


def _names(package: shipping.Package) -> set[str]:
    return set(zipfile.ZipFile(io.BytesIO(package.data)).namelist())


def test_a_folder_is_packed_without_version_control_environments_data_or_checkpoints(tmp_path):
    (tmp_path / "train.py").write_text("def main(ctx): pass\n")
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "model.py").write_text("X = 1\n")
    for junk in (".git/config", ".venv/bin/python", "data/tokens.bin", "checkpoints/10/state", "__pycache__/t.pyc",
                 "notes/secret.txt"):
        (tmp_path / junk).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / junk).write_text("x")
    (tmp_path / ".gitignore").write_text("notes/\n")
    package = shipping.pack_folder(tmp_path)
    names = _names(package)
    assert {"train.py", "lib/model.py"} <= names
    assert not [n for n in names if n.split("/")[0] in {".git", ".venv", "data", "checkpoints", "__pycache__", "notes"}]
    assert package.uri.startswith("gcs://_ray_pkg_") and package.uri.endswith(".zip")


def test_a_folder_over_the_limit_is_refused_naming_it_and_its_size(tmp_path):
    (tmp_path / "big.bin").write_bytes(b"\0" * (3 * 2**20))
    with pytest.raises(SpecError) as e:
        shipping.pack_folder(tmp_path, source="job.yaml", limit=2**20)
    assert e.value.problems[0][0] == "workdir"
    assert str(tmp_path) in str(e.value) and "3.0 MiB" in str(e.value) and "limit 1.0 MiB" in str(e.value)


def test_a_missing_folder_is_refused(tmp_path):
    with pytest.raises(SpecError, match="not a directory"):
        shipping.pack_folder(tmp_path / "gone", source="job.yaml")


def test_the_packed_folder_is_kept_and_read_back(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "train.py").write_text("print('hi')\n")
    package = shipping.pack_folder(tmp_path / "src")
    assert shipping.kept(tmp_path / "job") is None
    shipping.keep(package, tmp_path / "job")
    back = shipping.kept(tmp_path / "job")
    assert back is not None and (back.uri, back.data) == (package.uri, package.data)


def test_the_user_example_packs_small():
    package = shipping.pack_folder(REPO / "examples" / "user-train")
    assert {"train.py", "job.yaml"} <= _names(package) and len(package.data) < 64 * 1024


def _third_party_imports(folder: Path) -> set[str]:
    found = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module.split(".")[0])
    return found


def test_the_worker_environment_has_every_package_the_shipped_code_imports():
    """A host has only what the startup script installs: every import of workers/, kernels/ and
    policies/ outside the standard library and the shipped packages must come from a pinned distribution."""
    import sys

    providers = metadata.packages_distributions()
    imports = set().union(*(_third_party_imports(REPO / p) for p in shipping.PROJECT_PACKAGES))
    third_party = {m for m in imports if m not in sys.stdlib_module_names and m not in shipping.PROJECT_PACKAGES}
    pinned = {r.split("==")[0].split("[")[0] for r in worker_requirements()}
    missing = {m: providers.get(m) for m in third_party if not set(providers.get(m, [m])) & set(WORKER_DISTRIBUTIONS)}
    assert not missing, f"imported on hosts but not in the worker environment: {missing}"
    for dist in pinned:  # at the controller's own versions
        assert f"=={metadata.version(dist)}" in next(r for r in worker_requirements()
                                                     if r.split("==")[0].split("[")[0] == dist)


# -- a job's own packages (requirements.txt in its folder) ------------------------------------

def test_the_folders_requirements_travel_in_the_kept_package_and_become_a_pinned_pip_env(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "train.py").write_text("import inflection\n")
    (tmp_path / "src" / "requirements.txt").write_text("# the program's own\ninflection==0.5.1  # words\n\n")
    shipping.keep(shipping.pack_folder(tmp_path / "src"), tmp_path / "job")
    back = shipping.kept(tmp_path / "job")
    assert back is not None and shipping.job_requirements(back) == ["inflection==0.5.1"]
    env = shipping.pip_env(shipping.job_requirements(back))
    assert env["packages"][0] == "inflection==0.5.1"
    pinned = dict(line.split("==") for line in env["packages"][1:])
    for dist in ("jax", "ray", "orbax-checkpoint", "numpy"):  # a user's package cannot move them
        assert pinned[dist] == metadata.version(dist)
    assert "--index-url" not in " ".join(env["pip_install_options"])


def test_a_folder_without_requirements_asks_for_no_packages(tmp_path):
    (tmp_path / "train.py").write_text("def main(ctx): pass\n")
    assert shipping.job_requirements(shipping.pack_folder(tmp_path)) == []


@pytest.mark.parametrize("line, expected", [
    ("--index-url https://example.com/simple", "'--index-url https://example.com/simple' is a pip option"),
    ("-r ../other.txt", "is a pip option"),
    ("-e .", "is a pip option"),
    ("../lib", "'../lib' is a URL or a path"),
    ("/opt/wheels/x-1.0-py3-none-any.whl", "is a URL or a path"),
    ("https://example.com/x.tar.gz", "is a URL or a path"),
    ("x @ https://example.com/x-1.0-py3-none-any.whl", "is a URL or a path"),
    ("flax ==", "is not a requirement"),
    ("numpy==1.26.4", f"excludes numpy {metadata.version('numpy')}, the version every host has"),
])
def test_a_bad_requirement_is_refused_with_one_line_naming_the_file_and_line(tmp_path, line, expected):
    (tmp_path / "train.py").write_text("def main(ctx): pass\n")
    (tmp_path / "requirements.txt").write_text(f"inflection==0.5.1\n{line}\n")
    with pytest.raises(SpecError) as e:
        shipping.pack_folder(tmp_path, source="job.yaml")
    [(field, why)] = e.value.problems
    assert field == "workdir requirements.txt" and expected in why, why
    assert len(str(e.value).splitlines()) == 1


def test_a_requirements_file_that_is_a_link_out_of_the_folder_is_refused(tmp_path):
    (tmp_path / "job").mkdir()
    (tmp_path / "elsewhere.txt").write_text("inflection\n")
    (tmp_path / "job" / "requirements.txt").symlink_to(tmp_path / "elsewhere.txt")
    with pytest.raises(SpecError, match="workdir requirements.txt: .* is a symbolic link"):
        shipping.pack_folder(tmp_path / "job", source="job.yaml")


def test_what_this_machine_has_installed_needs_no_pip_env_on_its_own_local_hosts():
    here = [f"typer=={metadata.version('typer')}", "pyyaml>=6", "pywin32; sys_platform == 'win32'"]
    assert shipping.satisfied_here(here)
    assert not shipping.satisfied_here(["typer<0.1"])
    assert not shipping.satisfied_here(["no-such-distribution-here==1.0"])
