"""Faults a test injects into the emulator: stockouts, scripted errors, random transient errors.

Errors are decided before a request touches any state, as a front end that sheds
load would do, so a retried call is never applied twice. Random errors draw from a
seeded generator so a failing test replays the same sequence.
"""

from __future__ import annotations

import random
import threading
from dataclasses import asdict, dataclass, replace

from orchestrator.emulator.errors import ERROR_KINDS, TRANSIENT_BY_HTTP, ApiError, make_error

STOCKOUT_MODES = ("wait", "fail")

# The API methods a fault can target, named as in the TPU API's reference
# (tpu.projects.locations.<collection>.<verb>), without the common prefix.
METHODS = (
    "nodes.create",
    "nodes.get",
    "nodes.list",
    "nodes.delete",
    "queuedResources.create",
    "queuedResources.get",
    "queuedResources.list",
    "queuedResources.delete",
    "operations.get",
)


@dataclass(frozen=True)
class ScriptedFault:
    method: str  # one of METHODS, or "*" for every method
    kind: str  # a key of errors.ERROR_KINDS
    remaining: int  # calls still to fail; -1 means until cleared
    zone: str | None = None  # None: any zone


@dataclass(frozen=True)
class RandomErrors:
    rate: float
    codes: tuple[int, ...]
    methods: frozenset[str] | None  # None: every method


class Faults:
    """The current fault plan; every method is safe to call from any thread."""

    def __init__(self, seed: int = 0):
        self._lock = threading.Lock()
        self._seed = seed
        self._rng = random.Random(seed)
        self._scripted: list[ScriptedFault] = []
        self._random: RandomErrors | None = None
        self._stockouts: dict[tuple[str, str | None], str] = {}

    # -- configuration -------------------------------------------------------------

    def fail(self, method: str, kind: str, *, count: int = 1, zone: str | None = None) -> None:
        """Fail the next `count` calls of `method` (-1: every call until `clear`) with `kind`."""
        if method != "*" and method not in METHODS:
            raise ValueError(f"unknown method {method!r}; known: {', '.join(METHODS)}")
        if kind not in ERROR_KINDS:
            raise ValueError(f"unknown error kind {kind!r}; known: {', '.join(ERROR_KINDS)}")
        if count == 0 or count < -1:
            raise ValueError(f"count must be positive or -1, got {count}")
        with self._lock:
            self._scripted.append(ScriptedFault(method, kind, count, zone))

    def random_errors(
        self,
        rate: float,
        *,
        codes: tuple[int, ...] = (503, 429),
        seed: int | None = None,
        methods: tuple[str, ...] | None = None,
    ) -> None:
        """Fail each matching call with probability `rate`, with a code drawn from `codes`."""
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"rate must be in [0, 1], got {rate}")
        bad = [c for c in codes if c not in TRANSIENT_BY_HTTP]
        if bad:
            raise ValueError(f"codes {bad} are not transient; use one of {sorted(TRANSIENT_BY_HTTP)}")
        with self._lock:
            if seed is not None:
                self._rng = random.Random(seed)
            self._random = RandomErrors(rate, tuple(codes), frozenset(methods) if methods else None)

    def stockout(self, zone: str, *, accelerator_type: str | None = None, mode: str = "wait") -> None:
        """No capacity in `zone` (for one accelerator type, or all): queued resources
        wait (``wait``) or fail with RESOURCE_EXHAUSTED (``fail``) when their turn comes."""
        if mode not in STOCKOUT_MODES:
            raise ValueError(f"stockout mode must be one of {STOCKOUT_MODES}, got {mode!r}")
        with self._lock:
            self._stockouts[(zone, accelerator_type)] = mode

    def clear_stockout(self, zone: str | None = None) -> None:
        with self._lock:
            self._stockouts = {k: v for k, v in self._stockouts.items() if zone is not None and k[0] != zone}

    def clear(self) -> None:
        """Remove every fault and reseed the random generator."""
        with self._lock:
            self._scripted.clear()
            self._random = None
            self._stockouts.clear()
            self._rng = random.Random(self._seed)

    # -- queries from the emulator ---------------------------------------------------

    def stockout_mode(self, zone: str, accelerator_type: str) -> str | None:
        with self._lock:
            return self._stockouts.get((zone, accelerator_type)) or self._stockouts.get((zone, None))

    def before(self, method: str, zone: str, parent: str) -> ApiError | None:
        """The error to answer this call with, or None to serve it."""
        with self._lock:
            for i, f in enumerate(self._scripted):
                if f.method in ("*", method) and f.zone in (None, zone):
                    if f.remaining == 1:
                        del self._scripted[i]
                    elif f.remaining > 1:
                        self._scripted[i] = replace(f, remaining=f.remaining - 1)
                    return make_error(f.kind, method=method, zone=zone, parent=parent)
            r = self._random
            if r and (r.methods is None or method in r.methods) and self._rng.random() < r.rate:
                code = self._rng.choice(r.codes)
                return make_error(TRANSIENT_BY_HTTP[code], method=method, zone=zone, parent=parent)
        return None

    def describe(self) -> dict:
        with self._lock:
            return {
                "scripted": [asdict(f) for f in self._scripted],
                "random": None
                if self._random is None
                else {"rate": self._random.rate, "codes": list(self._random.codes)},
                "stockouts": [{"zone": z, "acceleratorType": t, "mode": m} for (z, t), m in self._stockouts.items()],
            }
