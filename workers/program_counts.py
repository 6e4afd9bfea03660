"""FLOPs and HBM bytes of one run of a compiled XLA program, each loop body counted as often as it runs.

XLA's cost analysis (``compiled.cost_analysis()``) counts the body of every while loop once,
whatever its trip count: the TPU compiler's figures for a 1-layer scan and a 16-layer one are the
same. The built-in trainer's step is two nested loops (microbatches, and the layers' ``lax.scan``
forward and backward), so its figures are about one layer of one microbatch. This module reads
the compiled program's text (``compiled.as_text()``, after optimization) and counts again:

- FLOPs: every dot and convolution (2 per multiply-add; a convolution's valid window positions
  only, as XLA's own `HloCostAnalysis` counts them), and the FLOPs each Pallas kernel declares
  (its ``pl.CostEstimate``, in the custom call's ``cost_estimate``); elementwise arithmetic is
  left out (XLA counts it, a few percent of a transformer's step).
- bytes: what each top-level instruction reads and writes in HBM, a fusion as one (its operands
  and outputs; a slice of a loop's stacked buffer as the slice, an in-place update as the update),
  a Pallas kernel as its declared bytes.

each weighted by how many times its computation runs: a while loop's body by its trip count
(read from its condition, ``i < N``, and its counter's start and step), nested loops multiplied.
`counts(text, loops=False)` counts every body once, as XLA does: set beside XLA's own figures it
checks this reading of the program.
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from dataclasses import dataclass, field

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
               "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 0.5, "u4": 0.5, "token": 0}
_ARRAY = re.compile(r"\b([a-z]+\d*(?:e\dm\d\w*)?)\[([\d,]*)\](\{[^{}]*\})?")  # dtype[dims]{layout}
_HEADER = re.compile(r"^(ENTRY )?%([\w.\-]+) .*\{$")
_INSTRUCTION = re.compile(r"^\s+(ROOT )?%([\w.\-]+) = (.*)$")
# Opcodes that move no HBM bytes of their own (views, bookkeeping, control flow counted in its bodies).
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call",
         "after-all", "partition-id", "replica-id", "iota", "opt-barrier", "copy-done", "slice-done",
         "async-done", "all-reduce-done", "all-gather-done", "collective-permute-done", "send-done", "recv-done"}


@dataclass
class Instruction:
    name: str
    shape: str  # the result's shape, layouts included
    opcode: str
    operands: list[str]  # names of instructions of the same computation
    attributes: str
    args: str = ""  # what the parentheses hold: the operands, or a constant's literal
    root: bool = False


@dataclass
class Computation:
    name: str
    instructions: dict[str, Instruction] = field(default_factory=dict)

    @property
    def root(self) -> Instruction:
        return next(i for i in self.instructions.values() if i.root)


@dataclass(frozen=True)
class Counts:
    flops: float  # dots and convolutions, and the Pallas kernels' declared FLOPs
    bytes_accessed: float  # reads and writes, every memory space
    hbm_bytes: float  # those of arrays in the default memory space (HBM): the compiler's scratch spaces left out
    kernel_flops: float  # the Pallas kernels' part of `flops`
    loops: tuple[tuple[str, int], ...]  # (while instruction, trip count) in the order met


def counts(text: str, *, loops: bool = True) -> Counts:
    """The program's FLOPs and bytes for one run (`loops` False: each loop body once, as XLA counts)."""
    computations, entry = _parse(text)
    runs: dict[str, float] = defaultdict(float)  # computation -> times it runs (fusions: times their caller runs)
    top: set[str] = set()  # computations whose instructions touch HBM one by one (not fusion bodies)
    trips: list[tuple[str, int]] = []

    def visit(name: str, times: float, is_top: bool) -> None:
        runs[name] += times
        if is_top:
            top.add(name)
        for ins in computations[name].instructions.values():
            if ins.opcode == "while":
                body, cond = _called(ins, "body"), _called(ins, "condition")
                n = _trip_count(computations[name], ins, computations[body], computations[cond])
                trips.append((ins.name, n))
                visit(cond, times * (n + 1 if loops else 1), True)
                visit(body, times * (n if loops else 1), True)
            elif ins.opcode == "fusion":
                visit(_called(ins), times, False)
            elif ins.opcode in ("call", "async-start"):
                visit(_attr(ins.attributes, "calls") or _called(ins, "to_apply"), times, is_top)
            elif ins.opcode == "conditional":  # each branch at most once a run: counted once
                for branch in re.findall(r"%([\w.\-]+)", _braced(ins.attributes, "branch_computations")):
                    visit(branch, times, is_top)

    visit(entry, 1.0, True)
    flops = kernel_flops = nbytes = hbm = 0.0
    for name, times in runs.items():
        comp = computations[name]
        for ins in comp.instructions.values():
            f, kf = _flops(comp, ins)
            flops += times * (f + kf)
            kernel_flops += times * kf
            if name in top:
                nbytes += times * _bytes(comp, ins, computations, "any")
                hbm += times * _bytes(comp, ins, computations, "default")
    return Counts(flops, nbytes, hbm, kernel_flops, tuple(trips))


# --- reading the text -------------------------------------------------------------------------------------

def _parse(text: str) -> tuple[dict[str, Computation], str]:
    computations: dict[str, Computation] = {}
    entry, current = "", None
    for line in text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m:
                current = computations.setdefault(m.group(2), Computation(m.group(2)))
                entry = m.group(2) if m.group(1) else entry
            continue
        if line.startswith("}"):
            current = None
            continue
        m = _INSTRUCTION.match(line)
        if m:
            ins = _instruction(m.group(2), m.group(3), root=bool(m.group(1)))
            current.instructions[ins.name] = ins
    if not entry:
        raise ValueError("no ENTRY computation in the program's text")
    return computations, entry


def _instruction(name: str, rest: str, *, root: bool) -> Instruction:
    shape, rest = _split_shape(rest)
    m = re.match(r"([\w\-]+)\(", rest)
    if m is None:
        raise ValueError(f"cannot read instruction %{name}: {rest[:120]}")
    end = _closing(rest, m.end() - 1)
    operands = re.findall(r"%([\w.\-]+)", rest[m.end():end])
    return Instruction(name, shape, m.group(1), operands, rest[end + 1:], rest[m.end():end], root)


def _split_shape(rest: str) -> tuple[str, str]:
    if rest.startswith("("):
        end = _closing(rest, 0)
        return rest[:end + 1], rest[end + 1:].lstrip()
    shape, _, tail = rest.partition(" ")
    return shape, tail


def _closing(s: str, start: int) -> int:
    """Index of the bracket that closes the one at `start`."""
    pairs, depth = {"(": ")", "{": "}", "[": "]"}, 0
    opening = s[start]
    for i in range(start, len(s)):
        if s[i] == opening:
            depth += 1
        elif s[i] == pairs[opening]:
            depth -= 1
            if depth == 0:
                return i
    raise ValueError(f"unbalanced {opening!r} in {s[:120]}")


def _attr(attributes: str, key: str) -> str | None:
    m = re.search(rf"\b{key}=%?([\w.\-]+)", attributes)
    return m.group(1) if m else None


def _called(ins: Instruction, key: str = "calls") -> str:
    """The computation `ins` calls under `key` (a fusion's ``calls``, a loop's ``body``)."""
    name = _attr(ins.attributes, key)
    if name is None:
        raise ValueError(f"%{ins.name} ({ins.opcode}) names no {key}=")
    return name


def _braced(attributes: str, key: str) -> str:
    i = attributes.find(f"{key}={{")
    return "" if i < 0 else attributes[i + len(key) + 1:_closing(attributes, i + len(key) + 1) + 1]


def _arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, dimensions) of each array in a shape (a tuple's elements in order)."""
    return [(dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims, _ in _ARRAY.findall(shape)]


def _nbytes(shape: str, *, memory: str = "any") -> float:
    """Bytes the shape takes in memory: each array padded to its layout's tile (``T(8,128)`` pads the two most
    minor dimensions to 8 and 128), as the TPU lays it out. `memory` "default": only the arrays in the default
    memory space (HBM; a layout's ``S(n)`` puts an array in memory space n: the compiler's on-chip and scratch
    spaces)."""
    total = 0.0
    for dt, dims, layout in _ARRAY.findall(shape):
        if memory == "default" and re.search(r"S\([1-9]\d*\)", layout):
            continue
        sizes = [int(d) for d in dims.split(",") if d]
        minor_to_major, _, tiling = layout[1:-1].partition(":")
        tile = re.match(r"T\(([\d,]+)\)", tiling)
        if sizes and minor_to_major and tile:
            order = [int(x) for x in minor_to_major.split(",")]
            # the tile covers the minor dimensions only: fewer sizes than the order names
            for t, d in zip(reversed([int(x) for x in tile.group(1).split(",")]), order, strict=False):
                sizes[d] = -(-sizes[d] // t) * t
        total += DTYPE_BYTES.get(dt, 4) * math.prod(sizes)
    return total


def _dims(comp: Computation, name: str) -> tuple[int, ...]:
    (_, dims), = _arrays(comp.instructions[name].shape)
    return dims


# --- loops ------------------------------------------------------------------------------------------------

def _trip_count(caller: Computation, loop: Instruction, body: Computation, cond: Computation) -> int:
    """N of a counted loop ``for (i = start; i < bound; i += step)``: the condition compares a counter (an
    element of the loop's tuple) with a constant; its start is that element of the loop's initial tuple
    (0 where it is not a constant there), its step what the body adds to it (1 where not a constant)."""
    compare = cond.root
    while compare.opcode != "compare" and compare.operands:  # a fused or converted condition: follow its root
        compare = cond.instructions[compare.operands[0]]
    bound = next((c for o in compare.operands if (c := _constant(cond, o)) is not None), None)
    counter = next((cond.instructions[o] for o in compare.operands
                    if cond.instructions[o].opcode == "get-tuple-element"), None)
    element = re.search(r"index=(\d+)", counter.attributes) if counter is not None else None
    if compare.opcode != "compare" or bound is None or element is None or "direction=LT" not in compare.attributes:
        raise ValueError(f"cannot read the trip count of %{loop.name} (condition %{cond.name})")
    index = int(element.group(1))
    start = _element(caller, loop.operands[0], index)
    step = None
    if body.root.opcode == "tuple":
        update = body.instructions.get(body.root.operands[index])
        if update is not None and update.opcode == "add":
            step = next((c for o in update.operands if (c := _constant(body, o)) is not None), None)
    return max(0, math.ceil((bound - (start or 0)) / (step or 1)))


def _element(comp: Computation, name: str, index: int) -> int | None:
    """The constant at `index` of the tuple `name`, if it is one."""
    ins = comp.instructions.get(name)
    if ins is None or ins.opcode != "tuple" or index >= len(ins.operands):
        return None
    return _constant(comp, ins.operands[index])


def _constant(comp: Computation, name: str) -> int | None:
    """The integer `name` holds if it is a constant (through copies and conversions: a peeled loop's start)."""
    ins = comp.instructions.get(name)
    while ins is not None and ins.opcode in ("copy", "bitcast", "convert") and ins.operands:
        ins = comp.instructions.get(ins.operands[0])
    if ins is None or ins.opcode != "constant":
        return None
    return int(ins.args) if re.fullmatch(r"-?\d+", ins.args.strip()) else None


# --- FLOPs ------------------------------------------------------------------------------------------------

def _flops(comp: Computation, ins: Instruction) -> tuple[float, float]:
    """(XLA's FLOPs, a Pallas kernel's declared FLOPs) of one instruction."""
    if ins.opcode == "dot":
        lhs = _dims(comp, ins.operands[0])
        contracting = [int(d) for d in re.findall(r"\d+", _braced(ins.attributes, "lhs_contracting_dims"))]
        (_, out), = _arrays(ins.shape)
        return 2.0 * math.prod(out) * math.prod(lhs[d] for d in contracting), 0.0
    if ins.opcode == "convolution":
        return _convolution_flops(comp, ins), 0.0
    if ins.opcode == "custom-call":
        cost = _kernel_cost(ins)
        return 0.0, float(cost.get("flops", 0)) if cost else 0.0
    return 0.0, 0.0


def _convolution_flops(comp: Computation, ins: Instruction) -> float:
    """2 x output batch x output features x input features a group x the valid (output, window) position pairs
    of every spatial dimension (padding and dilation excluded), as `HloCostAnalysis` counts a convolution."""
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", ins.attributes)
    if labels is None:
        raise ValueError(f"%{ins.name}: a convolution without dim_labels")
    lhs_labels, rhs_labels, out_labels = labels.groups()
    lhs, rhs = _dims(comp, ins.operands[0]), _dims(comp, ins.operands[1])
    (_, out), = _arrays(ins.shape)
    window = _braced(ins.attributes, "window")

    def per_dim(key: str, n: int, default: int) -> list[int]:
        m = re.search(rf"\b{key}=([\d_x]+)", window)
        return [int(x) for x in m.group(1).split("x")] if m else [default] * n

    spatial = sorted(c for c in rhs_labels if c.isdigit())
    n = len(spatial)
    size, stride = per_dim("size", n, 1), per_dim("stride", n, 1)
    lhs_dilate, rhs_dilate = per_dim("lhs_dilate", n, 1), per_dim("rhs_dilate", n, 1)
    pad_m = re.search(r"\bpad=([\d_x\-]+)", window)
    pads = [tuple(int(p) for p in d.split("_")) for d in pad_m.group(1).split("x")] if pad_m else [(0, 0)] * n
    valid = 1
    for k, dim in enumerate(spatial):
        n_in, n_out = lhs[lhs_labels.index(dim)], out[out_labels.index(dim)]
        valid *= _valid_pairs(n_in, n_out, size[k], stride[k], pads[k][0], lhs_dilate[k], rhs_dilate[k])
    batch, features = out[out_labels.index("b")], out[out_labels.index("f")]
    return 2.0 * batch * features * rhs[rhs_labels.index("i")] * valid


def _valid_pairs(n_in: int, n_out: int, k: int, stride: int, pad_low: int, lhs_dilate: int, rhs_dilate: int) -> int:
    """(output position, window position) pairs that land on a real input element."""
    total = 0
    for w in range(k):
        # input coordinate (in the dilated, padded input) of output o: o * stride + w * rhs_dilate - pad_low
        for o in range(n_out):
            x = o * stride + w * rhs_dilate - pad_low
            if 0 <= x <= (n_in - 1) * lhs_dilate and x % lhs_dilate == 0:
                total += 1
    return total


def _kernel_cost(ins: Instruction) -> dict | None:
    """A Pallas (Mosaic) kernel's ``cost_estimate`` from its backend config, if it declares one."""
    if 'custom_call_target="tpu_custom_call"' not in ins.attributes:
        return None
    m = re.search(r'"cost_estimate":(\{[^{}]*\})', ins.attributes.replace('\\"', '"'))
    return {k: float(v) for k, v in json.loads(m.group(1)).items()} if m else None


# --- bytes ------------------------------------------------------------------------------------------------

def _bytes(comp: Computation, ins: Instruction, computations: dict[str, Computation], memory: str) -> float:
    """Bytes `ins` reads and writes (`memory` "default": of arrays in the default memory space only)."""
    if ins.opcode in _FREE:
        return 0.0
    if ins.opcode == "custom-call":
        cost = _kernel_cost(ins)
        if cost is not None and "bytes_accessed" in cost:
            return cost["bytes_accessed"]
        if 'custom_call_target="AllocateBuffer"' in ins.attributes:
            return 0.0
    if ins.opcode.endswith("-start"):  # async copy or slice: ((operand), result, sync flag): its source read,
        results = _ARRAY.findall(ins.shape)  # its result written
        if len(results) < 2 or not ins.operands:
            return 0.0
        source = comp.instructions[ins.operands[0]].shape
        share = _nbytes(_text(results[-2])) / max(_nbytes(source), 1.0)  # a slice reads its part of the source
        return share * _nbytes(source, memory=memory) + _nbytes(_text(results[-2]), memory=memory)
    operands = [_nbytes(comp.instructions[o].shape, memory=memory) for o in ins.operands if o in comp.instructions]
    if ins.opcode == "fusion":
        return _fusion_bytes(computations[_called(ins)], ins, operands, computations, memory)
    if ins.opcode in ("dynamic-slice", "slice"):
        return 2 * _nbytes(ins.shape, memory=memory)
    if ins.opcode == "dynamic-update-slice":
        return 2 * operands[1]
    return _nbytes(ins.shape, memory=memory) + sum(operands)


def _text(array: tuple[str, str, str]) -> str:
    dt, dims, layout = array
    return f"{dt}[{dims}]{layout}"


def _fusion_bytes(fused: Computation, ins: Instruction, operands: list[float], computations: dict[str, Computation],
                  memory: str) -> float:
    """A fusion's operands and outputs; a parameter only sliced inside counts its slices, the buffer an in-place
    update writes into counts nothing, and that output counts the update."""
    params = {int(p.args): p for p in fused.instructions.values() if p.opcode == "parameter"}
    total = 0.0
    updated: set[str] = set()
    for number, p in params.items():
        uses = _users(fused, p.name)
        if uses and all(u.opcode == "dynamic-update-slice" and _resolves_to(fused, u.operands[0], p.name)
                        for u in uses):
            updated.update(u.name for u in uses)
        elif number < len(operands):
            whole = _nbytes(p.shape)
            total += operands[number] * (min(whole, _read_bytes(fused, p.name, computations)) / whole if whole else 1)
    root = fused.root
    outputs = [fused.instructions[o] for o in root.operands] if root.opcode == "tuple" else [root]
    placed = _ARRAY.findall(ins.shape)  # the outputs as the caller lays them out (their memory spaces)
    for k, out in enumerate(outputs):
        written = _nbytes(_text(placed[k]), memory=memory) if k < len(placed) else _nbytes(out.shape, memory=memory)
        base = _through_bitcast_up(fused, out)
        if base.name in updated and written:  # in place: only the update is written
            written = _nbytes(fused.instructions[base.operands[1]].shape)
        total += written
    return total


def _read_bytes(comp: Computation, name: str, computations: dict[str, Computation]) -> float:
    """Bytes of the value `name` a fusion reads: its slices where only slices of it are taken (inside nested
    fusions too), else all of it."""
    whole, sliced = _nbytes(comp.instructions[name].shape), 0.0
    for u in _users(comp, name):
        if u.opcode in ("dynamic-slice", "slice") and u.operands[0] == name:
            sliced += _nbytes(u.shape)
        elif u.opcode == "fusion":
            nested = computations[_called(u)]
            inner = {int(p.args): p.name for p in nested.instructions.values() if p.opcode == "parameter"}
            sliced += sum(_read_bytes(nested, inner[k], computations) for k, o in enumerate(u.operands) if o == name)
        else:
            return whole
    return min(whole, sliced)


def _users(comp: Computation, name: str) -> list[Instruction]:
    """The instructions that take `name`, looking through bitcasts."""
    out = []
    for i in comp.instructions.values():
        if name in i.operands:
            out.extend(_users(comp, i.name) if i.opcode == "bitcast" else [i])
    return out


def _resolves_to(comp: Computation, name: str, target: str) -> bool:
    while name != target and comp.instructions[name].opcode == "bitcast":
        name = comp.instructions[name].operands[0]
    return name == target


def _through_bitcast_up(comp: Computation, ins: Instruction) -> Instruction:
    while ins.opcode == "bitcast" and ins.operands:
        ins = comp.instructions[ins.operands[0]]
    return ins
