"""A user program that imports a package the project does not depend on (`inflection`, small and pure Python).

Share-nothing VMs boot from the environment their startup script would build, the hosts' closure and
nothing else of this machine (`orchestrator.providers.worker_image`), so the package is not there, as it
would not be on a real TPU VM. Without it declared, preflight refuses the job before anything is created,
naming it; declared in the job folder's ``requirements.txt``, Ray's runtime environment installs it on
every host (from the package index), pinned against the hosts' own packages, and the user example trains
on it. A package of the submitting machine outside the closure (`typer`) stays out of reach on a host.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest

from orchestrator import JobSpec, JobState
from orchestrator.errors import SpecError
from orchestrator.providers.worker_image import worker_image
from orchestrator.user.data_prepare import prepare
from tests.conftest import REPO
from tests.integration.test_share_nothing import EXAMPLE, emulated_vms
from tests.storage_fixture import gcs, gcs_emulator  # noqa: F401 (fixtures)

PACKAGE = "inflection==0.5.1"

PROGRAM = '''"""The user example, with a package of the user's own."""

import inflection

from train import main as train


def main(ctx):
    try:
        import typer  # noqa: F401  (installed where the job was submitted, not on a host)
        typer_here = "importable"
    except ImportError:
        typer_here = "missing"
    print(f"host {ctx.rank}: {inflection.titleize('user packages')} from {inflection.__file__}; "
          f"typer {typer_here}", flush=True)
    train(ctx)
'''


def job_folder(tmp_path, *, declared: bool):
    folder = tmp_path / "job"
    shutil.copytree(EXAMPLE, folder, ignore=shutil.ignore_patterns("data", "__pycache__", "*.yaml"))
    (folder / "packaged.py").write_text(PROGRAM)
    if declared:
        (folder / "requirements.txt").write_text(f"# what train.py needs beyond the hosts' packages\n{PACKAGE}\n")
    return folder


def spec_for(folder, tokens: str, ckpt: str, gcp: dict, endpoint: str) -> JobSpec:
    return JobSpec.from_dict({
        "name": "packaged", "accelerator": "v4-16", "workdir": str(folder), "provider": "gcp", "gcp": gcp,
        "storage": {"endpoint": endpoint},
        "workload": {"type": "entrypoint", "entrypoint": "packaged:main", "steps": 8, "seq_len": 32,
                     "global_batch_size": 16, "data": {"path": tokens},
                     "args": {"d_model": 64, "n_layers": 1, "n_heads": 4, "warmup_steps": 2}},
        "checkpoint": {"interval_steps": 4, "directory": ckpt},
        "recovery": {"start_timeout_s": 240, "max_failures": 0}})


def test_the_hosts_image_lacks_the_package():
    code = "import importlib.util as u; print(u.find_spec('inflection'), u.find_spec('typer'), u.find_spec('jax'))"
    out = subprocess.run([str(worker_image().python), "-I", "-c", code], capture_output=True, text=True, check=True)
    none_, none2, jax = out.stdout.split(" ", 2)
    assert (none_, none2) == ("None", "None") and "jax" in jax
    assert subprocess.run([sys.executable, "-c", "import typer"]).returncode == 0  # here, it is installed


def test_a_job_file_whose_program_needs_an_undeclared_package_is_refused_by_validate(tmp_path):
    folder = job_folder(tmp_path, declared=False)
    (folder / "job.yaml").write_text(
        "name: packaged\naccelerator: v4-16\nprovider: gcp\n"
        "gcp: {project: p, zones: [us-central2-b], bucket: some-bucket, head_address: '10.0.0.2:6379'}\n"
        "workload: {type: entrypoint, entrypoint: 'packaged:main'}\n")
    run = subprocess.run([sys.executable, "-m", "orchestrator", "validate", str(folder / "job.yaml")],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip() == (f"error: {folder / 'job.yaml'}: workload.entrypoint: imports 'inflection' "
                                  "(packaged.py:3), which the hosts do not have; add it to requirements.txt in the "
                                  "job's folder"), run.stderr
    assert run.stdout == ""


def test_with_the_package_declared_it_installs_and_the_job_trains_on_vms(client, tmp_path, gcs_emulator, gcs):
    tokens = gcs.folder + "/tokens"
    prepare(REPO / "orchestrator", tokens, vocab_size=512, pattern="*.py")
    with emulated_vms(client) as (_, gcp, _):
        undeclared = spec_for(job_folder(tmp_path / "undeclared", declared=False), tokens, gcs.folder + "/ckpt0",
                              gcp, gcs_emulator.url)
        with pytest.raises(SpecError) as refused:
            client.submit(undeclared)
        assert [(f, why.split(",")[0]) for f, why in refused.value.problems] == \
            [("workload.entrypoint", "imports 'inflection' (packaged.py:3)")]
        assert not [j for j in client.store.jobs() if j.name == "packaged"]  # nothing created

        folder = job_folder(tmp_path, declared=True)
        job = client.submit(spec_for(folder, tokens, gcs.folder + "/ckpt", gcp, gcs_emulator.url))
        shutil.rmtree(folder)  # the code, and its requirements.txt, went with the job
        st = job.wait(timeout_s=600)
        logs = job.logs()
        assert st.state is JobState.SUCCEEDED, (st.reason, logs[-3000:])
        for rank in (0, 1):
            # installed on the host by Ray's runtime environment, not found in the VM's image
            assert re.search(rf"host {rank}: User Packages from /tmp/ray/\S+/runtime_resources/\S*pip/\S+/virtualenv/"
                             r"\S+/inflection/__init__\.py; typer missing", logs), logs[-3000:]
        assert len([m for m in job.metrics() if m.loss is not None]) == 8
