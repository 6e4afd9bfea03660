"""How this tool's slices are found in a project: labels, reading them back, and collecting leaks.

Every node this tool makes carries the labels ``managed-by=tpu-orchestrator``,
``orchestrator-job=<job>`` and ``orchestrator-slice=<slice>``; that is how `list` and
`collect_leaked` find what it made (a queued resource has no labels of its own in API v2,
its node spec does). Nothing without ``managed-by`` is ever deleted by name or by gc.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from orchestrator import catalog
from orchestrator.catalog import Tier, TpuType
from orchestrator.errors import ProvisioningError
from orchestrator.providers.base import Slice, SliceRequest
from orchestrator.providers.gcp.api import QRS, TpuApi
from orchestrator.providers.gcp.states import Seen, slice_state
from orchestrator.state.states import SliceState

log = logging.getLogger(__name__)

MANAGED_BY_KEY, MANAGED_BY = "managed-by", "tpu-orchestrator"
JOB_KEY, SLICE_KEY = "orchestrator-job", "orchestrator-slice"


def label_value(s: str) -> str:
    """`s` as a GCP label value: lowercase letters, digits, - and _, at most 63 characters."""
    return re.sub(r"[^a-z0-9_-]", "-", s.lower())[:63]


def labels_for(req: SliceRequest) -> dict[str, str]:
    """The node labels of a slice: the request's own, then ours (which win)."""
    labels = {label_value(k): label_value(v) for k, v in req.labels.items()}
    labels.update({MANAGED_BY_KEY: MANAGED_BY, JOB_KEY: label_value(req.job_id), SLICE_KEY: label_value(req.name)})
    return labels


def node_labels(found: Any, kind: str) -> Mapping[str, str]:
    """The labels of a queued resource (its node spec's) or of a node."""
    if kind == "node":
        return found.labels
    return found.tpu.node_spec[0].node.labels if found.tpu.node_spec else {}


def is_managed(labels: Mapping[str, str]) -> bool:
    return labels.get(MANAGED_BY_KEY) == MANAGED_BY


def slice_from_api(zone: str, qr: Any, node: Any, *, provider: str) -> Slice | None:
    """A slice this tool made, read from its queued resource and node (either may be None),
    as a provider that does not follow it sees it; None if it is not ours or not readable."""
    spec = qr.tpu.node_spec[0].node if qr is not None and qr.tpu.node_spec else node
    if spec is None or not is_managed(spec.labels):
        return None
    name = (qr or node).name.rsplit("/", 1)[1]
    try:
        tpu_type: TpuType = catalog.lookup(spec.accelerator_type)
    except ValueError:
        log.warning("slice %s in %s has unknown accelerator type %s", name, zone, spec.accelerator_type)
        return None
    tier = Tier.SPOT if qr is not None and "spot" in qr else Tier.ON_DEMAND
    if qr is not None and qr.reservation_name:
        tier = Tier.RESERVED
    # A node without a queued resource reads as one whose queued resource is ACTIVE.
    seen = Seen(qr=qr.state.state.name if qr is not None else "ACTIVE",
                node=node.state.name if node is not None else None)
    if "DELETING" in (seen.qr, seen.node):
        state = SliceState.RELEASED  # on its way out already
    else:
        state = slice_state(seen, joined=True, was_up=False)
    created = (qr or node).create_time
    return Slice(name, spec.labels.get(JOB_KEY, ""), tpu_type, tier, zone, state, (), provider,
                 created.timestamp() if created else time.time())


def find_ours(api: TpuApi, zones: Sequence[str], *, provider: str) -> Iterator[tuple[str, str, Slice]]:
    """(zone, "qr" or "node", slice) for every queued resource, and every node without one,
    that this tool made in `zones`."""
    for zone in zones:
        parent = api.parent(zone)
        qrs, nodes = api.list_zone(zone)
        for qr in qrs:
            s = slice_from_api(zone, qr, nodes.get(f"{parent}/nodes/{qr.name.rsplit('/', 1)[1]}"), provider=provider)
            if s is not None:
                yield zone, "qr", s
        for node in nodes.values():  # nodes made without a queued resource, or orphaned
            if not node.queued_resource and is_managed(node.labels):
                s = slice_from_api(zone, None, node, provider=provider)
                if s is not None:
                    yield zone, "node", s


def labelled_ours(api: TpuApi, zone: str, kind: str, name: str) -> bool:
    """Whether the queued resource or node `name` in `zone` exists and carries our label
    (a node of a queued resource does not count: it goes with its queued resource)."""
    found = api.get(zone, kind, name)
    if found is None:
        return False
    if kind == "node" and found.queued_resource:
        return False  # deleted with its queued resource
    return is_managed(node_labels(found, kind))


def made_for(api: TpuApi, zone: str, req: SliceRequest) -> bool:
    """Whether the existing queued resource named like `req` was made by this tool for its job
    (a create whose first try landed); a transient ProvisioningError if that one is on its way out."""
    name = api.full_name(zone, "qr", req.name)
    qr = api.call(f"get {name}", zone, api.client.get_queued_resource, name=name)
    labels = node_labels(qr, "qr")
    mine = labels.get(JOB_KEY) == label_value(req.job_id) and is_managed(labels)
    if mine and qr.state.state in (QRS.DELETING, QRS.FAILED, QRS.SUSPENDED):
        raise ProvisioningError(f"slice {req.name}: an earlier queued resource of that name in "
                                f"{api.project}/{zone} is still {qr.state.state.name}; retry later",
                                slice_name=req.name, transient=True)
    return mine


def collect_leaked(provider: Any, live_job_ids: set[str], *, dry_run: bool = False) -> list[str]:
    """Release every slice labelled by this tool whose job is not live; returns their names.

    Works with any `SliceProvider` whose `list()` reports the slices it made (for GCP:
    every queued resource and node labelled ``managed-by=tpu-orchestrator`` in its zones).
    """
    live = set(live_job_ids) | {label_value(j) for j in live_job_ids}
    leaked = sorted({s.name for s in provider.list() if s.job_id not in live and s.state is not SliceState.RELEASED})
    for name in leaked:
        if dry_run:
            log.info("gc: would delete leaked slice %s", name)
        else:
            log.warning("gc: deleting leaked slice %s (its job is gone)", name)
            provider.release(name)
    return leaked
