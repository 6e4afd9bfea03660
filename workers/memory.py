"""The first tier of a multi-slice job's state: each host's shards of the last steps, in its own memory.

With data parallelism across slices every slice holds a whole copy of the state (sharded
inside the slice only), so when one slice dies the others still have all of it. A worker
process does not outlive its runtime (when one process of a JAX runtime dies, the others
abort within seconds), so the copy is held by a `HostMemory` actor on the same host, a
process of its own that lives as long as the slice: every k steps each worker copies its
addressable shards to host memory and hands them to that actor through the host's object
store, where the actor keeps them as they arrived: Ray gives an actor a call's large arrays as
read-only views of the object store (small ones as views of the call), and does not delete an
object while a process reads it, even once its sender (its owner) is gone. That is the one
copy in host memory (counted in the host's object store); the survivors' next workers read it
back through the same host's object store: no checkpoint read, no byte over the network.

A typed PRNG key (`jax.random.key`, dtype ``key<impl>``) has no NumPy form: its shards are
kept as their raw key data (`jax.random.key_data`) and wrapped again with the key's
implementation on the way back.

A copy is keyed by what each shard covers (its index into the global array), not by device
or process: a slice that survives keeps its place inside the slice (its hosts, its
devices), while its place among the slices and its process ids change, and parameters are
never sharded across slices. A restore that finds any shard it needs missing (a program
that shards over the ``data`` axis, a copy of another shape) is refused before any array
is built, on every host together, and the job restores from storage instead.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

KEEP = 2  # copies a host holds: the newest may be cut short by the loss it is for
BUDGET = 0.02  # the share of step time the copies may cost; beyond it, a copy every k steps


def keeper_name(slice_name: str, worker_id: int) -> str:
    return f"{slice_name}-memory-w{worker_id}"


class HostMemory:
    """One host's copies of the state: a Ray actor on the host, for as long as the job holds the slice."""

    def __init__(self, keep: int = KEEP):
        self._keep = keep
        self._copies: dict[int, list] = {}  # step -> the host's shards (`snapshot`)
        self._shapes: dict[int, str] = {}

    def keep(self, step: int, table: list, layout: str) -> None:
        # Held as they arrive: views of the object store that outlive their sender (copying them
        # here would copy the state a second time on its way in).
        self._copies[step], self._shapes[step] = table, layout
        for old in sorted(self._copies)[:-self._keep]:
            del self._copies[old], self._shapes[old]

    def steps(self) -> dict[int, str]:
        """The steps held, each with its layout (what a restore must match)."""
        return dict(self._shapes)

    def recall(self, step: int) -> list | None:
        return self._copies.get(step)


def _key(index: tuple, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """A shard's index as (start, stop) per dimension."""
    out = []
    for s, n in zip(index, shape, strict=True):
        start, stop, _ = s.indices(n)
        out.append((start, stop))
    return tuple(out)


def layout(state: Any) -> str:
    """The shapes and dtypes of `state`'s leaves: a copy restores only onto the same."""
    import jax

    leaves, treedef = jax.tree.flatten(state)
    return repr((str(treedef), [(getattr(x, "shape", None), str(getattr(x, "dtype", type(x).__name__)))
                                for x in leaves]))


def snapshot(state: Any) -> list:
    """This host's shards of every leaf of `state`, copied to host memory (waits for the step)."""
    import jax

    table: list = []
    for leaf in jax.tree.leaves(state):
        if not isinstance(leaf, jax.Array):
            table.append(("value", leaf))
        elif _is_key(leaf):  # no NumPy form: its raw key data, and the implementation to wrap it again with
            table.append(("key", (jax.random.key_impl(leaf), _host_shards(leaf, jax.random.key_data))))
        else:
            table.append(("array", _host_shards(leaf, lambda data: data)))
    return table


def _is_key(leaf: Any) -> bool:
    import jax

    return jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def _host_shards(leaf: Any, raw) -> dict:
    """`raw` of each of this host's shards of `leaf`, in host memory, by what the shard covers."""
    import numpy as np

    shards: dict[tuple, Any] = {}
    for shard in leaf.addressable_shards:
        # A typed key's shard index spans its key data's trailing dimensions too: cut to the key's own.
        key = _key(shard.index[:leaf.ndim], leaf.shape)
        if key not in shards:  # replicas on this host's devices hold the same values
            shards[key] = np.asarray(raw(shard.data))
    return shards


class MemoryMiss(Exception):
    """The copy does not hold every shard this host needs."""


def rebuild(table: list, target: Any) -> Any:
    """The state of `target`'s structure and shardings (shape structs with `.sharding`), from `table`.

    `recall` has checked that `table` covers every shard this host needs (`_check`)."""
    import jax

    leaves, treedef = jax.tree.flatten(target)
    out = []
    for leaf, (kind, held) in zip(leaves, table, strict=True):
        if kind == "value":
            out.append(held)
            continue
        read = _reader(held, leaf.shape) if kind == "array" else _key_reader(held, leaf.shape)
        out.append(jax.make_array_from_callback(leaf.shape, leaf.sharding, read))
    return jax.tree.unflatten(treedef, out)


def _reader(held: dict, shape: tuple[int, ...]):
    """The callback `jax.make_array_from_callback` asks for each of this host's shards."""
    def read(index):
        return held[_key(index, shape)]
    return read


def _key_reader(held: tuple[Any, dict], shape: tuple[int, ...]):
    """`_reader` for a typed key (`held`: its implementation and shards): each shard's key data wrapped again."""
    import jax

    impl, shards = held

    def read(index):
        return jax.random.wrap_key_data(shards[_key(index, shape)], impl=impl)
    return read


@dataclass
class Cadence:
    """How often the loop copies the state: every step while that costs at most `BUDGET` of the
    step time, else every k steps, k from the measured copy and step times (decided once, on host 0's
    figures, and agreed by all hosts: they must hold the same steps)."""

    every: int = 1
    copy_s: float = 0.0
    copies: int = 0

    def measured(self, seconds: float) -> None:
        self.copy_s = (self.copy_s * self.copies + seconds) / (self.copies + 1)
        self.copies += 1

    @staticmethod
    def interval(copy_s: float, step_s: float) -> int:
        if step_s <= 0:
            return 1
        return max(1, math.ceil(copy_s / (BUDGET * step_s)))


class Keeping:
    """The loop's side: copies the state after the steps the cadence says, to this host's `HostMemory`."""

    DECIDE_AFTER = 3  # copies measured before the interval is chosen

    def __init__(self, keeper, send=None, *, every: int | None = None):
        """`every`: copy every that many steps, whatever it costs; None: chosen from the measured costs."""
        self.keeper, self.cadence, self._send, self._fixed = keeper, Cadence(every=every or 1), send, every
        self.broken = False
        self.calls = 0

    def after_step(self, step: int, state: Any, step_s: float | None) -> None:
        """`step` steps are done with `state`; every host calls this after every step."""
        c = self.cadence
        self.calls += 1
        if self.calls == self.DECIDE_AFTER + 1:  # the same call on every host: it is a collective
            self._decide(step_s or 0.0)
        if self.broken or step % c.every:
            return
        t = time.perf_counter()
        try:
            self.keeper.keep.remote(step, snapshot(state), layout(state))
        except Exception as e:  # never stops training: a lost slice then restores from storage
            log.warning("host memory: cannot keep a copy (%s: %s); a lost slice will restore from storage",
                        type(e).__name__, e, exc_info=True)
            self.broken = True
            return
        c.measured(time.perf_counter() - t)

    def _decide(self, step_s: float) -> None:
        import jax
        import numpy as np
        from jax.experimental import multihost_utils

        c = self.cadence
        every = self._fixed or Cadence.interval(c.copy_s, step_s)
        if jax.process_count() > 1 and self._fixed is None:  # host 0's figures decide for all
            every = int(multihost_utils.broadcast_one_to_all(np.int32(every)))
        c.every = every
        log.info("host memory: a copy every %d step(s) (a copy takes %.1f ms, a step %.1f ms)", every,
                 c.copy_s * 1e3, step_s * 1e3)
        if self._send is not None:
            from workers.protocol import MemoryKept

            self._send(MemoryKept(every, c.copy_s, step_s))


def recall(keeper, step: int, target: Any) -> Any:
    """The state of `step` from this host's `HostMemory`, onto `target`'s shardings; MemoryMiss if it cannot.

    Every host must call it together: whether all of them can is agreed before any array is built."""
    import jax
    import numpy as np
    import ray
    from jax.experimental import multihost_utils

    why, table = None, None
    try:
        held = ray.get(keeper.steps.remote(), timeout=30)
        if held.get(step) != layout(target):
            why = f"no copy of step {step} in this shape" if step in held else f"no copy of step {step}"
        else:
            table = ray.get(keeper.recall.remote(step), timeout=60)
            if table is None:
                raise MemoryMiss(f"the copy of step {step} went meanwhile")
            _check(table, target)
    except MemoryMiss as e:
        why = str(e)
    except Exception as e:  # noqa: BLE001 -- every host must reach the vote below: any failure is no copy here
        why = f"{type(e).__name__}: {e}"
    ok = np.int32(why is None)
    if jax.process_count() > 1:
        ok = np.asarray(multihost_utils.process_allgather(ok)).min()
    if not ok or table is None:
        raise MemoryMiss(why or "another host has no usable copy")
    return rebuild(table, target)


def _check(table: list, target: Any) -> None:
    """Raises MemoryMiss if `table` lacks a shard this host needs for `target`."""
    import jax

    leaves = jax.tree.leaves(target)
    if len(leaves) != len(table):
        raise MemoryMiss(f"the copy has {len(table)} leaves, the state {len(leaves)}")
    for leaf, (kind, held) in zip(leaves, table, strict=True):
        if kind != "value":
            shards = held if kind == "array" else held[1]  # a key's: (its implementation, its shards)
            for index in leaf.sharding.addressable_devices_indices_map(leaf.shape).values():
                if _key(index, leaf.shape) not in shards:
                    raise MemoryMiss(f"no shard {_key(index, leaf.shape)} of an array of shape {leaf.shape}")
