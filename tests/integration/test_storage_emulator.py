"""The local Cloud Storage emulator as a process (`orchestrator.emulator.storage`): it serves on loopback only, and
its process ends with it and with its parent."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import requests

from orchestrator.emulator.storage import running_storage
from tests.conftest import REPO


def test_the_emulator_serves_on_loopback_and_its_process_ends_with_it():
    with running_storage(buckets=("a-bucket",)) as emu:
        assert emu.url.startswith("http://127.0.0.1:")
        assert requests.get(f"{emu.url}/storage/v1/b/a-bucket", timeout=5).status_code == 200
        proc = emu._proc
    assert proc.poll() is not None
    with pytest.raises(requests.ConnectionError):
        requests.get(f"{emu.url}/storage/v1/b/a-bucket", timeout=5)
    with pytest.raises(ValueError, match="loopback"):
        running_storage(host="0.0.0.0").__enter__()


def test_the_emulator_ends_when_its_parent_does(tmp_path):
    """A test process that dies leaves no emulator behind: it reads its stdin until EOF."""
    child = ("from orchestrator.emulator.storage import serve_storage\n"
             "emu = serve_storage()\nprint(emu._proc.pid, flush=True)\nimport os\nos._exit(0)\n")
    out = subprocess.run([sys.executable, "-c", child], cwd=REPO, capture_output=True, text=True, timeout=60)
    pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            import os

            os.kill(pid, 0)
            time.sleep(0.1)
        except ProcessLookupError:
            return
    pytest.fail(f"emulator process {pid} outlived its parent")
