"""A host runs on what it is (`workers.accelerator`): its CPU where its Ray node declares that it stands
in for the TPU chips, else its TPU only, and a host without the TPU it claims says so in one line.

JAX picks its backend once per process, so the runs that start one are subprocesses, each doing what
`workers.host.HostWorker` does: decide, configure, check.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO
from workers import accelerator, runtime
from workers.accelerator import CPU_STAND_IN_ENV, HostClaim

HOST = """
import json
from workers import accelerator, runtime

platform = accelerator.host_platform()
runtime.configure(platform=platform, devices_per_host=4)
import jax

out = {"platform": platform, "jax_platforms": jax.config.jax_platforms}
try:
    out["kind"] = accelerator.check_tpu(accelerator.HostClaim("s1", "v4-16", 1, "v4"), 4)
except accelerator.PlatformError as e:
    out["error"] = str(e)
    if platform == "cpu":
        out["devices"] = [d.platform for d in jax.local_devices()]
print("RESULT " + json.dumps(out))
"""


def run_host(declared: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (CPU_STAND_IN_ENV, "JAX_PLATFORMS")}
    if declared:
        env.update(accelerator.stand_in_env())
    p = subprocess.run([sys.executable, "-c", HOST], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


@pytest.mark.parametrize("environ, platform", [
    ({CPU_STAND_IN_ENV: "1"}, "cpu"),
    ({}, "tpu"),  # a real TPU VM's startup script declares nothing
    ({CPU_STAND_IN_ENV: "0"}, "tpu"),
    ({CPU_STAND_IN_ENV: ""}, "tpu"),
])
def test_a_host_is_a_tpu_host_unless_it_declares_its_cpu_a_stand_in(environ, platform):
    assert accelerator.host_platform(environ) == platform


def test_a_declared_stand_in_runs_on_its_cpu_devices_and_they_are_no_tpu():
    out = run_host(declared=True)
    assert (out["platform"], out["jax_platforms"], out["devices"]) == ("cpu", "cpu", ["cpu"] * 4)
    assert out["error"] == "host 1 of slice s1 (v4-16) has 0 TPU devices, not the 4 per host of its slice type"


def test_a_host_that_declares_nothing_runs_on_tpu_only_and_without_one_says_so():
    out = run_host(declared=False)
    assert (out["platform"], out["jax_platforms"]) == ("tpu", "tpu")  # JAX may not fall back to the CPU
    error = out["error"]
    assert error.startswith("host 1 of slice s1 (v4-16) found no TPU: Unable to initialize backend 'tpu'"), error
    assert error.endswith(f"; a host whose CPU stands in for TPU chips declares {CPU_STAND_IN_ENV}=1 in its Ray "
                          "node's environment"), error
    assert "\n" not in error


@pytest.mark.parametrize("platform, set_", [("tpu", True), (None, True), ("cpu", False)])
def test_the_multislice_settings_go_to_the_environment_on_tpu_only(platform, set_):
    try:
        multislice = runtime.initialize(coordinator_address="10.0.0.2:1234", num_processes=1, process_id=0,
                                        slice_id=1, num_slices=2, platform=platform)
        assert multislice["MEGASCALE_SLICE_ID"] == "1"
        assert (os.environ.get("MEGASCALE_COORDINATOR_ADDRESS") == "10.0.0.2:8080") is set_
    finally:
        for key in [k for k in os.environ if k.startswith("MEGASCALE_")]:
            del os.environ[key]


def test_a_claim_names_the_host_within_its_slice():
    assert str(HostClaim("tiny-1", "v5litepod-8", 0, "v5e")) == "host 0 of slice tiny-1 (v5litepod-8)"
