"""What a module loads when it is imported, in a fresh process: the control plane stays clear of JAX."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_reading_the_catalog_imports_no_jax():
    """The control plane reads `kernels.hardware`; the kernels package must not load JAX for it."""
    check = "import sys, orchestrator.catalog; assert 'jax' not in sys.modules, sorted(sys.modules)"
    r = subprocess.run([sys.executable, "-c", check], cwd=Path(__file__).resolve().parents[2],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
