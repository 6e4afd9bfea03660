"""Errors the emulator answers with, shaped like Google API errors on the wire.

A Google REST API answers a failed call with an HTTP status and a body
``{"error": {"code", "message", "status", "details": [ErrorInfo...]}}``;
``google.api_core.exceptions.from_http_response`` turns that into ``NotFound``,
``ServiceUnavailable``... and exposes the ErrorInfo ``reason``. The emulator builds
the same body so the client's own parsing is what the tests exercise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_DOMAIN = "tpu.googleapis.com"


class ApiError(Exception):
    """A failed API call: HTTP status, canonical status name, message, ErrorInfo reason."""

    def __init__(self, http: int, status: str, message: str, reason: str | None = None):
        self.http, self.status, self.message, self.reason = http, status, message, reason
        super().__init__(f"{http} {status}: {message}")

    def body(self) -> dict[str, Any]:
        err: dict[str, Any] = {"code": self.http, "message": self.message, "status": self.status}
        if self.reason:
            err["details"] = [
                {"@type": "type.googleapis.com/google.rpc.ErrorInfo", "reason": self.reason, "domain": _DOMAIN}
            ]
        return {"error": err}


@dataclass(frozen=True)
class ErrorKind:
    http: int
    status: str
    reason: str | None
    message: str  # may use {method} and {zone}


# The faults a test can inject by name. Messages follow the real service's wording
# closely enough that a log line reads like the real thing.
ERROR_KINDS: dict[str, ErrorKind] = {
    "unavailable": ErrorKind(503, "UNAVAILABLE", None, "The service is currently unavailable."),
    "rate_limited": ErrorKind(
        429, "RESOURCE_EXHAUSTED", "RATE_LIMIT_EXCEEDED", "Quota exceeded for quota metric 'Requests' (rate limit)."
    ),
    "internal": ErrorKind(500, "INTERNAL", None, "Internal error encountered."),
    "deadline": ErrorKind(504, "DEADLINE_EXCEEDED", None, "Deadline expired before operation could complete."),
    "quota": ErrorKind(
        429,
        "RESOURCE_EXHAUSTED",
        "QUOTA_EXCEEDED",
        "Quota limit 'TPUsPerProjectPerZone' has been exceeded in zone {zone}.",
    ),
    "permission": ErrorKind(
        403,
        "PERMISSION_DENIED",
        "IAM_PERMISSION_DENIED",
        "Permission 'tpu.{method}' denied on resource '//tpu.googleapis.com/{parent}' (or it may not exist).",
    ),
    "invalid": ErrorKind(400, "INVALID_ARGUMENT", "BAD_REQUEST", "Request contains an invalid argument."),
    "not_found": ErrorKind(404, "NOT_FOUND", None, "Resource '{parent}' was not found."),
}

# HTTP status -> kind, for the random transient errors given as codes (503, 429...).
TRANSIENT_BY_HTTP = {503: "unavailable", 429: "rate_limited", 500: "internal", 504: "deadline"}


def make_error(kind: str, *, method: str, zone: str, parent: str) -> ApiError:
    try:
        k = ERROR_KINDS[kind]
    except KeyError:
        raise ValueError(f"unknown error kind {kind!r}; known: {', '.join(ERROR_KINDS)}") from None
    return ApiError(k.http, k.status, k.message.format(method=method, zone=zone, parent=parent), k.reason)


def not_found(what: str) -> ApiError:
    return ApiError(404, "NOT_FOUND", f"Resource '{what}' was not found", "RESOURCE_NOT_FOUND")


def no_such_host(node_id: str, host: int, hosts: int) -> ApiError:
    return ApiError(404, "NOT_FOUND", f"slice {node_id} has no host {host}; its hosts are 0 to {hosts - 1}",
                    "RESOURCE_NOT_FOUND")


def already_exists(what: str) -> ApiError:
    return ApiError(409, "ALREADY_EXISTS", f"Resource '{what}' already exists", "RESOURCE_ALREADY_EXISTS")


def invalid(message: str) -> ApiError:
    return ApiError(400, "INVALID_ARGUMENT", message, "BAD_REQUEST")


def failed_precondition(message: str) -> ApiError:
    return ApiError(400, "FAILED_PRECONDITION", message, "FAILED_PRECONDITION")
