"""What `validate` and `submit` check on gcp before anything is provisioned (`orchestrator.user.preflight`)."""

from __future__ import annotations

from importlib import metadata

from orchestrator import JobSpec
from orchestrator.user.preflight import gcp_problems, head_problems, import_problems, storage_problems
from tests.storage_fixture import BUCKET, gcs, gcs_emulator  # noqa: F401 (fixtures)


def gcp_spec(**gcp) -> JobSpec:
    return JobSpec.from_dict({"name": "pre", "provider": "gcp",
                              "gcp": {"project": "p", "zones": ["us-central2-b"], "bucket": BUCKET, **gcp}})


def test_a_loopback_head_is_refused_for_real_tpu_vms():
    [(field, why)] = head_problems(gcp_spec(), "127.0.0.1:6379")
    assert field.startswith("gcp.head_address") and "cannot reach" in why
    [(field, _)] = head_problems(gcp_spec(head_address="localhost:6379"), None)
    assert field == "gcp.head_address"


def test_a_reachable_head_or_an_emulated_api_passes():
    assert head_problems(gcp_spec(head_address="10.128.0.5:6379"), "127.0.0.1:6379") == []
    assert head_problems(gcp_spec(endpoint="http://127.0.0.1:8470"), "127.0.0.1:6379") == []
    assert head_problems(gcp_spec(), None) == []  # `validate`: no cluster to ask yet
    assert gcp_problems(JobSpec.from_dict({"name": "pre"}), "127.0.0.1:6379") == []  # local: nothing to check


def test_the_bucket_is_probed_writable(gcs_emulator):
    spec = JobSpec.from_dict({**gcp_spec(head_address="10.0.0.2:6379").model_dump(mode="json"),
                              "storage": {"endpoint": gcs_emulator.url}})
    assert storage_problems(spec) == [] and gcp_problems(spec) == []
    missing = JobSpec.from_dict({**spec.model_dump(mode="json"),
                                 "gcp": {**spec.model_dump(mode="json")["gcp"], "bucket": "no-such-bucket"}})
    [(field, why)] = storage_problems(missing)
    assert field == "gcp.bucket" and "gs://no-such-bucket/checkpoints/pre" in why and "cannot write" in why


# -- the program's imports against the hosts' packages ------------------------------------------

def program_spec(folder, **extra) -> JobSpec:
    return JobSpec.from_dict({**gcp_spec(head_address="10.0.0.2:6379").model_dump(mode="json"), "workdir": str(folder),
                              "workload": {"type": "entrypoint", "entrypoint": "train:main"}, **extra})


def write_program(folder, **files: str) -> None:
    for name, text in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_package_the_hosts_do_not_have_is_named_with_where_it_is_imported(tmp_path):
    write_program(tmp_path, **{
        "train.py": "import jax, optax\nfrom workers import api\nfrom model import layers\n\n"
                    "def main(ctx):\n    import inflection\n",
        "model/__init__.py": "", "model/layers.py": "from . import util\n", "model/util.py": "import typer.core\n"})
    problems = gcp_problems(program_spec(tmp_path), "127.0.0.1:6379")
    assert problems == [
        ("workload.entrypoint", "imports 'inflection' (train.py:6), which the hosts do not have; add it to "
                                "requirements.txt in the job's folder"),
        ("workload.entrypoint", "imports 'typer' (model/util.py:1), which the hosts do not have; add it to "
                                f"requirements.txt in the job's folder (e.g. typer=={metadata.version('typer')}, "
                                "the version installed here)")]


def test_declared_packages_optional_imports_and_the_hosts_own_pass(tmp_path):
    write_program(tmp_path, **{
        "train.py": "import yaml, jax\nimport typing\ntry:\n    import wandb\nexcept ImportError:\n    wandb = None\n"
                    "if typing.TYPE_CHECKING:\n    import torch\n\ndef main(ctx):\n    import inflection, typer\n",
        "requirements.txt": "inflection==0.5.1\ntyper\n", "unused.py": "import matplotlib\n"})
    assert import_problems(program_spec(tmp_path)) == []


def test_the_control_plane_is_no_host_package(tmp_path):
    write_program(tmp_path, **{"train.py": "from orchestrator import JobSpec\n\ndef main(ctx): pass\n"})
    [(field, why)] = import_problems(program_spec(tmp_path))
    assert field == "workload.entrypoint" and why.startswith("imports 'orchestrator' (train.py:1), the control plane")


def test_imports_are_checked_only_for_hosts_that_do_not_share_this_machine(tmp_path):
    write_program(tmp_path, **{"train.py": "import typer\n\ndef main(ctx): pass\n"})
    local = JobSpec.from_dict({"name": "pre", "workdir": str(tmp_path),
                               "workload": {"type": "entrypoint", "entrypoint": "train:main"}})
    assert import_problems(local) == []
    assert [f for f, _ in import_problems(program_spec(tmp_path))] == ["workload.entrypoint"]


def test_a_module_of_the_program_that_does_not_parse_is_named(tmp_path):
    write_program(tmp_path, **{"train.py": "import model\n\ndef main(ctx): pass\n", "model.py": "def f(:\n"})
    [(field, why)] = import_problems(program_spec(tmp_path))
    assert field == "workload.entrypoint" and why.startswith("model.py:1: ") and "cannot read the program" in why
