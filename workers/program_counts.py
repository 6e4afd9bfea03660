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
from dataclasses import dataclass

from workers import hlo_text as hlo
from workers.hlo_text import Computation, Instruction

# Opcodes that move no HBM bytes of their own (views, bookkeeping, control flow counted in its bodies).
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call",
         "after-all", "partition-id", "replica-id", "iota", "opt-barrier", "copy-done", "slice-done",
         "async-done", "all-reduce-done", "all-gather-done", "collective-permute-done", "send-done", "recv-done"}


@dataclass(frozen=True)
class Counts:
    flops: float  # dots and convolutions, and the Pallas kernels' declared FLOPs
    bytes_accessed: float  # reads and writes, every memory space
    hbm_bytes: float  # those of arrays in the default memory space (HBM): the compiler's scratch spaces left out
    kernel_flops: float  # the Pallas kernels' part of `flops`
    loops: tuple[tuple[str, int], ...]  # (while instruction, trip count) in the order met


def counts(text: str, *, loops: bool = True) -> Counts:
    """The program's FLOPs and bytes for one run (`loops` False: each loop body once, as XLA counts)."""
    computations, entry = hlo.parse(text)
    runs: dict[str, float] = defaultdict(float)  # computation -> times it runs (fusions: times their caller runs)
    top: set[str] = set()  # computations whose instructions touch HBM one by one (not fusion bodies)
    trips: list[tuple[str, int]] = []

    def visit(name: str, times: float, is_top: bool) -> None:
        runs[name] += times
        if is_top:
            top.add(name)
        for ins in computations[name].instructions.values():
            if ins.opcode == "while":
                body, cond = hlo.called(ins, "body"), hlo.called(ins, "condition")
                n = _trip_count(computations[name], ins, computations[body], computations[cond])
                trips.append((ins.name, n))
                visit(cond, times * (n + 1 if loops else 1), True)
                visit(body, times * (n if loops else 1), True)
            elif ins.opcode == "fusion":
                visit(hlo.called(ins), times, False)
            elif ins.opcode in ("call", "async-start"):
                visit(hlo.attr(ins.attributes, "calls") or hlo.called(ins, "to_apply"), times, is_top)
            elif ins.opcode == "conditional":  # each branch at most once a run: counted once
                for branch in re.findall(r"%([\w.\-]+)", hlo.braced(ins.attributes, "branch_computations")):
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
        lhs = hlo.dims(comp, ins.operands[0])
        contracting = [int(d) for d in re.findall(r"\d+", hlo.braced(ins.attributes, "lhs_contracting_dims"))]
        (_, out), = hlo.arrays(ins.shape)
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
    lhs, rhs = hlo.dims(comp, ins.operands[0]), hlo.dims(comp, ins.operands[1])
    (_, out), = hlo.arrays(ins.shape)
    window = hlo.braced(ins.attributes, "window")

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
        results = hlo.ARRAY.findall(ins.shape)  # its result written
        if len(results) < 2 or not ins.operands:
            return 0.0
        source = comp.instructions[ins.operands[0]].shape
        share = hlo.nbytes(_text(results[-2])) / max(hlo.nbytes(source), 1.0)  # a slice reads its part of the source
        return share * hlo.nbytes(source, memory=memory) + hlo.nbytes(_text(results[-2]), memory=memory)
    operands = [hlo.nbytes(comp.instructions[o].shape, memory=memory) for o in ins.operands if o in comp.instructions]
    if ins.opcode == "fusion":
        return _fusion_bytes(computations[hlo.called(ins)], ins, operands, computations, memory)
    if ins.opcode in ("dynamic-slice", "slice"):
        return 2 * hlo.nbytes(ins.shape, memory=memory)
    if ins.opcode == "dynamic-update-slice":
        return 2 * operands[1]
    return hlo.nbytes(ins.shape, memory=memory) + sum(operands)


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
            whole = hlo.nbytes(p.shape)
            total += operands[number] * (min(whole, _read_bytes(fused, p.name, computations)) / whole if whole else 1)
    root = fused.root
    outputs = [fused.instructions[o] for o in root.operands] if root.opcode == "tuple" else [root]
    placed = hlo.ARRAY.findall(ins.shape)  # the outputs as the caller lays them out (their memory spaces)
    for k, out in enumerate(outputs):
        written = (hlo.nbytes(_text(placed[k]), memory=memory) if k < len(placed)
                   else hlo.nbytes(out.shape, memory=memory))
        base = _through_bitcast_up(fused, out)
        if base.name in updated and written:  # in place: only the update is written
            written = hlo.nbytes(fused.instructions[base.operands[1]].shape)
        total += written
    return total


def _read_bytes(comp: Computation, name: str, computations: dict[str, Computation]) -> float:
    """Bytes of the value `name` a fusion reads: its slices where only slices of it are taken (inside nested
    fusions too), else all of it."""
    whole, sliced = hlo.nbytes(comp.instructions[name].shape), 0.0
    for u in _users(comp, name):
        if u.opcode in ("dynamic-slice", "slice") and u.operands[0] == name:
            sliced += hlo.nbytes(u.shape)
        elif u.opcode == "fusion":
            nested = computations[hlo.called(u)]
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
