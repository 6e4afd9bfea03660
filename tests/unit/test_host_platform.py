"""A host runs on what it is (`workers.accelerator`): its CPU where its Ray node declares that it stands
in for the TPU chips, else its TPU only; the multislice settings; a claim's name.

The runs that start JAX on a host are processes of their own (JAX picks its backend once per process):
tests/integration/test_host_platform.py.
"""

from __future__ import annotations

import os

import pytest

from workers import accelerator, runtime
from workers.accelerator import CPU_STAND_IN_ENV, HostClaim


@pytest.mark.parametrize("environ, platform", [
    ({CPU_STAND_IN_ENV: "1"}, "cpu"),
    ({}, "tpu"),  # a real TPU VM's startup script declares nothing
    ({CPU_STAND_IN_ENV: "0"}, "tpu"),
    ({CPU_STAND_IN_ENV: ""}, "tpu"),
])
def test_a_host_is_a_tpu_host_unless_it_declares_its_cpu_a_stand_in(environ, platform):
    assert accelerator.host_platform(environ) == platform


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
