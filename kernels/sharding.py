"""Running the Pallas paths on sharded arrays: one kernel call per device under ``shard_map``.

XLA's partitioner sees a Pallas kernel as one opaque call: under ``jit`` with sharded
operands it gathers them onto one device and runs the kernel there (the result is
right; the memory and time are not). Every op here is independent along some axes;
shard those, keep the others whole, and run the kernel on each device's shard:

==================  ==============================  ==========================================
op                  shard                           keep whole
==================  ==============================  ==========================================
attention           batch, heads (and kv heads)     sequence, head_dim
rms/layer_norm      leading (token) axes            features; weight and bias replicated
apply_rope          batch, seq, heads               head_dim; positions like x's batch/seq
linear_scan         batch, dim                      time
moe_ffn             tokens                          weights replicated; aux loss and stats
                                                    come out per shard (pmean them inside)
==================  ==============================  ==========================================

The XLA paths (the CPU and GPU defaults) need none of this: plain ``jit`` partitions them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
from jax.sharding import Mesh


def sharded(fn: Callable, mesh: Mesh, *, in_specs, out_specs, **kwargs) -> Callable:
    """``fn(*args, **kwargs)`` run on each device's shard of ``args`` (``jax.shard_map`` over ``mesh``).

    Array operands must be positional (``in_specs`` describes them); ``kwargs`` are the
    static options. Example, attention sharded over batch (``"data"``) and heads
    (``"model"``), with segment ids::

        spec = P("data", None, "model")
        attend = kernels.sharded(
            lambda q, k, v, ids: kernels.attention(q, k, v, segment_ids=ids, implementation="pallas"),
            mesh, in_specs=(spec, spec, spec, P("data")), out_specs=spec)
        out = jax.jit(attend)(q, k, v, segment_ids)

    ``check_vma`` is off because Pallas calls do not declare how their outputs vary over
    the mesh axes; the specs above are what makes the per-shard results correct.
    """
    return jax.shard_map(functools.partial(fn, **kwargs), mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)
