"""One `TrainingSettings`, resolved once per launch, reaches the hosts' programs typed.

Each test reads every field of `workers.settings.TrainingSettings` at both ends (what
`orchestrator.control.launch` resolves from a job spec, and what the program's context on a
host reads), so a setting added to that one record is covered here without a change.
"""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from orchestrator import JobSpec
from orchestrator.control.autoscaler import Choice, with_checkpoint_interval
from orchestrator.control.launch import launch_order
from workers import api
from workers.order import BuiltInTrainer, LaunchOrder
from workers.settings import LmSettings, TrainingSettings

SETTINGS = [f.name for f in dataclasses.fields(TrainingSettings)]

# A job whose every setting differs from `TrainingSettings`' defaults, on both workloads.
COMMON = {"steps": 12, "seq_len": 64, "global_batch_size": 32, "seed": 7, "data": {"path": "/data/tokens"},
          "mesh": {"fsdp": 2}, "precision": {"compute": "bfloat16"}, "remat": "full", "gradient_accumulation": 2,
          "kernel_blocks": {"attention": {"block_q": 256}}}
WORKLOADS = {"lm": {"type": "lm", **COMMON},
             "entrypoint": {"type": "entrypoint", "entrypoint": "train:main", **COMMON}}


def spec(kind: str) -> JobSpec:
    return JobSpec.from_dict({"name": "a", "accelerator": "v4-16", "slices": 2, "workload": WORKLOADS[kind],
                              "checkpoint": {"directory": "/ckpt/a", "interval_steps": 5, "keep": 2,
                                             "memory_interval_steps": 3}})


def on_a_host(order: LaunchOrder) -> api.Context:
    """The context a host's program gets: the launch order as Ray carries it (pickled), then the host's context."""
    carried = pickle.loads(pickle.dumps(order))
    return api.Context(rank=1, num_hosts=2, settings=carried.settings)


@pytest.mark.parametrize("kind", WORKLOADS)
def test_every_setting_is_resolved_by_the_launch_and_read_typed_on_the_host(kind):
    s = spec(kind)
    launch = {"slices": s.slices, "memory_step": 8}  # the survivors of a lost slice, from their memory
    resolved = launch_order(s, s.tpu_type.chips, s.tpu_type.hosts, **launch).settings
    ctx = on_a_host(launch_order(s, s.tpu_type.chips, s.tpu_type.hosts, **launch))
    assert type(ctx.settings) is TrainingSettings and ctx.settings == resolved
    for name in SETTINGS:
        default = TrainingSettings.__dataclass_fields__[name].default
        assert getattr(resolved, name) != default, f"the launch leaves {name} at its default"
        assert getattr(ctx, name) == getattr(resolved, name), name  # the name programs read
        assert type(getattr(ctx, name)) is type(getattr(resolved, name)), name


def test_the_launch_resolves_what_the_spec_says():
    s = spec("entrypoint")
    got = launch_order(s, 8, 2).settings
    assert (got.steps, got.seq_len, got.global_batch_size, got.seed, got.data) == (12, 64, 32, 7, "/data/tokens")
    assert (got.mesh_shape, got.microbatches, got.precision, got.remat) == ((4, 2, 1), 2, "bfloat16", "full")
    assert (got.checkpoint_dir, got.checkpoint_interval, got.checkpoint_keep) == ("/ckpt/a", 5, 2)
    assert got.kernel_blocks == {"attention": {"block_q": 256}}
    assert got.peak_flops_per_chip == s.tpu_type.peak_bf16_flops_per_chip


def test_the_built_in_trainer_gets_its_own_settings_beside_the_shared_ones():
    s = spec("lm")
    program = pickle.loads(pickle.dumps(launch_order(s, s.tpu_type.chips, s.tpu_type.hosts))).program
    assert type(program) is BuiltInTrainer
    lm = program.lm
    assert type(lm) is LmSettings and lm.model == s.workload.model.shape()
    assert (lm.lr_peak, lm.warmup_steps) == (s.workload.learning_rate.peak, s.workload.learning_rate.warmup_steps)


def test_the_policy_s_checkpoint_interval_reaches_the_loop_in_steps():
    s = spec("lm")
    launched = with_checkpoint_interval(s, Choice("v4-16", "spot", decision=None, checkpoint_interval_steps=3))
    ctx = on_a_host(launch_order(launched, launched.tpu_type.chips, launched.tpu_type.hosts))
    assert ctx.settings.checkpoint_interval == 3 and s.checkpoint.interval_steps == 5


def test_each_setting_is_declared_once():
    assert not set(SETTINGS) & {f.name for f in dataclasses.fields(api.Context)}
    assert not set(SETTINGS) & set(vars(api.Context))  # no property of the same name either
    assert not set(SETTINGS) & {f.name for f in dataclasses.fields(LmSettings)}
    defaults = JobSpec.from_dict({"name": "a"}).checkpoint
    assert (defaults.interval_steps, defaults.keep) == (TrainingSettings().checkpoint_interval,
                                                        TrainingSettings().checkpoint_keep)


def test_a_plain_process_context_takes_settings_and_hooks_by_name():
    sent: list = []
    ctx = api.local_context(steps=30, seq_len=128, global_batch_size=16, send=sent.append)
    assert ctx.settings == TrainingSettings(steps=30, seq_len=128, global_batch_size=16)
    assert (ctx.steps, ctx.send) == (30, sent.append)
    with pytest.raises(AttributeError, match="no attribute 'stpes'"):
        _ = ctx.stpes


def test_the_microbatch_count_is_for_each_slice_s_share_of_the_batch():
    """The ~1B job picks 16 microbatches on one v4-16; on 4 of them each slice trains a quarter of the batch,
    and 16 microbatches of its 64 rows did not divide over its 8 batch shards (the TPU compiler refused it)."""
    from orchestrator import catalog
    from orchestrator.control.launch import training_settings
    from orchestrator.domain.spec import JobSpec
    from tests.conftest import REPO

    spec = JobSpec.from_yaml(REPO / "examples" / "plan-1b.yaml")
    t = catalog.lookup("v4-16")
    counts = {}
    for slices in (1, 2, 4):
        s = training_settings(spec.moved("v4-16", "spot", slices=slices), t.chips, t.hosts, slices=slices)
        data, fsdp, _ = s.mesh_shape
        rows_per_shard = s.global_batch_size // (data * fsdp)
        assert rows_per_shard % s.microbatches == 0, (slices, s.microbatches, rows_per_shard)
        counts[slices] = s.microbatches
    assert counts == {1: 16, 2: 8, 4: 4}
