"""Throughput before the job has measured it, from the TPU compiler: a compiled prior.

Where XLA's TPU compiler has compiled the job's step for an option (`workers.tpu_target.ProgramReport`),
its roofline (`workers.tpu_target.roofline_s`: the step's FLOPs at the chips' peak or its HBM
traffic at their bandwidth, whichever is longer) bounds the step time from below. A bound is
not a speed: the step also waits on collectives (the roofline counts none), on the input and on
everything the compiler's counts leave out. So the prior is a share of the bound,

    tokens/s = share x tokens per step / roofline seconds (x the DCN efficiency for several slices),

and the share is calibrated, in this order:

1. *measured*: once the job has measured its speed on an option that has a compiled report, the
   share is what it got there over what the bound allowed (`measured / ceiling`), taken from
   the measured option nearest in chips. One program family, one calibration: a job slower than
   its bound on one slice is priced as slower on the others too.
2. *published*: before any measurement, `PUBLISHED_SHARE`, the model-FLOPs utilisation MaxText
   says it typically reaches on TPUs (see there). It stands in for the share of the roofline
   because, for a compute-bound step whose FLOPs the compiler counts as the model's, the two are
   the same figure; it is not a measurement of this job.

Measured speed wins over both: an option the job has run on is priced at what it measured. An
option without a compiled report keeps the a-priori price it came with (the scaling model,
`policies.cost.slice_options.ScalingModel`, scaled to what the job measured); so does every
option while the job has measured only options without one (a share calibrated on the job's
own speed beats the published one, and there is none to calibrate on).

Several slices: the compiled program of N slices is one slice's share of the global batch,
trained N times; its roofline counts no cross-slice all-reduce either, so the ceiling of an
N-slice option is its roofline tokens/s times the DCN efficiency the a-priori options priced
it with (`policies.cost.slice_options.dcn_efficiency`).

Options are named by `Option.what` ("v4-16", "2xv4-16"): a slice type and count, tier aside
(the program does not change with the tier).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from policies.cost.slice_options import Option

# MaxText's README: "MaxText typically achieves 55% to 60% model-flop utilization" on Cloud TPUs
# (github.com/AI-Hypercomputer/maxtext, README.md, the project's own summary of its runtime performance
# results; its published tables are for v5e, v5p and v6e at 16B-405B parameters, not v4 at 1B). The low end.
PUBLISHED_SHARE = 0.55

MEASURED = "measured"
COMPILED = "compiled"
SCALING_MODEL = "scaling model"


@dataclass(frozen=True)
class CompiledStep:
    """The compiler's figures for one option's step: the tokens it trains and its roofline seconds."""

    tokens_per_step: float
    roofline_s: float  # `workers.tpu_target.roofline_s` of the option's report: a lower bound

    def __post_init__(self) -> None:
        if self.tokens_per_step <= 0 or self.roofline_s <= 0:
            raise ValueError(f"a compiled step needs tokens and time: {self.tokens_per_step=}, {self.roofline_s=}")

    @property
    def roofline_tokens_per_s(self) -> float:
        """The most tokens/s the step allows by the compiler's counts (an upper bound)."""
        return self.tokens_per_step / self.roofline_s


@dataclass(frozen=True)
class Calibration:
    """The share of the roofline a compiled prior is priced at, and where it came from."""

    share: float
    source: str  # "published" (`PUBLISHED_SHARE`) or "measured on <option>"


@dataclass(frozen=True)
class Priced:
    """Options priced with compiled priors: the options, and for each (`Option.what`) which price it got
    (`MEASURED`, `COMPILED` or `SCALING_MODEL`) and, for a compiled one, the calibration used."""

    options: tuple[Option, ...]
    priors: dict[str, str]
    calibrations: dict[str, Calibration]


def _dcn(o: Option, options: Sequence[Option]) -> float:
    """The DCN efficiency the a-priori options priced `o` with: its speed over `count` x one slice's."""
    one = o.with_count(1, options)
    return 1.0 if o.count == 1 or one is None else o.tokens_per_s / (o.count * one.tokens_per_s)


def calibration(what: str, chips: int, ceilings: Mapping[str, tuple[int, float]],
                measured: Mapping[str, float], published: float = PUBLISHED_SHARE) -> Calibration:
    """The share of its ceiling `what` (on `chips` chips) is priced at: measured over ceiling on the
    measured option with a compiled report nearest in chips; else `published`.

    `ceilings`: {what: (chips, ceiling tokens/s)} of the options with compiled reports."""
    seen = [(w, chips_w, ceiling) for w, (chips_w, ceiling) in ceilings.items() if w in measured]
    if not seen:
        return Calibration(published, "published")
    w, _, ceiling = min(seen, key=lambda s: (abs(math.log2(s[1] / chips)), s[0]))
    return Calibration(measured[w] / ceiling, f"measured on {w}")


def priced(options: Sequence[Option], compiled: Mapping[str, CompiledStep],
           measured: Mapping[str, float] | None = None, *, published: float = PUBLISHED_SHARE) -> Priced:
    """`options` (priced a priori: the scaling model, several slices with their DCN efficiency) with the
    compiled prior where `compiled` has the option's step, and the measured speed where `measured` has it.

    `compiled` and `measured` (tokens/s) are keyed by `Option.what`."""
    measured = measured or {}
    ceilings = {o.what: (o.chips, compiled[o.what].roofline_tokens_per_s * _dcn(o, options))
                for o in options if o.what in compiled}
    if measured and not ceilings.keys() & measured.keys():
        ceilings = {}  # measured only where nothing was compiled: the given prices are scaled to that, not a guess
    out, priors, calibrations = [], {}, {}
    for o in options:
        if o.what in measured:
            out.append(replace(o, tokens_per_s=measured[o.what]))
            priors[o.what] = MEASURED
        elif o.what in ceilings:
            cal = calibration(o.what, o.chips, ceilings, measured, published)
            out.append(replace(o, tokens_per_s=cal.share * ceilings[o.what][1]))
            priors[o.what], calibrations[o.what] = COMPILED, cal
        else:
            out.append(o)
            priors[o.what] = SCALING_MODEL
    return Priced(tuple(out), priors, calibrations)
