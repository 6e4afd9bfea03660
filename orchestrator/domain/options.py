"""The slices a job may run on, as the cost policy's options: each allowed type x tier, priced from the catalog.

A type's speed is measured where the job has run on it, else estimated from its peak FLOP/s
and the job's FLOPs per token (`policies.cost.slice_options`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from orchestrator.catalog import Tier, lookup
from policies.cost.slice_options import Option, ScalingModel, estimate_tokens_per_s
from policies.model.shape import training_flops_per_token

# A ~1B-parameter dense decoder (24 layers, d_model 2048) on 2048-token sequences: how a job whose
# model the policy cannot read (a user's program) is priced.
DEFAULT_PARAMS = 1.0e9
DEFAULT_FLOPS_PER_TOKEN = training_flops_per_token(active_params=DEFAULT_PARAMS, n_layers=24, d_model=2048,
                                                   seq_len=2048)


def job_options(
    tpu_types: Sequence[str],
    tiers: Sequence[str],
    *,
    flops_per_token: float = DEFAULT_FLOPS_PER_TOKEN,
    measured_tokens_per_s: Mapping[str, float] | None = None,
    zone: str = "default",
) -> tuple[Option, ...]:
    """One policy `Option` per allowed type x tier, priced from the catalog."""
    types = [lookup(name) for name in tpu_types]
    measured = {(lookup(n).chips, lookup(n).hosts): v for n, v in (measured_tokens_per_s or {}).items()}
    options = []
    for t in types:
        model = ScalingModel(flops_per_token, t.peak_bf16_flops_per_chip)
        speed = estimate_tokens_per_s(model, t.chips, t.hosts, measured)
        for tier in tiers:
            tier = Tier(tier)
            options.append(Option(t.name, t.chips, t.hosts, tier.value, t.usd_per_hour(tier), speed, zone))
    return tuple(options)
