"""The scaling assumptions behind multi-slice prices come from one place (issue 38)."""

from __future__ import annotations

import dataclasses

import pytest

from policies.cost.scaling_assumptions import ASSUMPTIONS, DEFAULT, PESSIMISTIC, ScalingAssumptions
from policies.cost.slice_options import BACKWARD_SHARE, DCN_BYTES_PER_S_PER_HOST, MultiSlice, Option, ScalingModel

ONE = Option("v4-16", 8, 2, "spot", 7.36, 143_453.0)
BIG = Option("v4-64", 32, 8, "spot", 29.44, 507_019.0)


def test_the_product_s_constants_are_the_default_assumptions():
    model = ScalingModel(flops_per_token=6e9, peak_flops_per_chip=275e12)
    assert model.mfu_one_host == DEFAULT.mfu_one_host
    assert model.efficiency_per_doubling == DEFAULT.efficiency_per_doubling
    assert (DCN_BYTES_PER_S_PER_HOST, BACKWARD_SHARE) == (DEFAULT.dcn_bytes_per_s_per_host, DEFAULT.hidden_share)
    assert set(ASSUMPTIONS) == {"default", "pessimistic"}


def test_pessimistic_drops_both_advantages_of_several_slices():
    # No large-slice penalty: a v4-64 runs at four v4-16s' speed; the smallest slice keeps its own.
    assert ONE.repriced(PESSIMISTIC, DEFAULT).tokens_per_s == pytest.approx(ONE.tokens_per_s)
    assert BIG.repriced(PESSIMISTIC, DEFAULT).tokens_per_s == pytest.approx(BIG.tokens_per_s / 0.94 ** 2)
    # The all-reduce not hidden: several slices lose some of their speed at the benchmark's batch.
    hidden = MultiSlice(1e9, 512 * 2048).efficiency(ONE, 4)
    exposed = MultiSlice(1e9, 512 * 2048, hidden_share=PESSIMISTIC.hidden_share).efficiency(ONE, 4)
    assert hidden == 1.0 and exposed < 0.95


def test_a_bad_assumption_names_its_field():
    with pytest.raises(ValueError, match="efficiency_per_doubling"):
        dataclasses.replace(DEFAULT, efficiency_per_doubling=1.5)
    with pytest.raises(ValueError, match="dcn_bytes_per_s_per_host"):
        ScalingAssumptions("x", 0.5, 0.9, 0.0, 0.5)
