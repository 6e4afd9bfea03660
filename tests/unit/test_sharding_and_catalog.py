"""The sharding plan (pure numbers) and the TPU catalog."""

from __future__ import annotations

import dataclasses

import pytest

from kernels import hardware
from orchestrator import catalog
from orchestrator.errors import UnknownAcceleratorError
from policies.model.shape import ModelShape
from policies.model.sharding import MeshError, plan_mesh, plan_slices

SHAPE = ModelShape(d_model=128, n_layers=2, n_heads=4, n_kv_heads=4, d_ff=512, vocab_size=256)


@pytest.mark.parametrize("name,chips,hosts,per_host", [
    ("v4-8", 4, 1, 4), ("v4-16", 8, 2, 4), ("v4-32", 16, 4, 4), ("v4-64", 32, 8, 4),
    ("v5litepod-16", 16, 4, 4), ("v5p-32", 16, 4, 4), ("v6e-8", 8, 1, 8)])
def test_catalog_counts(name, chips, hosts, per_host):
    t = catalog.lookup(name)
    assert (t.chips, t.hosts, t.chips_per_host) == (chips, hosts, per_host)


def test_catalog_prices_and_unknown_names():
    v4 = catalog.lookup("v4-32")
    assert v4.usd_per_hour("spot") == pytest.approx(16 * 0.92)
    assert v4.usd_per_hour("on-demand") == pytest.approx(16 * 3.22)
    with pytest.raises(UnknownAcceleratorError, match="valid types are: v4-8, v4-16"):
        catalog.lookup("v4-33")
    assert [t.name for t in catalog.same_generation(v4)] == ["v4-8", "v4-16", "v4-32", "v4-64", "v4-128"]


def test_the_catalog_reads_its_hardware_from_the_kernels_table():
    """One table of chip facts: a second copy in the catalog would drift from the kernels' (VMEM, blocks)."""
    generations = {t.generation for t in catalog.CATALOG.values()}
    assert all(g.chip is hardware.CHIPS[g.chip.name] for g in generations)
    assert {g.chip.name for g in generations} == set(hardware.CHIPS)
    copied = [f.name for f in dataclasses.fields(catalog.Generation)
              if any(word in f.name for word in ("hbm", "flops", "vmem", "gbps", "device_kind"))]
    assert copied == [], "hardware facts belong in kernels.hardware, read through Generation.chip"
    v5p = catalog.lookup("v5p-8")
    assert (v5p.hbm_bytes_per_chip, v5p.peak_bf16_flops_per_chip) == (hardware.V5P.hbm_bytes, 459e12)


@pytest.mark.parametrize("t", catalog.CATALOG.values(), ids=lambda t: t.name)
def test_the_number_in_a_type_name_counts_tensorcores_or_chips(t):
    per_chip = t.generation.chip.tensorcores if t.generation.counts_tensorcores else 1
    assert int(t.name.rsplit("-", 1)[1]) == t.chips * per_chip


def test_rest_axis_takes_the_remaining_devices():
    plan = plan_mesh(num_devices=16, num_hosts=4, wishes={"data": -1, "fsdp": 2, "model": 2}, shape=SHAPE,
                     global_batch_size=16)
    assert plan.shape == (4, 2, 2) and plan.batch_shards == 8 and plan.rows_per_shard == 2


@pytest.mark.parametrize("wishes,batch,field", [
    ({"data": 3}, 12, "mesh"),
    ({"data": -1, "model": 3}, 12, "mesh.data"),
    ({"data": -1, "fsdp": -1}, 16, "mesh"),
    ({"data": -1}, 6, "global_batch_size"),
    ({"data": 1, "fsdp": 1, "model": 8}, 8, "mesh.model"),
])
def test_what_does_not_divide_is_named(wishes, batch, field):
    with pytest.raises(MeshError) as info:
        plan_mesh(num_devices=8, num_hosts=2, wishes=wishes, shape=SHAPE, global_batch_size=batch)
    assert info.value.field == field


def test_several_slices_split_the_batch_evenly_and_each_share_needs_a_mesh():
    # The one rule the spec, the launch, the policy's slice counts and a lost slice's survivors use.
    two = plan_slices(num_devices=8, num_hosts=2, wishes={"data": -1}, shape=None, global_batch_size=32, slices=2)
    assert (two.data, two.global_batch_size) == (8, 16)  # each slice trains 16 of the 32 rows
    with pytest.raises(MeshError, match="not divisible by slices=3") as split:
        plan_slices(num_devices=8, num_hosts=2, wishes={"data": -1}, shape=None, global_batch_size=32, slices=3)
    assert split.value.field == "global_batch_size"
    with pytest.raises(MeshError, match="data\\*fsdp=8"):  # 8 rows a slice split, but not over 8 devices' data axis
        plan_slices(num_devices=8, num_hosts=2, wishes={"data": -1}, shape=None, global_batch_size=8, slices=2)
    # A user program that sets no batch: a row a device on every slice.
    assert plan_slices(num_devices=8, num_hosts=2, wishes={"data": -1}, shape=None, global_batch_size=None,
                       slices=3).global_batch_size == 8
