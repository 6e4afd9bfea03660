"""The hosts' packages: the closure of the worker requirements, its pins, and the environment of exactly them
that emulated VMs boot from and preflight checks imports in."""

from __future__ import annotations

import subprocess
from importlib import metadata

import pytest
from packaging.requirements import Requirement

from orchestrator.providers import worker_env
from orchestrator.providers.startup import WORKER_DISTRIBUTIONS


def test_the_closure_follows_requirements_and_the_extras_they_ask_for():
    plain, default = worker_env.closure(("ray",)), worker_env.closure(("ray[default]",))
    assert "ray" in plain and set(plain) < set(default)
    assert "virtualenv" in default  # Ray's runtime-env pip needs it on the hosts: ray[default] brings it
    for line in metadata.distribution("ray").requires or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"extra": ""}):  # what plain `ray` needs here
            assert worker_env.normalized(req.name) in plain, line


def test_the_hosts_closure_holds_the_worker_distributions_and_nothing_only_the_controller_needs():
    hosts = worker_env.host_closure()
    assert {worker_env.normalized(d) for d in WORKER_DISTRIBUTIONS} <= set(hosts)
    for controller_only in ("typer", "rich", "google-cloud-tpu", "tpu-orchestrator", "pytest", "matplotlib"):
        assert controller_only not in hosts


def test_pins_are_this_machines_versions():
    pins = dict(p.split("==") for p in worker_env.pins())
    assert pins["jax"] == metadata.version("jax") and pins["orbax-checkpoint"] == metadata.version("orbax-checkpoint")
    assert len(pins) == len(worker_env.host_closure())


@pytest.fixture
def image(tmp_path, monkeypatch):
    from orchestrator.providers import worker_image

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    worker_image.worker_image.cache_clear()
    yield worker_image.worker_image()
    worker_image.worker_image.cache_clear()


def _importable(image, names: list[str]) -> dict[str, bool]:
    code = ("import importlib.util, sys\n"
            "print(' '.join(str(importlib.util.find_spec(n) is not None) for n in sys.argv[1:]))")
    out = subprocess.run([str(image.python), "-I", "-c", code, *names], capture_output=True, text=True, check=True)
    return dict(zip(names, (w == "True" for w in out.stdout.split()), strict=True))


def test_the_image_has_exactly_the_hosts_packages(image):
    found = _importable(image, ["jax", "ray", "orbax.checkpoint", "optax", "gcsfs", "google.cloud.storage", "pip",
                                "typer", "rich", "google.cloud.tpu", "orchestrator", "workers", "pytest", "inflection"])
    assert found == {"jax": True, "ray": True, "orbax.checkpoint": True, "optax": True, "gcsfs": True,
                     "google.cloud.storage": True, "pip": True,  # seeded by `python -m venv`, as on a VM
                     "typer": False, "rich": False, "google.cloud.tpu": False,  # the controller's, not the hosts'
                     "orchestrator": False, "workers": False,  # shipped with each job, not installed
                     "pytest": False, "inflection": False}
    assert {p.name for p in image.site_packages.iterdir()} >= {"jax", "ray", "google"}
    assert (image.site_packages / "google").is_dir() and not (image.site_packages / "google").is_symlink()


def test_the_image_is_built_once_and_reused(image):
    from orchestrator.providers import worker_image

    worker_image.worker_image.cache_clear()
    again = worker_image.worker_image()
    assert again.root == image.root and len(list(image.root.parent.iterdir())) == 1


def test_a_real_vms_startup_script_installs_the_workers_with_the_whole_closure_pinned():
    from orchestrator import catalog
    from orchestrator.providers.startup import WorkerSetup, startup_script

    script = startup_script(WorkerSetup("10.0.0.5:6379"), catalog.lookup("v4-16"), "s1")
    written = script.split("<<'CONSTRAINTS'\n", 1)[1].split("\nCONSTRAINTS\n", 1)[0].splitlines()
    assert written == list(worker_env.pins())
    assert "/opt/tpu-orchestrator/venv/bin/pip install --quiet -c /opt/tpu-orchestrator/venv/constraints.txt " \
           f"'ray[default]=={metadata.version('ray')}' 'jax[tpu]=={metadata.version('jax')}'" in script
    with pytest.raises(ValueError, match="constraints must be name==version lines"):
        WorkerSetup("10.0.0.5:6379", constraints=("x==1\nCONSTRAINTS\nrm -rf /",))
