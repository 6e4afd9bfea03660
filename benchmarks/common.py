"""Helpers the benchmarks share: a machine description, a fresh client, steady-state throughput."""

from __future__ import annotations

import json
import os
import platform
import tempfile
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> str:
    return f"{platform.machine()} {os.cpu_count()} cores, {platform.system()} (CPU devices stand in for TPU chips)"


def fresh_client():
    """A client on a new state directory (so no compile cache or checkpoint carries over)."""
    from orchestrator import Client

    home = Path(tempfile.mkdtemp(prefix="orch-bench-"))
    os.environ["ORCHESTRATOR_HOME"] = str(home)
    client = Client(home=home)
    client.connect()
    return client


def steady_tokens_per_s(step_times: list[float], tokens_per_step: int, *, skip: int = 3) -> float:
    """Tokens per second over the steps after the first `skip` (which carry warm-up costs)."""
    times = step_times[skip:]
    return tokens_per_step * len(times) / sum(times)


def wait_until(predicate, timeout_s: float = 600.0, poll_s: float = 0.05) -> None:
    """Poll `predicate` until it holds; TimeoutError after `timeout_s`."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(poll_s)
    raise TimeoutError(f"gave up after {timeout_s:.0f} s")


def save(name: str, data: dict) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(json.dumps(data, indent=2))
    print(f"wrote {path}")
    return path
