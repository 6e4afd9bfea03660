"""Spot capacity traces: loading them, and mapping a trace's counts to TPU slice sizes.

The bundled traces (``policies/evaluation/traces/``, see its README for attribution) are AWS GPU
spot traces from the "Can't Be Late" paper, not TPU measurements. We treat each trace
as the spot capacity signal for one TPU slice family in one zone: at every tick it
says how large a spot slice could be had there. A `CapacityMapping` turns the trace's
count into the largest obtainable slice, in chips:

- 1-node traces (counts 0/1): 1 -> a v4-32 (16 chips) and anything smaller, 0 -> none.
- 4-node traces (counts 0..4): 4 -> v4-64 (32 chips), 2-3 -> v4-32 (16), 1 -> v4-16 (8).

Capacity is nested: if a 16-chip slice can be had, so can an 8-chip one. This module
is the only place in ``policies`` that reads files.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import numpy as np
from pydantic import BaseModel, Field, NonNegativeInt, PositiveFloat, ValidationError

TRACE_ROOT = Path(__file__).parent / "traces"


@dataclass(frozen=True)
class CapacityMapping:
    """Largest spot slice (chips) obtainable, indexed by the trace's count."""

    chips_by_count: tuple[int, ...]

    def chips(self, count: int) -> int:
        return self.chips_by_count[min(max(count, 0), len(self.chips_by_count) - 1)]


ONE_NODE_MAPPING = CapacityMapping((0, 16))  # 1 -> v4-32 (and v4-16)
FOUR_NODE_MAPPING = CapacityMapping((0, 8, 16, 16, 32))  # 1 -> v4-16, 2-3 -> v4-32, 4 -> v4-64


@dataclass(frozen=True)
class SpotTrace:
    """One zone's spot capacity over time: `counts[i]` holds during [i*gap_s, (i+1)*gap_s)."""

    name: str
    gap_s: float
    counts: tuple[int, ...]
    nodes: int  # how many instances the trace tracked: 1 or 4

    @property
    def duration_s(self) -> float:
        return self.gap_s * len(self.counts)

    @property
    def mapping(self) -> CapacityMapping:
        return FOUR_NODE_MAPPING if self.nodes >= 4 else ONE_NODE_MAPPING

    def capacity_chips(self, start_s: float, step_s: float, n_steps: int) -> np.ndarray:
        """Largest spot slice (chips) during each of `n_steps` steps from `start_s`.

        A run longer than the trace wraps around to the trace's start, so every start
        offset gives a full-length signal.
        """
        table = np.array([self.mapping.chips(c) for c in range(max(self.counts) + 1)], dtype=np.int64)
        ticks = ((start_s + step_s * np.arange(n_steps)) // self.gap_s).astype(np.int64) % len(self.counts)
        return table[np.asarray(self.counts, dtype=np.int64)[ticks]]

    def available_fraction(self) -> float:
        return float(np.mean(np.asarray(self.counts) > 0))


_NODES_RE = re.compile(r"(\d+)-node")


class TraceError(ValueError):
    """A trace file that cannot be read as a trace; the message names the file and the field."""


class _TraceMetadata(BaseModel):
    gap_seconds: PositiveFloat


class _TraceFile(BaseModel):
    metadata: _TraceMetadata
    data: Annotated[list[NonNegativeInt], Field(min_length=1)]


def load_trace(path: str | Path, *, name: str | None = None) -> SpotTrace:
    """Read one trace file (``{"metadata": {"gap_seconds": G}, "data": [...]}``).

    The node count comes from an ``N-node`` folder in the path, else from the largest
    count in the data (a trace that never exceeds 1 is a 1-node trace).
    """
    path = Path(path)
    try:
        raw = _TraceFile.model_validate_json(path.read_bytes())
    except OSError as e:
        raise TraceError(f"{path}: cannot read it ({e.strerror})") from None
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'file'}: {err['msg']}" for err in e.errors())
        raise TraceError(f"{path}: not a spot trace ({problems})") from None
    counts = tuple(raw.data)
    match = _NODES_RE.search(path.as_posix())
    nodes = int(match.group(1)) if match else max(1, max(counts))
    return SpotTrace(name or path.stem, raw.metadata.gap_seconds, counts, nodes)


def bundled_traces() -> list[SpotTrace]:
    """Every trace shipped in ``policies/evaluation/traces/``, named by its path there, sorted."""
    paths = sorted(TRACE_ROOT.rglob("*.json"))
    return [load_trace(p, name=p.relative_to(TRACE_ROOT).with_suffix("").as_posix()) for p in paths]


def tune_and_check(traces: list[SpotTrace]) -> tuple[list[SpotTrace], list[SpotTrace]]:
    """The traces split into a set to tune the policy's constants on and a set to check them on
    (issue 38): alternately in name order, so each family (availability or preemption, 1 or 4
    nodes, each date) lands in both where it has more than one trace."""
    ordered = sorted(traces, key=lambda t: t.name)
    return ordered[0::2], ordered[1::2]


def constant_trace(count: int, *, gap_s: float = 600.0, ticks: int = 1000, nodes: int = 1) -> SpotTrace:
    """A trace whose capacity never changes (no preemptions when count > 0)."""
    return SpotTrace(f"constant-{count}", gap_s, (count,) * ticks, nodes)


def markov_trace(
    *, mean_up_h: float, mean_down_h: float, gap_s: float = 300.0, hours: float = 24 * 14, seed: int = 0,
    nodes: int = 1,
) -> SpotTrace:
    """A synthetic trace: a two-state Markov chain with the given mean up and down times.

    Up counts `nodes` (so with 4 nodes every size up to a v4-64 can be had), down 0.
    Used when a user plans without a trace of their own: the chain is parameterised by
    the policy's priors, so the plan reflects what the policy itself assumes.
    """
    rng = np.random.default_rng(seed)
    n = int(hours * 3600 / gap_s)
    leave_up = 1 - np.exp(-gap_s / (mean_up_h * 3600))
    leave_down = 1 - np.exp(-gap_s / (mean_down_h * 3600))
    draws = rng.random(n)
    counts, state = [], 1
    for u in draws:
        counts.append(state)
        if u < (leave_up if state else leave_down):
            state = 1 - state
    return SpotTrace(f"markov-up{mean_up_h:g}h-down{mean_down_h:g}h", gap_s, tuple(c * nodes for c in counts), nodes)
