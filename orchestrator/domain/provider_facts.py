"""What sets one slice provider apart from another, stated once per provider as facts.

A job's `provider` (``local``: Ray nodes on this machine; ``gcp``: Cloud TPU queued resources)
names one `ProviderFacts` record here. The control plane asks the record (``facts(spec.provider)``)
and never compares provider names: a new provider is a new row, not a new branch in ten files.
The slice providers themselves live in `orchestrator.providers`; this table sits in the domain,
below them, so the job spec's own checks can read it too.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from orchestrator.errors import SpecError
from workers.notices import GCE_METADATA_URL


class ReportRoute(str, enum.Enum):
    """How a job's workers reach the controller with their reports (`orchestrator.control.group`)."""

    DIRECT = "direct"  # by the controller's actor name: the host shares this machine's installation
    INBOX = "inbox"  # through the controller's inbox actor: the host cannot load the controller's class


@dataclass(frozen=True)
class ProviderFacts:
    name: str  # the job file's `provider`
    poll_interval_s: float  # how often a request waiting for its slice is looked at
    # Its slices are hosts on this machine, so the machine's host count (`LocalProvider.max_hosts`)
    # bounds what a job may hold, and the jobs waiting for them stand in one line.
    limited_by_local_hosts: bool
    # A refusal for capacity is answered here, by the admission queue (the hosts free up when a local
    # job ends); else only the cloud knows when it has room, and the job asks it again after a backoff.
    queues_capacity_locally: bool
    # The hosts lack this machine's installation: the project and its pinned worker packages are shipped.
    ships_code: bool
    report_route: ReportRoute
    metadata_url: str | None  # where hosts long-poll for preemption notices when the spec names none
    # Its slices are resources in a cloud: cleanup deletes them there, adoption looks for strays there.
    owns_cloud_resources: bool
    needs_gcp_config: bool  # the spec's `gcp` section says where and how to get slices
    # The hosts share this machine's disk; else every file they share lives in Cloud Storage.
    hosts_share_disk: bool
    replays_capacity_trace: bool  # `capacity_trace` may stand in for the spot capacity
    zone: str | None  # the zone every slice is in, when there is one (else the spec's zones say)
    # A generation that has stepped starts the next one's worker process on each of its hosts, so a shrink from
    # memory or a relaunch on the same slices does not wait for processes to start (`orchestrator.control.spares`).
    # Off where the hosts are this machine's own processes: a spare doubles them, and its CPU is the jobs'.
    spare_workers: bool


PROVIDERS: dict[str, ProviderFacts] = {f.name: f for f in (
    ProviderFacts(name="local", poll_interval_s=0.2, limited_by_local_hosts=True, queues_capacity_locally=True,
                  ships_code=False, report_route=ReportRoute.DIRECT, metadata_url=None, owns_cloud_resources=False,
                  needs_gcp_config=False, hosts_share_disk=True, replays_capacity_trace=True, zone="local",
                  spare_workers=False),
    ProviderFacts(name="gcp", poll_interval_s=5.0, limited_by_local_hosts=False, queues_capacity_locally=False,
                  ships_code=True, report_route=ReportRoute.INBOX, metadata_url=GCE_METADATA_URL,
                  owns_cloud_resources=True, needs_gcp_config=True, hosts_share_disk=False,
                  replays_capacity_trace=False, zone=None, spare_workers=True),
)}


def facts(provider: str) -> ProviderFacts:
    """The facts of the provider named `provider`; SpecError (on the field `provider`) for an unknown name."""
    try:
        return PROVIDERS[provider]
    except KeyError:
        raise SpecError("<spec>", [("provider", f"unknown provider {provider!r}; valid: "
                                                  f"{', '.join(sorted(PROVIDERS))}")]) from None
