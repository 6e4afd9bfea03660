"""Dispatch by backend, the implementation names, and the Pallas path on a sharded mesh."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.pallas import tpu as pltpu

import kernels
from kernels import dispatch


def test_cpu_defaults_to_xla_and_pallas_runs_in_tpu_interpret_mode():
    assert jax.default_backend() == "cpu"
    assert dispatch.resolve(None, valid=("pallas", "xla")) == "xla"
    assert dispatch.resolve(None, valid=("pallas", "xla", "cudnn"), gpu_default="cudnn") == "xla"
    assert dispatch.resolve("pallas", valid=("pallas", "xla")) == "pallas"
    assert isinstance(dispatch.pallas_interpret(), pltpu.InterpretParams)


@pytest.mark.parametrize("op, call", [
    ("rms_norm", lambda impl: kernels.rms_norm(jnp.ones((8, 16)), jnp.ones(16), implementation=impl)),
    ("apply_rope", lambda impl: kernels.apply_rope(jnp.ones((1, 8, 1, 16)), jnp.zeros((1, 8), jnp.int32),
                                                   implementation=impl)),
    ("linear_scan", lambda impl: kernels.linear_scan(jnp.ones((1, 8, 16)), jnp.ones((1, 8, 16)), implementation=impl)),
    ("moe_ffn", lambda impl: kernels.moe_ffn(jnp.ones((8, 16)), jnp.ones((16, 4)), jnp.ones((4, 16, 32)),
                                             jnp.ones((4, 32, 16)), implementation=impl)),
])
def test_unknown_implementation_is_an_error_listing_the_valid_ones(op, call):
    with pytest.raises(ValueError, match=r"Unknown implementation 'mosaic'; valid: 'pallas', 'xla' or None"):
        call("mosaic")


_SHARDED_SCRIPT = textwrap.dedent("""
    import json, jax
    jax.config.update("jax_num_cpu_devices", 4)
    import jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import kernels

    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
    rng = np.random.default_rng(0)
    spec = P("data", None, "model")
    q, k, v = (jax.device_put(jnp.asarray(rng.standard_normal(s).astype(np.float32)), NamedSharding(mesh, spec))
               for s in [(2, 64, 4, 32), (2, 64, 2, 32), (2, 64, 2, 32)])
    attend = kernels.sharded(kernels.attention, mesh, in_specs=(spec,) * 3, out_specs=spec,
                             implementation="pallas", block_sizes=kernels.BlockSizes(32, 32))
    loss = lambda attend: lambda q, k, v: jnp.sum(attend(q, k, v) ** 2)
    out, grads = jax.jit(jax.value_and_grad(loss(attend), argnums=(0, 1, 2)))(q, k, v)
    want, want_grads = jax.jit(jax.value_and_grad(loss(kernels.reference_attention), argnums=(0, 1, 2)))(q, k, v)
    print(json.dumps({
        "error": max(float(jnp.abs(a - b).max()) / float(jnp.abs(b).max())
                     for a, b in zip((out, *grads), (want, *want_grads))),
        "grad_spec": str(grads[1].sharding.spec),
    }))
""")


def test_sharded_pallas_attention_runs_per_shard_on_a_mesh():
    """On a 2 x 2 CPU mesh (a fresh process: the device count is fixed at start-up)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, "-c", _SHARDED_SCRIPT], capture_output=True, text=True, env=env,
                            timeout=300, check=True)
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["error"] < 1e-5
    assert report["grad_spec"] == "P('data', None, 'model')"


def test_the_interpreter_off_tpu_is_chosen_by_the_environment(monkeypatch):
    monkeypatch.delenv(dispatch.INTERPRET_ENV, raising=False)
    assert isinstance(dispatch.pallas_interpret(), pltpu.InterpretParams)
    monkeypatch.setenv(dispatch.INTERPRET_ENV, "generic")
    assert dispatch.pallas_interpret() is True
    monkeypatch.setenv(dispatch.INTERPRET_ENV, "mosaic")
    with pytest.raises(ValueError, match="KERNELS_PALLAS_INTERPRET='mosaic': expected 'tpu' or 'generic'"):
        dispatch.pallas_interpret()
