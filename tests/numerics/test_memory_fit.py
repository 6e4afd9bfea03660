"""The memory-fit estimate against the program JAX builds for the real loss."""

from __future__ import annotations

import contextlib
import io
import math
import re

import jax
import pytest
from jax.ad_checkpoint import print_saved_residuals

from policies.model.memory_fit import TrainingJob, estimate
from policies.model.sharding import MeshPlan
from tests.unit.test_memory_fit import DENSE
from workers.model import init_params, loss_fn


def test_activations_match_what_the_models_program_saves():
    """The activations kept without remat against the residuals JAX keeps for the backward pass of the real
    loss (float32, XLA kernels, on this CPU: no lane padding), as `print_saved_residuals` lists them: within
    15%. (The block the backward pass works on is not a residual.)"""
    shape, batch, seq = DENSE, 4, 32
    params = init_params(jax.random.key(0), shape)
    tokens = jax.numpy.zeros((batch, seq + 1), jax.numpy.int32)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(lambda p: loss_fn(p, tokens, shape, implementation="xla"), params)
    saved = 0
    for line in out.getvalue().splitlines():
        if "from the argument" in line:
            continue  # the parameters themselves, counted as model state
        dtype, dims = re.match(r"(\w+)\[([\d,]*)\]", line).groups()
        saved += math.prod(int(n) for n in dims.split(",") if n) * {"f32": 4, "i32": 4, "bool": 1}[dtype]
    e = estimate(TrainingJob(shape, seq, batch, compute_dtype="float32", lanes=1), MeshPlan(1, 1, 1, 1, batch))
    assert e.activations - e.block + e.logits == pytest.approx(saved, rel=0.15)
