"""Which model shapes the kernels cannot run, found before a job starts.

Every length runs on every path (blocks are fitted and padded, see
`kernels.generations.fit_block`), so what remains are the model's own dimensions:
grouped-query heads that do not divide, an odd ``head_dim`` (RoPE rotates pairs),
``moe_top_k`` outside ``[1, moe_experts]``, and, for the Pallas kernels, rows of
features too wide for the chip's VMEM at the smallest block. With
``implementation=None`` an op that Pallas cannot hold runs on its XLA path instead, so
only an explicit ``"pallas"`` makes VMEM a refusal.

Validation calls `check_shape` with the job's model fields; each problem names the
field, in the job file's terms (``model.n_kv_heads``), and what is wrong with it.
"""

from __future__ import annotations

import dataclasses

from kernels import dispatch, generations, hardware
from kernels.attention import vmem_bytes as attention_vmem_bytes
from kernels.norm import max_rows
from kernels.rope import max_positions


@dataclasses.dataclass(frozen=True)
class ShapeProblem:
    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


class UnsupportedShape(ValueError):
    """A model shape no kernel path can run; ``problems`` lists each one with its field."""

    def __init__(self, problems: list[ShapeProblem]):
        self.problems = problems
        super().__init__("The kernels cannot run this model: " + "; ".join(map(str, problems)))


def shape_problems(
    *,
    d_model: int,
    n_heads: int,
    n_kv_heads: int,
    seq_len: int,
    moe_experts: int = 0,
    moe_top_k: int = 2,
    itemsize: int = 4,
    implementation: str | None = None,
    device_kind: str | None = None,
) -> list[ShapeProblem]:
    """What no path can run for this model, as a list (empty: everything runs).

    Args:
      d_model, n_heads, n_kv_heads, moe_experts, moe_top_k: the model's fields.
      seq_len: tokens per sequence.
      itemsize: bytes per activation element (4 for f32, 2 for bf16).
      implementation: the kernels' implementation the job asks for (None: the backend's default).
      device_kind: the chip the VMEM figures are for (``"TPU v4"``); None: the current
        backend's, the default generation off TPU.
    """
    problems = []
    if seq_len < 1:
        problems.append(ShapeProblem("seq_len", f"must be positive, got {seq_len}"))
    if n_kv_heads < 1 or n_heads % n_kv_heads:
        problems.append(ShapeProblem("model.n_kv_heads", f"{n_kv_heads} does not divide n_heads={n_heads} "
                                     "(each key/value head serves a whole group of query heads)"))
    head_dim = d_model // n_heads if n_heads > 0 else 0
    if head_dim < 1:
        problems.append(ShapeProblem("model.n_heads", f"{n_heads} heads leave no features of d_model={d_model}"))
    elif head_dim % 2:
        problems.append(ShapeProblem("model.d_model", f"head_dim = d_model // n_heads = {d_model} // {n_heads} = "
                                     f"{head_dim} must be even (RoPE rotates pairs of features)"))
    if moe_experts and not 1 <= moe_top_k <= moe_experts:
        problems.append(ShapeProblem("model.moe_top_k", f"{moe_top_k} must be in [1, moe_experts={moe_experts}]"))
    if implementation == dispatch.PALLAS and head_dim >= 1:
        problems += _vmem_problems(d_model, n_heads, head_dim, itemsize, device_kind)
    return problems


def check_shape(**fields) -> None:
    """`shape_problems`, raised: `UnsupportedShape` (a ValueError) naming every field at fault."""
    problems = shape_problems(**fields)
    if problems:
        raise UnsupportedShape(problems)


def _vmem_problems(d_model, n_heads, head_dim, itemsize, device_kind) -> list[ShapeProblem]:
    generation = generations.current() if device_kind is None else generations.from_device_kind(device_kind)
    chip = generation.chip
    problems = []
    if max_rows(d_model, itemsize, chip) < 8:
        problems.append(ShapeProblem("model.d_model", f"rows of {d_model} features do not fit the VMEM of a "
                                     f"{chip.name} 8 at a time (Pallas RMSNorm)"))
    if max_positions(n_heads, head_dim, itemsize, chip) < 8:
        problems.append(ShapeProblem("model.d_model", f"{n_heads} heads x head_dim={head_dim} do not fit the VMEM "
                                     f"of a {chip.name} 8 positions at a time (Pallas RoPE)"))
    smallest_q, smallest_kv = 8, 128
    need = attention_vmem_bytes(smallest_q, smallest_kv, head_dim, itemsize)
    if need > chip.vmem_limit_bytes:
        problems.append(ShapeProblem("model.n_heads", f"head_dim={head_dim} needs {need / hardware.MIB:.0f} MiB "
                                     f"of VMEM at {smallest_q}x{smallest_kv} attention blocks, over the "
                                     f"{chip.vmem_limit_bytes / hardware.MIB:.0f} MiB limit of a "
                                     f"{chip.name} (Pallas attention)"))
    return problems
