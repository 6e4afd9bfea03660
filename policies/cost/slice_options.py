"""What a job can run on, and how fast: `count` slices of one type in a tier and zone,
with their price and this job's throughput on them.

Before the job has measured its speed on a slice, `ScalingModel` predicts it from the
model's training FLOPs per token (`policies.model.shape.ModelShape.flops_per_token`)
and the chips' peak; `estimate_tokens_per_s` scales what the job measured on one size
to the others.

Several slices at once (multi-slice data parallelism): the job trains on `count` slices of
one type, each holding a full replica's shard of the model, and the slices average their
gradients over the data-center network (DCN) every step. `multi_slice_options` adds, for
each single-slice option, the counts up to a chip limit; a count-N option trains at N x
the single slice's tokens/s x `dcn_efficiency` (the share of the step not spent waiting
on the cross-slice all-reduce) and costs N x its price.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cached_property

from policies.cost.scaling_assumptions import DEFAULT, ScalingAssumptions

SPOT = "spot"
ON_DEMAND = "on-demand"
RESERVED = "reserved"


@dataclass(frozen=True)
class Option:
    """One thing the job can run on: a slice type in a tier and zone, with its speed and price."""

    name: str  # accelerator type, e.g. "v4-32"
    chips: int
    hosts: int
    tier: str  # SPOT, ON_DEMAND or RESERVED
    usd_per_hour: float  # for the whole slice
    tokens_per_s: float  # this job's throughput on this slice (on all `count` slices together)
    zone: str = "default"
    count: int = 1  # slices of type `name` trained on at once; chips, hosts and price are the total

    @property
    def slice_chips(self) -> int:
        return self.chips // self.count

    @property
    def slice_hosts(self) -> int:
        return self.hosts // self.count

    @property
    def preemptible(self) -> bool:
        return self.tier == SPOT

    @cached_property
    def usd_per_token(self) -> float:
        return self.usd_per_hour / 3600 / self.tokens_per_s

    @property
    def label(self) -> str:
        return f"{self.name} {self.tier}" if self.count == 1 else f"{self.count}x{self.name} {self.tier}"

    @property
    def what(self) -> str:
        """The slices without the tier: "v4-16", "2xv4-16"."""
        return self.name if self.count == 1 else f"{self.count}x{self.name}"

    def repriced(self, under: ScalingAssumptions, base: ScalingAssumptions = DEFAULT) -> Option:
        """This single-slice option, priced a priori under `base`, priced under the assumptions `under`."""
        assert self.count == 1, f"repriced takes single slices, not {self.label}"
        doublings = math.log2(max(self.hosts, 1))
        ratio = (under.mfu_one_host * under.efficiency_per_doubling ** doublings) / (
            base.mfu_one_host * base.efficiency_per_doubling ** doublings)
        return replace(self, tokens_per_s=self.tokens_per_s * ratio)

    def with_count(self, count: int, options: Sequence[Option]) -> Option | None:
        """The option among `options` with this one's type, tier and zone, and `count` slices."""
        return next((o for o in options if (o.name, o.tier, o.zone, o.count) == (self.name, self.tier, self.zone,
                                                                                count)), None)


@dataclass(frozen=True)
class ScalingModel:
    """Throughput before the job has measured it: tokens/s = chips x peak x MFU / FLOPs per token.

    MFU starts at `mfu_one_host` and loses a factor `efficiency_per_doubling` each time
    the host count doubles (more of each step goes to cross-host communication); both from
    `policies.cost.scaling_assumptions.DEFAULT`, where their sources are.
    """

    flops_per_token: float  # training FLOPs: `ModelShape.flops_per_token`
    peak_flops_per_chip: float
    mfu_one_host: float = DEFAULT.mfu_one_host
    efficiency_per_doubling: float = DEFAULT.efficiency_per_doubling

    def mfu(self, hosts: int) -> float:
        return float(self.mfu_one_host * self.efficiency_per_doubling ** math.log2(max(hosts, 1)))

    def tokens_per_s(self, chips: int, hosts: int) -> float:
        return chips * self.peak_flops_per_chip * self.mfu(hosts) / self.flops_per_token


def estimate_tokens_per_s(
    model: ScalingModel, chips: int, hosts: int, measured: Mapping[tuple[int, int], float] | None = None
) -> float:
    """Throughput on (chips, hosts): measured if the job ran there, else the model scaled to
    the nearest measured size (so a job that is slower than the model is slower everywhere)."""
    measured = measured or {}
    if (chips, hosts) in measured:
        return measured[(chips, hosts)]
    if not measured:
        return model.tokens_per_s(chips, hosts)
    (c, h), seen = min(measured.items(), key=lambda kv: abs(math.log2(kv[0][0] / chips)))
    return seen * model.tokens_per_s(chips, hosts) / model.tokens_per_s(c, h)


# --- several slices at once -------------------------------------------------------------

# DCN bandwidth a v4 host gives a cross-slice all-reduce, bytes/s, and the share of a step (the
# backward pass) it hides behind: `policies.cost.scaling_assumptions.DEFAULT`, with their sources.
# Every estimate below scales with the bandwidth: halve it and the exposed time doubles.
DCN_BYTES_PER_S_PER_HOST = DEFAULT.dcn_bytes_per_s_per_host
GRADIENT_BYTES_PER_PARAM = 2  # bf16 gradients
BACKWARD_SHARE = DEFAULT.hidden_share
MAX_CHIPS = 32  # the most chips a multi-slice job may hold at once


def dcn_all_reduce_s(*, params: float, count: int, slice_hosts: int,
                     bytes_per_s_per_host: float = DCN_BYTES_PER_S_PER_HOST) -> float:
    """Seconds a ring all-reduce of the bf16 gradients over `count` slices takes: each slice
    sends and receives 2 x (N - 1) / N x the gradient bytes, spread over its hosts' NICs."""
    if count <= 1:
        return 0.0
    return 2 * (count - 1) / count * GRADIENT_BYTES_PER_PARAM * params / (slice_hosts * bytes_per_s_per_host)


def dcn_efficiency(*, params: float, count: int, slice_hosts: int, slice_step_s: float,
                   bytes_per_s_per_host: float = DCN_BYTES_PER_S_PER_HOST,
                   hidden_share: float = BACKWARD_SHARE) -> float:
    """Share of a multi-slice step spent training: step / (step + the all-reduce time not
    hidden behind `hidden_share` of the step, the backward pass; 0: nothing hidden).
    `slice_step_s`: one slice's step on its share of the global batch (the single slice's
    step time at global batch / N).

    The all-reduce time over the hidden part is about (N - 1) x chips per host x FLOP/s a
    chip does / (DCN bytes/s per host x tokens in the global batch), times (4 x params /
    (BACKWARD_SHARE x FLOPs per token)): the model's size cancels out to first order (FLOPs
    per token ~ 6 x params), so what decides is the global batch in tokens.

    Where it stops paying, at 50 Gbit/s a host and the scaling model's speeds (v4-16
    143k tokens/s for a ~1B model, 20k for an 8B one, 2048-token sequences): the all-reduce
    of a ~1B model takes 0.16 / 0.21 / 0.24 s on 2 / 3 / 4 x v4-16 (8B: 1.28 / 1.71 / 1.92 s)
    and hides behind the backward pass while the global batch holds at least 0.07 / 0.14 /
    0.21M tokens (8B: 0.08 / 0.16 / 0.23M). N x v4-16 costs what one slice of as many chips
    costs, and trains faster while the efficiency stays above the single slice's own loss to
    its larger mesh (0.94 against a v4-32 for 2 slices, 0.88 against a v4-64 for 4): down to
    a global batch of 0.06M tokens for 2 x v4-16 and 0.17M for 4 (8B: 0.07M and 0.19M).
    Below that, 4 x v4-16 at a 0.125M-token batch trains at 0.72 of 4 x one slice's speed
    (8B: 0.66), at 0.0625M, 0.41 (0.37).
    """
    exposed_s = max(dcn_all_reduce_s(params=params, count=count, slice_hosts=slice_hosts,
                                     bytes_per_s_per_host=bytes_per_s_per_host) - hidden_share * slice_step_s, 0.0)
    return slice_step_s / (slice_step_s + exposed_s)


@dataclass(frozen=True)
class MultiSlice:
    """What `multi_slice_options` needs to price several slices: the model's parameter count
    and the tokens of one global batch (split evenly over the slices)."""

    params: float
    batch_tokens: float
    max_count: int = 4
    max_chips: int = MAX_CHIPS
    bytes_per_s_per_host: float = DCN_BYTES_PER_S_PER_HOST
    hidden_share: float = BACKWARD_SHARE  # of a step the all-reduce hides behind (`dcn_efficiency`)

    def efficiency(self, one: Option, count: int) -> float:
        """`dcn_efficiency` of `count` slices like `one` (a single-slice option)."""
        step_s = self.batch_tokens / count / one.tokens_per_s
        return dcn_efficiency(params=self.params, count=count, slice_hosts=one.hosts, slice_step_s=step_s,
                              bytes_per_s_per_host=self.bytes_per_s_per_host, hidden_share=self.hidden_share)


def multi_slice_options(options: Sequence[Option], multi: MultiSlice | None, max_count: int = 1) -> tuple[Option, ...]:
    """`options` (single slices) and, for each, 2..N slices of its type while N x chips stays
    within `multi.max_chips` and N within `max_count` and `multi.max_count`. Without `multi`
    or with `max_count` 1: the single slices alone."""
    out = list(options)
    if multi is None:
        return tuple(out)
    for one in options:
        assert one.count == 1, f"multi_slice_options takes single slices, not {one.label}"
        for n in range(2, min(max_count, multi.max_count) + 1):
            if n * one.chips > multi.max_chips:
                break
            out.append(replace(one, chips=n * one.chips, hosts=n * one.hosts, usd_per_hour=n * one.usd_per_hour,
                               tokens_per_s=n * one.tokens_per_s * multi.efficiency(one, n), count=n))
    return tuple(out)
