"""The model's shape counts the parameters the built model really has, and its training FLOPs.

The parameter trees come from `workers.model.init_params` itself, traced with
`jax.eval_shape`: the real structure and shapes, without starting a JAX backend in the
test process.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import pytest

from orchestrator.domain.options import DEFAULT_FLOPS_PER_TOKEN
from orchestrator.domain.spec import ModelConfig
from policies.model.shape import ModelShape, training_flops_per_token
from workers.model import init_params

DENSE = ModelShape(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96, vocab_size=256)
MOE_SCAN = ModelShape(d_model=64, n_layers=3, n_heads=4, n_kv_heads=4, d_ff=80, vocab_size=256,
                      moe_experts=4, moe_top_k=2, scan_layer=True)
SHAPES = {
    "dense": DENSE,
    "moe+scan": MOE_SCAN,
    "moe": ModelShape(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=48, vocab_size=100,
                      moe_experts=8, moe_top_k=1),
    "scan": ModelShape(d_model=32, n_layers=2, n_heads=2, n_kv_heads=2, d_ff=64, vocab_size=256, scan_layer=True),
}
EXPERT_WEIGHTS = ("w_in", "w_out")  # [layers, experts, ...]: a token goes through top_k of them


def built_sizes(shape: ModelShape) -> dict[str, int]:
    """Elements of each leaf of the model `workers.model` builds, by its path."""
    tree = jax.eval_shape(lambda key: init_params(key, shape), jax.ShapeDtypeStruct((2,), jnp.uint32))
    return {jax.tree_util.keystr(path): math.prod(leaf.shape)
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


@pytest.mark.parametrize("name", SHAPES)
def test_num_params_is_the_built_models_parameter_count(name):
    shape = SHAPES[name]
    assert shape.num_params() == sum(built_sizes(shape).values())


@pytest.mark.parametrize("name", SHAPES)
def test_active_params_count_top_k_experts_of_the_built_model(name):
    shape = SHAPES[name]
    share = shape.moe_top_k / shape.moe_experts if shape.moe_experts else 1.0
    sizes = built_sizes(shape)
    active = sum(n * share if any(f"'{w}'" in path for w in EXPERT_WEIGHTS) else n for path, n in sizes.items())
    assert shape.active_params() == active
    assert (shape.active_params() < shape.num_params()) == (shape.moe_experts > shape.moe_top_k)


def test_flops_per_token_of_a_dense_model_is_6n_plus_attention():
    seq = 512
    assert DENSE.flops_per_token(seq) == 6 * DENSE.num_params() + 12 * DENSE.n_layers * DENSE.d_model * seq


def test_flops_per_token_counts_active_experts_and_the_scan_layer():
    seq, s = 1024, MOE_SCAN
    attention = 12 * s.n_layers * s.d_model * seq
    scan = 6 * s.n_layers * s.d_model
    assert s.flops_per_token(seq) == 6 * s.active_params() + attention + scan
    assert s.flops_per_token(seq) < 6 * s.num_params() + attention  # not every expert runs for every token


def test_planning_default_is_the_1b_dense_figure():
    assert DEFAULT_FLOPS_PER_TOKEN == 6 * 1.0e9 + 12 * 24 * 2048 * 2048
    assert DEFAULT_FLOPS_PER_TOKEN == training_flops_per_token(active_params=1.0e9, n_layers=24, d_model=2048,
                                                               seq_len=2048)


def test_the_job_files_model_config_gives_its_shape():
    config = ModelConfig(d_model=64, n_layers=3, n_heads=4, d_ff=80, vocab_size=256, moe_experts=4, moe_top_k=2,
                         scan_layer=True)
    assert config.shape() == MOE_SCAN  # n_kv_heads left out: as many as n_heads
    assert ModelConfig(n_heads=4, n_kv_heads=2).shape().n_kv_heads == 2
