"""What the real TPU API refuses in a request: ids, labels, node fields, reservation names."""

from __future__ import annotations

import re

from google.cloud import tpu_v2

from orchestrator import catalog
from orchestrator.emulator.errors import invalid

ID_RE = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
LABEL_KEY_RE = re.compile(r"^[a-z][a-z0-9_-]{0,62}$")
LABEL_VALUE_RE = re.compile(r"^[a-z0-9_-]{0,63}$")
RESERVATION_RE = re.compile(r"^projects/[^/]+/locations/(?P<zone>[^/]+)/reservations/[^/]+$")


def validate_id(field: str, value: str) -> None:
    if not ID_RE.match(value or ""):
        raise invalid(f"{field} {value!r} must match {ID_RE.pattern}")


def validate_node(node_id: str, node: tpu_v2.Node) -> None:
    validate_id("nodeId", node_id)
    if not node.runtime_version:
        raise invalid("node.runtimeVersion is required")
    if node.accelerator_type not in catalog.CATALOG:
        raise invalid(f"accelerator type {node.accelerator_type!r} is not offered")
    for k, v in node.labels.items():
        if not LABEL_KEY_RE.match(k) or not LABEL_VALUE_RE.match(v):
            raise invalid(f"label {k}={v!r} is not a valid label (lowercase letters, digits, _ and -)")
