"""Per-generation settings reach the Pallas calls; block settings from plain data; shapes no path can run."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import kernels
from kernels import BlockSizes, KernelBlocks, NormBlockSizes, generations, hardware
from kernels.attention import vmem_bytes


def _pallas_calls(fn, *args) -> list:
    """The ``pallas_call`` equations of ``fn``'s jaxpr (traced only, nothing runs)."""
    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                yield eqn
            for param in eqn.params.values():
                inner = getattr(param, "jaxpr", None)
                if inner is not None:
                    yield from walk(getattr(inner, "jaxpr", inner))

    return list(walk(jax.make_jaxpr(fn)(*args).jaxpr))


@pytest.mark.parametrize("device_kind, name", [
    ("TPU v4", "v4"), ("TPU v5 lite", "v5e"), ("TPU v5p", "v5p"), ("TPU v6 lite", "v6e"), ("TPU v99", "v4"),
    ("cpu", "v4"),
])
def test_generation_from_device_kind(device_kind, name):
    assert generations.from_device_kind(device_kind).chip.name == name


def test_every_generation_is_one_of_the_hardware_table_s_chips():
    assert {name: g.chip for name, g in generations.GENERATIONS.items()} == hardware.CHIPS
    assert all(g.chip is hardware.CHIPS[name] for name, g in generations.GENERATIONS.items())


def test_off_tpu_the_default_generation_is_used():
    assert generations.current().chip.name == generations.DEFAULT


def test_defaults_are_at_least_512_for_attention_and_fit_vmem():
    for generation in generations.GENERATIONS.values():
        assert min(generation.attention[:2]) >= 512, generation.chip.name
        assert generation.chip.vmem_limit_bytes <= generation.chip.vmem_bytes
        block_q, block_kv, block_q_bwd, block_kv_bwd = generation.attention
        for pair in ((block_q, block_kv), (block_q_bwd, block_kv_bwd)):  # bf16, head_dim 128: as set, not shrunk
            assert vmem_bytes(*pair, 128, 2) <= generation.chip.vmem_limit_bytes, (generation.chip.name, pair)


@pytest.mark.parametrize("name", ["v4", "v6e"])
def test_the_generation_sets_the_vmem_limit_and_blocks_of_every_attention_call(monkeypatch, name):
    generation = generations.GENERATIONS[name]
    monkeypatch.setattr(generations, "current", lambda: generation)
    q = jnp.zeros((1, 2048, 1, 128), jnp.bfloat16)
    loss = jax.grad(lambda q, k, v: kernels.attention(q, k, v, implementation="pallas").astype(jnp.float32).sum(),
                    argnums=(0, 1, 2))
    calls = _pallas_calls(loss, q, q, q)
    assert len(calls) == 3  # forward, dQ, dK/dV
    assert {c.params["compiler_params"].vmem_limit_bytes for c in calls} == {generation.chip.vmem_limit_bytes}
    block_q, block_kv, block_q_bwd, block_kv_bwd = generation.attention
    forward, dq, dkv = (c.params["grid_mapping"].grid for c in calls)
    assert forward[2] == 2048 // block_q  # query blocks
    assert dq[2] == 2048 // block_q_bwd
    assert dkv[2] == 2048 // block_kv_bwd  # key blocks


def test_wide_heads_shrink_the_blocks_to_fit_vmem():
    tiling = BlockSizes(512, 512).tiling(4096, 4096, head_dim=4096, itemsize=2)
    assert tiling.block_q < 512 and tiling.block_kv < 512
    assert vmem_bytes(tiling.block_q, tiling.block_kv, 4096, 2) <= generations.current().chip.vmem_limit_bytes


def test_kernel_blocks_from_plain_data():
    blocks = KernelBlocks.from_mapping({"attention": {"block_q": 1024, "block_kv_bwd": 256},
                                        "norm": {"block_rows": 512}})
    assert blocks.attention == BlockSizes(block_q=1024, block_kv=512, block_kv_bwd=256)
    assert blocks.norm == NormBlockSizes(512)
    assert blocks.rope is None and KernelBlocks.from_mapping(None) == KernelBlocks()


@pytest.mark.parametrize("mapping, message", [
    ({"attn": {}}, "kernel_blocks.attn: unknown op; valid: attention, norm"),
    ({"attention": {"block_x": 8}}, "kernel_blocks.attention.block_x: unknown block size; valid: block_q"),
    ({"attention": {"block_q": 100}}, "kernel_blocks.attention: block_q=100 must be a multiple of 8"),
    ({"norm": 512}, "kernel_blocks.norm: expected a mapping"),
])
def test_kernel_blocks_name_the_bad_entry(mapping, message):
    with pytest.raises(ValueError, match=message):
        KernelBlocks.from_mapping(mapping)


def test_check_shape_names_each_field_at_fault():
    with pytest.raises(kernels.UnsupportedShape) as caught:
        kernels.check_shape(d_model=99, n_heads=3, n_kv_heads=2, seq_len=128, moe_experts=4, moe_top_k=5)
    assert [p.field for p in caught.value.problems] == ["model.n_kv_heads", "model.d_model", "model.moe_top_k"]
    assert "head_dim = d_model // n_heads = 99 // 3 = 33 must be even" in str(caught.value)
    assert isinstance(caught.value, ValueError)


def test_check_shape_accepts_what_runs_and_refuses_vmem_overflow_only_for_pallas():
    model = {"d_model": 8192, "n_heads": 64, "n_kv_heads": 8, "seq_len": 200, "itemsize": 2}
    for implementation in (None, "pallas", "xla"):
        kernels.check_shape(**model, implementation=implementation)
    wide = {"d_model": 65536, "n_heads": 1, "n_kv_heads": 1, "seq_len": 200}
    kernels.check_shape(**wide)  # the default falls back to XLA where Pallas cannot hold it
    problems = kernels.shape_problems(**wide, implementation="pallas", device_kind="TPU v4")
    assert {p.field for p in problems} == {"model.d_model", "model.n_heads"}
    assert any("over the 16 MiB limit of a v4" in p.message for p in problems)


def test_explicit_pallas_refuses_what_vmem_cannot_hold():
    x = jnp.zeros((8, 65536))
    with pytest.raises(ValueError, match="d=65536 features .* do not fit the VMEM"):
        kernels.rms_norm(x, jnp.ones(65536), implementation="pallas")
    q = jnp.zeros((1, 16, 1, 65536))
    with pytest.raises(ValueError, match="Pallas attention cannot run head_dim=65536"):
        kernels.attention(q, q, q, implementation="pallas")
