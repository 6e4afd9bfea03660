"""The built-in trainer's step compiled by XLA's TPU compiler for every slice the catalog offers a v4 job.

The program is the hosts' own: `orchestrator.control.tpu_compile.compile_step` resolves the
job's settings as a launch does (`launch.launch_order`: mesh, microbatches, precision) and
the workers' trainer lowers its step over the topology's devices. A small model keeps the
suite's time; `benchmarks/tpu_compile.py` compiles the 100M and ~1B models.
"""

from __future__ import annotations

import functools
import pickle

import jax
import pytest

from orchestrator import catalog
from orchestrator.control.launch import launch_order
from orchestrator.control.tpu_compile import compile_step, topology
from orchestrator.domain.spec import JobSpec
from workers.tpu_target import Topology, compile_train_step, serialize

TARGETS = [("v4-16", 1), ("v4-32", 1), ("v4-64", 1), ("v4-16", 2), ("v4-16", 4), ("v4-32", 2)]


def small_job(**workload) -> JobSpec:
    return JobSpec.model_validate({
        "name": "compiled", "accelerator": "v4-16",
        "workload": {"type": "lm", "model": {"d_model": 256, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
                                             "d_ff": 512},
                     "seq_len": 256, "global_batch_size": 64, "steps": 10, "precision": {"compute": "auto"},
                     **workload}})


def compiled_for(spec: JobSpec, accelerator: str, slices: int = 1):
    t = catalog.lookup(accelerator)
    order = launch_order(spec.moved(accelerator, spec.tier, slices=slices), t.chips, t.hosts, slices=slices)
    return compile_train_step(order.program.lm, order.settings, topology(t, slices))


@functools.cache
def small_compiled(accelerator: str, slices: int = 1):
    """`compiled_for(small_job(), ...)` once a session: the tests that read the same program share its compile."""
    return compiled_for(small_job(), accelerator, slices)


@pytest.mark.parametrize("accelerator, slices", TARGETS, ids=[f"{n}x{a}" for a, n in TARGETS])
def test_the_train_step_compiles_for_each_slice(accelerator, slices):
    spec, t = small_job(), catalog.lookup(accelerator)
    _, report = small_compiled(accelerator, slices)

    assert report.chips == t.chips * slices and report.target == topology(t, slices).label
    # Every chip holds the whole state (the mesh is data-parallel at this size): float32 parameters and
    # AdamW's two moments, donated to the step and written back in place.
    state = 12 * spec.workload.model.shape().num_params()
    assert report.argument_bytes >= state and report.alias_bytes >= state
    assert 0 < report.hbm_bytes_per_chip < t.hbm_bytes_per_chip


@pytest.mark.parametrize("microbatches", [1, 2])
def test_the_compiler_s_flops_are_the_mfu_formula_s_and_a_little_more(microbatches):
    spec = small_job(gradient_accumulation=microbatches)
    report = compile_step(spec, catalog.lookup("v4-16"))  # what `--compile` reports: every loop trip counted
    # The program's FLOPs (every layer and microbatch counted) are the formula MFU uses, 6N + 12 L d s a token,
    # and a little more: at 256 tokens attention is one whole block, and flash attention's backward recomputes
    # the scores (18 L d s, not 12, from the kernels' cost estimates).
    tokens = spec.workload.seq_len * spec.workload.global_batch_size
    formula = spec.workload.model.shape().flops_per_token(spec.workload.seq_len) * tokens
    assert 1.0 * formula <= report.flops <= 1.12 * formula, (report.flops / formula)
    assert report.xla_flops_per_chip * report.chips < 0.6 * formula, "XLA's own count sees each loop's body once"


def test_the_step_is_the_hosts_program_bfloat16_with_mosaic_kernels_and_serializable():
    compiled, _ = small_compiled("v4-16", 2)
    text = compiled.as_text()
    assert "bf16" in text, "precision auto computes in bfloat16 on TPU"
    assert text.count("tpu_custom_call") >= 6, "attention, norms and RoPE as Mosaic kernels, forward and backward"
    state_shardings, _batch = compiled.input_shardings[0]
    devices = {d for sharding in jax.tree.leaves(state_shardings) for d in sharding.device_set}
    assert len(devices) == 16 and {d.slice_index for d in devices} == {0, 1}, "both slices' chips"
    blob = serialize(compiled)
    assert len(pickle.loads(blob)[0]) > 100_000  # an executable a host of 2 x v4-16 could load


def test_the_job_s_own_kernel_choice_is_kept():
    compiled, report = compiled_for(small_job(kernels="xla"), "v4-16")
    assert compiled.as_text().count("tpu_custom_call") == 0, "kernels: xla compiles no Mosaic kernel"
    assert report.hbm_bytes_per_chip > 0


def test_an_unknown_layout_is_refused_with_its_reason():
    with pytest.raises(ValueError, match="not a TPU generation"):
        Topology("v3", "2x2", hosts=1)
    with pytest.raises(ValueError, match="do not split over 3 hosts"):
        Topology("v4", "2x2x2", hosts=3)
