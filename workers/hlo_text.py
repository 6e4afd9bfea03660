"""Reading XLA's HLO text (``compiled.as_text()``): its computations, instructions, shapes and attributes."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
               "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 0.5, "u4": 0.5, "token": 0}
ARRAY = re.compile(r"\b([a-z]+\d*(?:e\dm\d\w*)?)\[([\d,]*)\](\{[^{}]*\})?")  # dtype[dims]{layout}
_HEADER = re.compile(r"^(ENTRY )?%([\w.\-]+) .*\{$")
_INSTRUCTION = re.compile(r"^\s+(ROOT )?%([\w.\-]+) = (.*)$")


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



def parse(text: str) -> tuple[dict[str, Computation], str]:
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


def attr(attributes: str, key: str) -> str | None:
    m = re.search(rf"\b{key}=%?([\w.\-]+)", attributes)
    return m.group(1) if m else None


def called(ins: Instruction, key: str = "calls") -> str:
    """The computation `ins` calls under `key` (a fusion's ``calls``, a loop's ``body``)."""
    name = attr(ins.attributes, key)
    if name is None:
        raise ValueError(f"%{ins.name} ({ins.opcode}) names no {key}=")
    return name


def braced(attributes: str, key: str) -> str:
    i = attributes.find(f"{key}={{")
    return "" if i < 0 else attributes[i + len(key) + 1:_closing(attributes, i + len(key) + 1) + 1]


def arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, dimensions) of each array in a shape (a tuple's elements in order)."""
    return [(dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims, _ in ARRAY.findall(shape)]


def nbytes(shape: str, *, memory: str = "any") -> float:
    """Bytes the shape takes in memory: each array padded to its layout's tile (``T(8,128)`` pads the two most
    minor dimensions to 8 and 128), as the TPU lays it out. `memory` "default": only the arrays in the default
    memory space (HBM; a layout's ``S(n)`` puts an array in memory space n: the compiler's on-chip and scratch
    spaces)."""
    total = 0.0
    for dt, dims, layout in ARRAY.findall(shape):
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


def dims(comp: Computation, name: str) -> tuple[int, ...]:
    (_, dims), = arrays(comp.instructions[name].shape)
    return dims
