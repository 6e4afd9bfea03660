"""Cloud TPU slices through queued resources (TPU API v2)."""

from orchestrator.providers.gcp.provider import (DEFAULT_RUNTIMES, JOB_KEY, MANAGED_BY, MANAGED_BY_KEY, SLICE_KEY,
                                                 CloudApiError, GcpTpuProvider, JoinCheck, NoCapacityError, Polling,
                                                 RetryPolicy, collect_leaked, label_value, ray_join_check)

__all__ = ["DEFAULT_RUNTIMES", "JOB_KEY", "MANAGED_BY", "MANAGED_BY_KEY", "SLICE_KEY", "CloudApiError", "GcpTpuProvider",
           "JoinCheck", "NoCapacityError", "Polling", "RetryPolicy", "collect_leaked", "label_value", "ray_join_check"]
