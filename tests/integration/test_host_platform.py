"""A host runs on what it is (`workers.accelerator`), in a process of its own as JAX picks its backend once per
process: each run does what `workers.host.HostWorker` does (decide, configure, check). On its CPU where its Ray
node declares that it stands in for the TPU chips, else on its TPU only, and a host without the TPU it claims
says so in one line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import REPO
from workers import accelerator
from workers.accelerator import CPU_STAND_IN_ENV

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
