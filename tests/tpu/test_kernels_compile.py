"""Every kernel op, forward and backward, compiled by Mosaic (XLA's TPU compiler) for each chip generation.

Nothing runs: the devices are a TPU topology's (`workers.tpu_target`), and the kernels take
their implementation (Pallas, lowered by Mosaic, not interpreted) and their generation's
default blocks and VMEM limit from the mesh compiled for. A kernel the compiler rejects
fails here. The shapes are small, bf16, with a length that no default block divides (1000)
beside a whole one (2048), so the padded and masked paths compile too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import kernels
from kernels import dispatch, generations
from workers.tpu_target import Topology

# One host of each generation: the kernels run per chip (under shard_map on a bigger mesh).
HOSTS = {"v4": Topology("v4", "2x2x1", hosts=1), "v5e": Topology("v5e", "2x2", hosts=1),
         "v5p": Topology("v5p", "2x2x1", hosts=1), "v6e": Topology("v6e", "2x2", hosts=1)}
KINDS = {"v4": "TPU v4", "v5e": "TPU v5 lite", "v5p": "TPU v5", "v6e": "TPU v6 lite"}
GENERATIONS = list(HOSTS)
BF16 = jnp.bfloat16


def one_chip(generation: str) -> Mesh:
    return Mesh(np.array(HOSTS[generation].devices()[:1]).reshape(1), ("chip",))


def abstract(mesh: Mesh, shape, dtype=BF16) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P()))


def mosaic_kernels(mesh: Mesh, fn, *args) -> int:
    """Compile ``fn`` for ``mesh``'s chip; the number of Mosaic kernels in the program."""
    with jax.set_mesh(mesh):
        compiled = jax.jit(fn).lower(*args).compile()
    return compiled.as_text().count("tpu_custom_call")


def loss_grad(op, argnums):
    """The gradient of the sum of ``op``'s output (its first, where it returns several), in f32."""
    def total(*args):
        out = op(*args)
        out = out[0] if isinstance(out, tuple) else out
        return jnp.sum(out.astype(jnp.float32))
    return jax.grad(total, argnums=argnums)


@pytest.mark.parametrize("generation", GENERATIONS)
def test_the_kernels_read_their_target_from_the_mesh(generation):
    mesh = one_chip(generation)
    seen = {}

    def probe(x):
        seen["target"], seen["generation"] = dispatch.target(), generations.current().chip.name
        seen["implementation"] = dispatch.resolve(None, valid=(dispatch.PALLAS, dispatch.XLA))
        seen["interpret"] = dispatch.pallas_interpret()
        return x

    with jax.set_mesh(mesh):
        jax.jit(probe).lower(abstract(mesh, (8, 128)))
    assert seen == {"target": dispatch.Target("tpu", KINDS[generation]), "generation": generation,
                    "implementation": "pallas", "interpret": False}
    assert dispatch.target().platform == "cpu", "outside the mesh, this machine's own backend"


@pytest.mark.parametrize("seq", [1000, 2048])
@pytest.mark.parametrize("generation", GENERATIONS)
def test_attention_causal_gqa_segments_and_window(generation, seq):
    mesh = one_chip(generation)
    q, kv = abstract(mesh, (1, seq, 4, 128)), abstract(mesh, (1, seq, 2, 128))  # 4 query heads on 2 kv heads
    ids = abstract(mesh, (1, seq), jnp.int32)
    causal = loss_grad(lambda q, k, v, ids: kernels.attention(q, k, v, causal=True, segment_ids=ids,
                                                              implementation="pallas"), (0, 1, 2))
    window = loss_grad(lambda q, k, v: kernels.attention(q, k, v, causal=True, window=256,
                                                         implementation="pallas"), (0, 1, 2))
    both_ways = loss_grad(lambda q, k, v: kernels.attention(q, k, v, causal=False, window=128,
                                                            implementation="pallas"), (0, 1, 2))
    # Forward, dQ and dK/dV: three kernels each.
    assert mosaic_kernels(mesh, causal, q, kv, kv, ids) == 3
    assert mosaic_kernels(mesh, window, q, kv, kv) == 3
    assert mosaic_kernels(mesh, both_ways, q, kv, kv) == 3


@pytest.mark.parametrize("generation", GENERATIONS)
def test_norms_rope_and_scan(generation):
    mesh = one_chip(generation)
    x, w = abstract(mesh, (1000, 512)), abstract(mesh, (512,))
    heads, positions = abstract(mesh, (2, 1000, 4, 128)), abstract(mesh, (2, 1000), jnp.int32)
    a = abstract(mesh, (2, 1000, 512), jnp.float32)
    rms = loss_grad(lambda x, w: kernels.rms_norm(x, w, implementation="pallas"), (0, 1))
    layer = loss_grad(lambda x, w, b: kernels.layer_norm(x, w, b, implementation="pallas"), (0, 1, 2))
    rope = loss_grad(lambda x, p: kernels.apply_rope(x, p, implementation="pallas"), 0)
    scan = loss_grad(lambda a, b: kernels.linear_scan(a, b, implementation="pallas"), (0, 1))
    assert mosaic_kernels(mesh, rms, x, w) == 2  # forward and backward
    assert mosaic_kernels(mesh, layer, x, w, w) == 2
    assert mosaic_kernels(mesh, rope, heads, positions) >= 1  # the backward is the same rotation, reversed
    assert mosaic_kernels(mesh, scan, a, a) == 2


@pytest.mark.parametrize("generation", GENERATIONS)
def test_moe_and_its_grouped_matmul(generation):
    mesh = one_chip(generation)
    tokens, router = abstract(mesh, (1000, 512)), abstract(mesh, (512, 8))
    w_in, w_out = abstract(mesh, (8, 512, 1024)), abstract(mesh, (8, 1024, 512))
    moe = loss_grad(lambda x, r, wi, wo: kernels.moe_ffn(x, r, wi, wo, top_k=2, implementation="pallas"),
                    (0, 1, 2, 3))
    # Two grouped matmuls forward; each one's backward is two more (the input's and the weights' gradients).
    assert mosaic_kernels(mesh, moe, tokens, router, w_in, w_out) == 6
