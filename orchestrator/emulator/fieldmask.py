"""Partial responses, as every Google REST API gives them: the ``X-Goog-FieldMask`` header (or the ``fields`` query
parameter) names the fields of the response to send, and nothing else is sent.

A mask is a comma-separated list of field paths, each a dotted path (``nodes.state``) or a path with sub-paths
in parentheses (``nodes(name,state)``); ``*`` is every field. Inside a repeated field a path applies to each
element. Names are the JSON (camelCase) ones, or the proto (snake_case) ones. A path that names no field of the
response is an error (400 INVALID_ARGUMENT), as the API answers it. Sources: Google Cloud's client libraries
document the header for large list responses (`google::cloud::FieldMaskOption`, cloud.google.com/cpp/docs/
reference/common/latest/structgoogle_1_1cloud_1_1FieldMaskOption); the API's system parameters page documents
``fields`` and ``X-Goog-FieldMask`` for every API.
"""

from __future__ import annotations

import re
from typing import Any

from orchestrator.emulator.errors import invalid

Tree = dict[str, "Tree | None"]  # a field's sub-mask; None: the whole field

_TOKEN = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*|\*|[.,()])")


def parse(mask: str) -> Tree | None:
    """The mask as a tree of field names; None if it asks for everything (``*`` or empty)."""
    tokens = _tokens(mask)
    if not tokens or tokens == ["*"]:
        return None
    tree, at = _list(tokens, 0, mask)
    if at != len(tokens):
        raise invalid(f"Invalid field mask {mask!r}: unexpected {tokens[at]!r}")
    return tree


def check(tree: Tree | None, descriptor: Any, mask: str) -> None:
    """Every path of `tree` names a field of the message `descriptor` (a protobuf Descriptor); else 400."""
    if tree is None:
        return
    for name, sub in tree.items():
        field = _field(descriptor, name)
        if field is None:
            raise invalid(f"Invalid field mask {mask!r}: {descriptor.name} has no field {name!r}")
        if sub is not None:
            if field.message_type is None:
                raise invalid(f"Invalid field mask {mask!r}: {descriptor.name}.{name} has no fields of its own")
            check(sub, field.message_type, mask)


def apply(payload: Any, tree: Tree | None, descriptor: Any) -> Any:
    """`payload` (the response's JSON) with only the fields `tree` names (`descriptor` None: names as JSON has them)."""
    if tree is None:
        return payload
    if isinstance(payload, list):
        return [apply(x, tree, descriptor) for x in payload]
    if not isinstance(payload, dict):
        return payload
    out = {}
    for name, sub in tree.items():
        field = _field(descriptor, name)
        key = field.json_name if field is not None else name
        if key in payload:
            out[key] = apply(payload[key], sub, field.message_type if field is not None else None)
    return out


def _field(descriptor: Any, name: str) -> Any:
    if descriptor is None:
        return None
    return next((f for f in descriptor.fields if name in (f.json_name, f.name)), None)


def _tokens(mask: str) -> list[str]:
    tokens, at = [], 0
    while at < len(mask.rstrip()):
        m = _TOKEN.match(mask, at)
        if m is None:
            raise invalid(f"Invalid field mask {mask!r}: cannot read it at {mask[at:]!r}")
        tokens.append(m.group(1))
        at = m.end()
    return tokens


def _list(tokens: list[str], at: int, mask: str) -> tuple[Tree, int]:
    tree: Tree = {}
    while True:
        at = _path(tokens, at, tree, mask)
        if at < len(tokens) and tokens[at] == ",":
            at += 1
            continue
        return tree, at


def _path(tokens: list[str], at: int, into: Tree, mask: str) -> int:
    if at >= len(tokens) or not (tokens[at] == "*" or tokens[at][0].isalpha() or tokens[at][0] == "_"):
        raise invalid(f"Invalid field mask {mask!r}: a field name expected")
    name = tokens[at]
    at += 1
    if name == "*":
        raise invalid(f"Invalid field mask {mask!r}: '*' only as the whole mask")
    if at < len(tokens) and tokens[at] == ".":
        sub = into.get(name, {})
        if sub is None:  # the whole field was asked for already
            return _path(tokens, at + 1, {}, mask)
        at = _path(tokens, at + 1, sub, mask)
        into[name] = sub
        return at
    if at < len(tokens) and tokens[at] == "(":
        sub_tree, at = _list(tokens, at + 1, mask)
        if at >= len(tokens) or tokens[at] != ")":
            raise invalid(f"Invalid field mask {mask!r}: ')' expected")
        prior = into.get(name, {})
        into[name] = None if prior is None else {**prior, **sub_tree}
        return at + 1
    into[name] = None
    return at
