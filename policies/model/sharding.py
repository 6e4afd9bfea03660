"""The sharding plan: how a model is laid out over a slice's devices.

A pure function of numbers (no JAX): the slice's device and host counts, the model's
shape (`policies.model.shape.ModelShape`), the spec's mesh wishes and the global batch
size. The worker turns the result into a `jax.sharding.Mesh` and `PartitionSpec`s.

Axes:
- ``data``: replicas of the model, each on its own rows of the batch;
- ``fsdp``: also splits the batch rows, and shards parameters along ``d_model``;
- ``model``: tensor parallelism over heads and the feed-forward width.

Devices are laid out host-major, so ``model`` (the innermost axis) stays inside a
host when it fits, and ``data`` spans hosts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from policies.model.shape import ModelShape

AXES = ("data", "fsdp", "model")
BATCH_AXES = ("data", "fsdp")

# How each parameter of the built-in transformer is partitioned, by its role.
# A tuple entry per array dimension: a mesh axis name or None (replicated).
PARAM_RULES: dict[str, tuple[str | None, ...]] = {
    "embed": (None, "fsdp"),  # [vocab, d_model]
    "unembed": ("fsdp", None),  # [d_model, vocab]
    "wq": ("fsdp", "model"),  # [d_model, heads * head_dim]
    "wk": ("fsdp", "model"),  # [d_model, kv_heads * head_dim]
    "wv": ("fsdp", "model"),
    "wo": ("model", "fsdp"),  # [heads * head_dim, d_model]
    "w_up": ("fsdp", "model"),  # [d_model, d_ff]
    "w_down": ("model", "fsdp"),  # [d_ff, d_model]
    "norm": (None,),  # [d_model]
    "router": ("fsdp", None),  # [d_model, experts]
    "moe_in": (None, "fsdp", "model"),  # [experts, d_model, d_ff]
    "moe_out": (None, "model", "fsdp"),  # [experts, d_ff, d_model]
    "scan_in": ("fsdp", "model"),  # [d_model, d_model]
    "scan_out": ("model", "fsdp"),  # [d_model, d_model]
}


class MeshError(ValueError):
    """The numbers do not divide; `field` names the spec field (relative to `workload`)."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(message)


@dataclass(frozen=True)
class MeshPlan:
    data: int
    fsdp: int
    model: int
    num_hosts: int
    global_batch_size: int

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.data, self.fsdp, self.model)

    @property
    def batch_shards(self) -> int:
        return self.data * self.fsdp

    @property
    def rows_per_shard(self) -> int:
        return self.global_batch_size // self.batch_shards


def plan_mesh(*, num_devices: int, num_hosts: int, wishes: dict[str, int], shape: ModelShape | None,
              global_batch_size: int) -> MeshPlan:
    """Resolve the mesh wishes against the slice, or raise MeshError saying what does not divide.

    `shape` None (a user's own model): the model's dimensions are not checked against the axes.
    """
    sizes = {axis: int(wishes.get(axis, 1)) for axis in AXES}
    rest = [axis for axis, n in sizes.items() if n == -1]
    if len(rest) > 1:
        raise MeshError("mesh", f"only one mesh axis may be -1, got {', '.join(rest)}")
    fixed = math.prod(n for n in sizes.values() if n != -1)
    if rest:
        if num_devices % fixed:
            raise MeshError(f"mesh.{rest[0]}", f"the other axes ({fixed} devices) do not divide {num_devices} devices")
        sizes[rest[0]] = num_devices // fixed
    total = math.prod(sizes.values())
    if total != num_devices:
        axes = "x".join(f"{a}={sizes[a]}" for a in AXES)
        raise MeshError("mesh", f"mesh {axes} uses {total} devices, not the slice's {num_devices}")
    if global_batch_size % (sizes["data"] * sizes["fsdp"]):
        raise MeshError("global_batch_size",
                        f"global_batch_size={global_batch_size} is not divisible by data*fsdp="
                        f"{sizes['data'] * sizes['fsdp']}")
    checks = [] if shape is None else [
        ("model", sizes["model"], "n_heads", shape.n_heads),
        ("model", sizes["model"], "n_kv_heads", shape.n_kv_heads),
        ("model", sizes["model"], "d_ff", shape.d_ff),
        ("fsdp", sizes["fsdp"], "d_model", shape.d_model),
    ]
    for axis, n, dim_name, dim in checks:
        if dim % n:
            raise MeshError(f"mesh.{axis}", f"mesh axis {axis}={n} does not divide model.{dim_name}={dim}")
    return MeshPlan(sizes["data"], sizes["fsdp"], sizes["model"], num_hosts, global_batch_size)


def batch_share(global_batch_size: int, slices: int) -> int:
    """The rows of every batch each of `slices` slices trains, or MeshError if the batch does not split
    evenly over them. The one statement of the rule: the spec's checks, the launch, the cost policy's
    slice counts and the survivors of a lost slice all ask it (through `plan_slices`)."""
    if global_batch_size % slices:
        raise MeshError("global_batch_size", f"global_batch_size={global_batch_size} is not divisible by "
                                             f"slices={slices} (each slice trains an equal share of every batch)")
    return global_batch_size // slices


def plan_slices(*, num_devices: int, num_hosts: int, wishes: dict[str, int], shape: ModelShape | None,
                global_batch_size: int | None, slices: int = 1) -> MeshPlan:
    """The mesh of each of `slices` slices (`num_devices` chips on `num_hosts` hosts each) that train
    `global_batch_size` together, or MeshError: the batch splits evenly over the slices (`batch_share`)
    and each slice's share has a mesh on the slice (`plan_mesh`). None: a user program that sets no
    batch, one row a device."""
    batch = num_devices * slices if global_batch_size is None else global_batch_size
    return plan_mesh(num_devices=num_devices, num_hosts=num_hosts, wishes=wishes, shape=shape,
                     global_batch_size=batch_share(batch, slices))
