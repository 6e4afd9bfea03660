"""A real profile capture of a jitted step on 4 CPU devices, summarized, and read back by the profile tooling."""

from __future__ import annotations

import glob
import json
import subprocess
import sys
import textwrap

import pytest

from orchestrator.observe.profile_summary import read_trace, summarize
from tests.conftest import REPO

CAPTURE = textwrap.dedent("""
    import json, sys, time
    from workers import runtime
    runtime.configure(platform="cpu", devices_per_host=4)
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("data",))
    rows, same = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())

    @jax.jit
    def step(w, x):
        def loss(w):
            h, _ = jax.lax.scan(lambda h, _: (jnp.tanh(h @ w), None), x, None, length=3)
            return jnp.mean(h ** 2)
        value, grad = jax.value_and_grad(loss)(w)  # the gradient of a mean over rows: an all-reduce
        return w - 0.1 * grad, value

    w = jax.device_put(jnp.eye(64) * 0.5, same)
    x = jax.device_put(jnp.ones((256, 64)), rows)
    w, _ = step(w, x)
    jax.block_until_ready(w)
    jax.profiler.start_trace(sys.argv[1], create_perfetto_trace=True)
    t0 = time.perf_counter()
    for _ in range(3):
        w, value = step(w, x)
    jax.block_until_ready(w)
    wall = (time.perf_counter() - t0) / 3
    jax.profiler.stop_trace()
    print(json.dumps({"wall_per_step_s": wall}))
""")


@pytest.fixture(scope="module")
def capture(tmp_path_factory):
    """A real capture: 3 steps of a small jitted step over 4 CPU devices, traced by jax.profiler."""
    out = tmp_path_factory.mktemp("capture")
    r = subprocess.run([sys.executable, "-c", CAPTURE, str(out)], cwd=REPO, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    traces = [f for f in glob.glob(f"{out}/plugins/profile/*/*.trace.json.gz") if "perfetto" not in f]
    assert len(traces) == 1 and glob.glob(f"{out}/plugins/profile/*/*.xplane.pb")
    return traces[0], json.loads(r.stdout.strip().splitlines()[-1])


def test_a_real_capture(capture):
    path, measured = capture
    trace = read_trace(path)
    s = summarize(trace)
    assert (s.program, s.devices, s.executions) == ("jit_step", 4, 3)
    assert 0 < s.step_time_s <= 1.5 * measured["wall_per_step_s"]
    assert abs(s.compute + s.collectives + s.idle - 1) < 1e-9 and s.compute > 0 and s.collectives > 0
    kinds = {op.name.split(".")[0]: op.kind for op in s.top_ops}
    assert kinds.get("all-reduce") == "collective", s.top_ops
    names = {(e.get("args") or {}).get("hlo_op", "") for e in trace["traceEvents"]}
    assert any(n.startswith("while") for n in names)  # the scan: ops nested in a while, counted once
    assert sum(op.share for op in s.top_ops) <= 1 + 1e-9


def test_the_profile_tooling_reads_the_capture_back(capture):
    """XProf (TensorBoard's profile plugin) reads the .xplane.pb; its trace viewer shows the same steps."""
    raw_to_tool_data = pytest.importorskip("xprof.convert.raw_to_tool_data")
    path, _ = capture
    xplanes = glob.glob(f"{path.rsplit('/', 1)[0]}/*.xplane.pb")
    assert "trace_viewer@" in raw_to_tool_data.xspace_to_tool_names(xplanes)
    data, content_type = raw_to_tool_data.xspace_to_tool_data(xplanes, "trace_viewer", {})
    assert content_type == "application/json"
    s = summarize(json.loads(data))
    assert (s.program, s.devices, s.executions) == ("jit_step", 4, 3)
