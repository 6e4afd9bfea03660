"""Cloud TPU slices through queued resources (TPU API v2): request, follow, release, collect leaks.

One slice is one queued resource with one node, both named after the slice, whose
``startup-script`` (see `orchestrator.providers.startup`) joins the hosts to the Ray
cluster. The package, by subject:

    provider.py  GcpTpuProvider: a slice's lifecycle (request, wait_ready, release, poll_events, list)
    states.py    what the API's queued-resource and node states mean as slice states and events
    api.py       the tpu_v2 client: retries with backoff, API errors as CloudApiError
    zones.py     the zone order, the fall-through when a zone has no capacity, reservations per zone
    gc.py        the labels that mark what this tool made, finding it again, collect_leaked
    join.py      when a slice's hosts count as joined to the Ray cluster
"""

from orchestrator.providers.gcp.api import CloudApiError, RetryPolicy
from orchestrator.providers.gcp.gc import JOB_KEY, MANAGED_BY, MANAGED_BY_KEY, SLICE_KEY, collect_leaked, label_value
from orchestrator.providers.gcp.join import JoinCheck, ray_join_check
from orchestrator.providers.gcp.pace import Polling
from orchestrator.providers.gcp.provider import DEFAULT_RUNTIMES, GcpTpuProvider
from orchestrator.providers.gcp.zones import NoCapacityError

__all__ = ["DEFAULT_RUNTIMES", "JOB_KEY", "MANAGED_BY", "MANAGED_BY_KEY", "SLICE_KEY", "CloudApiError",
           "GcpTpuProvider", "JoinCheck", "NoCapacityError", "Polling", "RetryPolicy", "collect_leaked", "label_value",
           "ray_join_check"]
