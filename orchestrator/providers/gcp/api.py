"""The TPU API v2 as this provider calls it: the client, retries, and its errors as ours.

Every call goes through `TpuApi.call`, which retries transient failures (429 that is a
request rate, 5xx, deadline, connection) with exponential backoff and jitter, and turns
whatever is left into a `CloudApiError` naming the project, the zone and the API's own
reason. The client always speaks REST, against the real API as against the emulator, so
the code path the tests exercise is the one that runs in production.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import requests
import tenacity
from google.api_core import exceptions as gexc
from google.api_core.client_options import ClientOptions
from google.cloud import tpu_v2
from requests.adapters import HTTPAdapter

from orchestrator.errors import ProvisioningError
from orchestrator.providers.gcp.pace import CreatePace

log = logging.getLogger(__name__)

T = TypeVar("T")
QRS = tpu_v2.QueuedResourceState.State
CLOUD_PLATFORM = "https://www.googleapis.com/auth/cloud-platform"

# What a look at a slice reads of a zone's listing (`looks.seen_of`), as field masks (`X-Goog-FieldMask`: Google's
# APIs answer only the fields it names). Each queued resource and node otherwise carries its whole spec with the
# startup script, about 4 KB apiece: 8 MB a listing at 1,000 slices, for 0.3 MB of states.
BRIEF_QRS = "queuedResources(name,state),nextPageToken"
BRIEF_NODES = "nodes(name,state,networkEndpoints.ipAddress),nextPageToken"

_TRANSIENT_HTTP = frozenset({429, 500, 502, 503, 504})
# A 429 that is a resource quota, not a request rate: waiting seconds will not free it.
_PERMANENT_REASONS = frozenset({"QUOTA_EXCEEDED"})


class CloudApiError(ProvisioningError):
    """A TPU API call failed; names the project, zone and the API's own reason."""

    def __init__(self, *, action: str, project: str, zone: str, code: int | None, reason: str, message: str,
                 transient: bool, slice_name: str | None = None):
        self.action, self.project, self.zone = action, project, zone
        self.code, self.reason, self.api_message = code, reason, message
        kind = "transient, gave up after retries" if transient else "permanent, not retried"
        super().__init__(
            f"{action} in project {project}, zone {zone} failed: HTTP {code} {reason}: {message} ({kind})",
            slice_name=slice_name, transient=transient,
        )


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter for transient API errors (429, 5xx, deadline, connection)."""

    attempts: int = 6
    initial_s: float = 1.0
    max_s: float = 30.0
    total_s: float = 120.0


class TpuApi:
    """The queued resources and nodes of one project, through `tpu_v2.TpuClient` over REST.

    A kind is ``"qr"`` (a queued resource) or ``"node"``; names are short (the slice's).
    """

    def __init__(self, project: str, *, endpoint: str | None, credentials: Any, impersonate: str | None,
                 retry: RetryPolicy, request_timeout_s: float, sleep: Callable[[float], None],
                 pace: CreatePace | None = None, connections: int = 10):
        self.project = project
        self._retry, self._timeout_s, self._sleep = retry, request_timeout_s, sleep
        self.pace = pace or CreatePace(None)  # the project's creates a minute, shared by the providers of one
        self.client = tpu_v2.TpuClient(
            credentials=_credentials(credentials, impersonate, endpoint), transport="rest",
            client_options=ClientOptions(api_endpoint=endpoint) if endpoint else None,
        )
        _keep_connections(self.client, connections)

    def parent(self, zone: str) -> str:
        return f"projects/{self.project}/locations/{zone}"

    def full_name(self, zone: str, kind: str, name: str) -> str:
        return f"{self.parent(zone)}/{'queuedResources' if kind == 'qr' else 'nodes'}/{name}"

    def call(self, action: str, zone: str, fn: Callable[..., T], *, slice_name: str | None = None,
             **kwargs: Any) -> T:
        """`fn(**kwargs)`, retrying transient errors with exponential backoff and jitter."""
        p = self._retry

        def before_sleep(rs: tenacity.RetryCallState) -> None:
            assert rs.outcome is not None, "tenacity sleeps only after a failed attempt"
            log.warning("%s in %s/%s: %s; retry %d/%d in %.2fs", action, self.project, zone,
                        _describe(rs.outcome.exception()), rs.attempt_number, p.attempts - 1, rs.upcoming_sleep)

        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(is_transient),
            stop=tenacity.stop_after_attempt(p.attempts) | tenacity.stop_after_delay(p.total_s),
            wait=tenacity.wait_exponential_jitter(multiplier=p.initial_s, max=p.max_s, jitter=p.initial_s),
            sleep=self._sleep,
            reraise=True,
            before_sleep=before_sleep,
        )
        try:
            return retrying(fn, timeout=self._timeout_s, **kwargs)
        except gexc.GoogleAPICallError as e:
            raise CloudApiError(action=action, project=self.project, zone=zone, code=e.code,
                                reason=e.reason or type(e).__name__, message=e.message,
                                transient=is_transient(e), slice_name=slice_name) from e
        except (requests.ConnectionError, requests.Timeout) as e:
            raise CloudApiError(action=action, project=self.project, zone=zone, code=None,
                                reason=type(e).__name__, message=str(e), transient=True,
                                slice_name=slice_name) from e

    def get(self, zone: str, kind: str, name: str) -> Any | None:
        """The queued resource or node, or None if there is none (404)."""
        full = self.full_name(zone, kind, name)
        fn = self.client.get_queued_resource if kind == "qr" else self.client.get_node
        try:
            return self.call(f"get {full}", zone, fn, name=full)
        except CloudApiError as e:
            if e.code == 404:
                return None
            raise

    def create_queued_resource(self, zone: str, name: str, qr: tpu_v2.QueuedResource) -> None:
        waited = self.pace.wait()  # the project's create quota, before the call rather than a 429 after it
        if waited > 1.0:
            log.info("create queued resource %s waited %.1fs for the project's create pace (%g a minute)", name,
                     waited, self.pace.per_minute)
        self.call(f"create queued resource {name}", zone, self.client.create_queued_resource,
                  parent=self.parent(zone), queued_resource_id=name, queued_resource=qr, slice_name=name)

    def delete(self, zone: str, kind: str, name: str) -> None:
        """Delete the queued resource (with its nodes: force) or the node; already gone is fine."""
        full = self.full_name(zone, kind, name)
        try:
            if kind == "qr":
                self.call(f"delete queued resource {name}", zone, self.client.delete_queued_resource,
                          request=tpu_v2.DeleteQueuedResourceRequest(name=full, force=True), slice_name=name)
            else:
                self.call(f"delete node {name}", zone, self.client.delete_node, name=full, slice_name=name)
        except CloudApiError as e:
            if e.code != 404:  # already gone is what we wanted
                raise

    def list_zone(self, zone: str, *, states_only: bool = False) -> tuple[list[Any], dict[str, Any]]:
        """Every queued resource of the zone, and every node by its full name. `states_only`: with only the
        fields a look reads (`BRIEF_QRS`, `BRIEF_NODES`), not their specs."""
        parent = self.parent(zone)
        nodes = {n.name: n for n in self.call(f"list nodes of {parent}", zone, _all(self.client.list_nodes),
                                              parent=parent, metadata=_mask(BRIEF_NODES if states_only else None))}
        qrs = self.call(f"list queued resources of {parent}", zone, _all(self.client.list_queued_resources),
                        parent=parent, metadata=_mask(BRIEF_QRS if states_only else None))
        return qrs, nodes


def queued_resource(parent: str, node_id: str, *, accelerator_type: str, runtime_version: str,
                    labels: Mapping[str, str], startup_script: str, service_account: str | None,
                    tier: Mapping[str, Any], valid_for_s: float | None = None) -> tpu_v2.QueuedResource:
    """The queued resource of one slice: one node `node_id` in `parent` with its image, labels
    and startup script, asked for on `tier` (the fields of `zones.tier_fields`). `valid_for_s`:
    how long it may wait for capacity (`queueingPolicy.validUntilDuration`), so an unfilled
    request expires in the cloud even when no controller is left to delete it."""
    node = tpu_v2.Node(accelerator_type=accelerator_type, runtime_version=runtime_version, labels=dict(labels),
                       metadata={"startup-script": startup_script})
    if service_account:
        node.service_account = tpu_v2.ServiceAccount(email=service_account, scope=[CLOUD_PLATFORM])
    spec = tpu_v2.QueuedResource.Tpu.NodeSpec(parent=parent, node_id=node_id, node=node)
    qr = tpu_v2.QueuedResource(tpu=tpu_v2.QueuedResource.Tpu(node_spec=[spec]), **tier)
    if valid_for_s is not None:
        qr.queueing_policy = tpu_v2.QueuedResource.QueueingPolicy(
            valid_until_duration=dt.timedelta(seconds=max(1.0, valid_for_s)))
    return qr


def _keep_connections(client: tpu_v2.TpuClient, n: int) -> None:
    """Keep up to `n` HTTP connections of `client` open for reuse (`Polling.connections`). The REST transport
    makes its own `requests` session and offers no way to size its pool, so its adapters are replaced."""
    session = getattr(client.transport, "_session", None)
    if not isinstance(session, requests.Session):  # a client version that holds its session elsewhere
        log.warning("the TPU API client keeps no requests session where expected; its connection pool stays at "
                    "requests' default size")
        return
    for prefix, adapter in list(session.adapters.items()):
        if type(adapter) is HTTPAdapter:  # an mTLS adapter (client certificates) is left as it is
            session.mount(prefix, HTTPAdapter(pool_connections=n, pool_maxsize=n, max_retries=adapter.max_retries))


def is_transient(e: BaseException) -> bool:
    if isinstance(e, (requests.ConnectionError, requests.Timeout)):
        return True
    if isinstance(e, gexc.GoogleAPICallError):
        return e.code in _TRANSIENT_HTTP and e.reason not in _PERMANENT_REASONS
    return False


def _mask(fields: str | None) -> tuple[tuple[str, str], ...]:
    """A call's metadata (its HTTP headers over REST) that asks for only `fields`; None: every field."""
    return (("x-goog-fieldmask", fields),) if fields else ()


def _all(list_method: Callable[..., Any]) -> Callable[..., list[Any]]:
    """A list call that reads every page, so a retry covers the later pages too."""
    return lambda **kwargs: list(list_method(**kwargs))


def _describe(e: BaseException | None) -> str:
    if isinstance(e, gexc.GoogleAPICallError):
        return f"HTTP {e.code} {e.reason or type(e).__name__}: {e.message}"
    return f"{type(e).__name__}: {e}"


def _credentials(credentials: Any, impersonate: str | None, endpoint: str | None) -> Any:
    """The credentials to call the API with. Never logged: a token in a log is a leaked token."""
    if credentials is None:
        if endpoint and endpoint.startswith(("http://127.", "http://localhost", "http://[::1]")):
            from google.auth.credentials import AnonymousCredentials

            credentials = AnonymousCredentials()  # the local emulator has no auth
        else:
            import google.auth

            credentials, _ = google.auth.default(scopes=[CLOUD_PLATFORM])
    if impersonate:
        from google.auth import impersonated_credentials

        credentials = impersonated_credentials.Credentials(
            source_credentials=credentials, target_principal=impersonate, target_scopes=[CLOUD_PLATFORM])
    return credentials
