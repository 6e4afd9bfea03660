"""Compiled priors: the TPU compiler's roofline, calibrated, as the cost policy's speed before a job measured it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from orchestrator import catalog
from orchestrator.control.autoscaler import snapshot
from orchestrator.control.launch import launch_order
from orchestrator.control.priors import kept_steps
from orchestrator.control.tpu_compile import topology
from orchestrator.domain.options import job_options
from orchestrator.state.store import Store
from policies.cost.compiled_prior import (
    COMPILED,
    MEASURED,
    PUBLISHED_SHARE,
    SCALING_MODEL,
    CompiledStep,
    priced,
)
from policies.cost.slice_options import MultiSlice, multi_slice_options
from tests.unit.test_autoscaler import STEP_S, T0, _job

TOKENS = 512 * 2048


def _options(max_count: int = 1):
    singles = job_options(["v4-16", "v4-32", "v4-64"], ["spot", "on-demand"])
    return multi_slice_options(singles, MultiSlice(1e9, TOKENS), max_count)


def _speed(options, what: str) -> float:
    return next(o.tokens_per_s for o in options if o.what == what and o.tier == "spot")


def test_a_compiled_step_is_priced_at_the_published_share_of_its_roofline_and_the_rest_by_the_scaling_model():
    options = _options()
    compiled = {"v4-32": CompiledStep(TOKENS, roofline_s=1.0)}
    found = priced(options, compiled)
    assert _speed(found.options, "v4-32") == pytest.approx(PUBLISHED_SHARE * TOKENS)
    assert found.priors == {"v4-16": SCALING_MODEL, "v4-32": COMPILED, "v4-64": SCALING_MODEL}
    assert found.calibrations["v4-32"].source == "published"
    for what in ("v4-16", "v4-64"):  # no report: the price they came with
        assert _speed(found.options, what) == _speed(options, what)
    assert {o.tier for o in found.options if o.what == "v4-32"} == {"spot", "on-demand"}  # both tiers, one program


def test_measured_speed_wins_over_the_compiled_prior():
    compiled = {"v4-16": CompiledStep(TOKENS, 2.0), "v4-32": CompiledStep(TOKENS, 1.0)}
    found = priced(_options(), compiled, {"v4-32": 123_000.0})
    assert _speed(found.options, "v4-32") == 123_000.0
    assert found.priors["v4-32"] == MEASURED and "v4-32" not in found.calibrations


def test_a_measured_option_calibrates_the_share_for_the_others_nearest_in_chips_first():
    """The job got 0.3 of its bound on a v4-16 and 0.4 on a v4-64: a v4-32 (16 chips, as near to 8 as
    to 32) takes the smaller-named tie, v4-16's 0.3; neither is the published share."""
    compiled = {"v4-16": CompiledStep(TOKENS, 4.0), "v4-32": CompiledStep(TOKENS, 2.0),
                "v4-64": CompiledStep(TOKENS, 1.0)}
    measured = {"v4-16": 0.3 * TOKENS / 4.0}
    found = priced(_options(), compiled, measured)
    assert _speed(found.options, "v4-32") == pytest.approx(0.3 * TOKENS / 2.0)
    assert _speed(found.options, "v4-64") == pytest.approx(0.3 * TOKENS / 1.0)
    assert found.calibrations["v4-64"].source == "measured on v4-16"

    measured["v4-64"] = 0.4 * TOKENS
    found = priced(_options(), compiled, measured)
    assert found.calibrations["v4-32"].source == "measured on v4-16"
    assert _speed(found.options, "v4-32") == pytest.approx(0.3 * TOKENS / 2.0)


def test_several_slices_keep_the_dcn_efficiency_the_roofline_does_not_count():
    options = _options(max_count=2)
    one, two = (next(o for o in options if o.what == w and o.tier == "spot") for w in ("v4-16", "2xv4-16"))
    dcn = two.tokens_per_s / (2 * one.tokens_per_s)
    # an all-reduce that no longer hides: 0.5 x the efficiency, on both tiers (one program)
    options = tuple(replace(o, tokens_per_s=o.tokens_per_s * 0.5) if o.what == "2xv4-16" else o for o in options)
    found = priced(options, {"2xv4-16": CompiledStep(TOKENS, 1.0)})
    assert _speed(found.options, "2xv4-16") == pytest.approx(PUBLISHED_SHARE * TOKENS * dcn * 0.5)


def test_measured_only_where_nothing_was_compiled_keeps_the_scaling_model_everywhere():
    """The job's own speed (scaled by the model) beats a published share it could not be calibrated to."""
    options = _options()
    found = priced(options, {"v4-32": CompiledStep(TOKENS, 1.0)}, {"v4-16": 50_000.0})
    assert _speed(found.options, "v4-32") == _speed(options, "v4-32")
    assert found.priors == {"v4-16": MEASURED, "v4-32": SCALING_MODEL, "v4-64": SCALING_MODEL}


# -- the controller: reports kept by `orchestrator --compile`, read as priors --------------------


def _keep(spec, cache, name: str, roofline_s: float, *, checkpoint_dir_known: bool = True) -> None:
    """A report of `spec`'s step on one `name`, kept as the CLI keeps it, whose roofline is `roofline_s`."""
    from workers.tpu_target import ProgramReport, keep_report, program_key

    t = catalog.lookup(name)
    order = launch_order(spec.moved(name, spec.tier, slices=1), t.chips, t.hosts)
    settings = order.settings if checkpoint_dir_known else replace(order.settings, checkpoint_dir=None)
    flops = roofline_s * t.generation.chip.peak_bf16_tflops * 1e12  # compute-bound: the roofline is its FLOPs
    report = ProgramReport(target=name, compile_s=1.0, argument_bytes=0, output_bytes=0, alias_bytes=0,
                           temp_bytes=0, code_bytes=0, flops_per_chip=flops, bytes_accessed_per_chip=0.0,
                           xla_flops_per_chip=flops, optimal_s=None, chips=t.chips)
    keep_report(cache, program_key(order.program.lm, settings, topology(t)), report)


def test_the_controller_prices_an_unmeasured_option_from_kept_reports_calibrated_on_the_measured_one(
        tmp_path, monkeypatch):
    """The job ran 10 steps of 512 tokens on a v4-16 at 2 s (256 tokens/s), whose kept report says 0.1 s:
    a share of 0.05. The v4-32's report (0.04 s, kept by a job file that left the checkpoint folder out)
    prices it at 0.05 x 512 / 0.04 = 640 tokens/s, 2.5 x the v4-16, where the scaling model says 1.88 x."""
    monkeypatch.setenv("ORCHESTRATOR_HOME", str(tmp_path / "home"))
    cache = tmp_path / "home" / "tpu-programs"
    store = Store(tmp_path / "db.sqlite")
    job_id = _job(store, 0, saves=[])
    spec = store.job(job_id).spec
    before = {o.label: o.tokens_per_s for o in snapshot(store, job_id, now=T0 + 200, current=None).options}
    _keep(spec, cache, "v4-16", 0.1)
    _keep(spec, cache, "v4-32", 0.04, checkpoint_dir_known=False)
    assert set(kept_steps(spec, job_options(["v4-16", "v4-32"], ["spot"]))) == {"v4-16", "v4-32"}

    options = {o.label: o.tokens_per_s for o in snapshot(store, job_id, now=T0 + 200, current=None).options}
    assert options["v4-16 spot"] == pytest.approx(512 / STEP_S) == before["v4-16 spot"]  # measured
    assert options["v4-32 on-demand"] == options["v4-32 spot"] == pytest.approx(0.05 * 512 / 0.04)
    assert before["v4-32 spot"] == pytest.approx(1.88 * 512 / STEP_S, rel=0.01)  # the scaling model's, before


def test_the_controller_keeps_the_scaling_model_without_kept_reports(tmp_path, monkeypatch):
    monkeypatch.setenv("ORCHESTRATOR_HOME", str(tmp_path / "home"))
    (tmp_path / "home" / "tpu-programs").mkdir(parents=True)
    store = Store(tmp_path / "db.sqlite")
    job_id = _job(store, 0, saves=[])
    spec = store.job(job_id).spec
    assert kept_steps(spec, job_options(["v4-16", "v4-32"], ["spot"])) == {}
    options = {o.label: o.tokens_per_s for o in snapshot(store, job_id, now=T0 + 200, current=None).options}
    assert options["v4-32 spot"] == pytest.approx(1.88 * 512 / STEP_S, rel=0.01)
