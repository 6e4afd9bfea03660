"""Where this process's storage clients go: an emulator's endpoint or Google's (`workers.storage` uses them).

gcsfs, google-cloud-storage and tensorstore each read their own settings, some from the environment and some
cached in file systems made before; `configure` sets them all at once and drops what was cached, and
`gcs_client` keeps one google-cloud-storage client per endpoint.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

# What makes each client talk to an emulator (see orchestrator.emulator.storage for the table).
_ENDPOINT_VARS = ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL", "GOOGLE_AUTH_TOKEN_FOR_TESTING",
                  "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT")


def normal_endpoint(endpoint: str) -> str:
    """``http://host:port`` without a trailing slash (``host:port`` alone, as STORAGE_EMULATOR_HOST allows, is http)."""
    endpoint = endpoint.strip().rstrip("/")
    return endpoint if "://" in endpoint else f"http://{endpoint}"


def endpoint_env(endpoint: str) -> dict[str, str]:
    """The environment that points gcsfs, google-cloud-storage and tensorstore at `endpoint` (an emulator)."""
    endpoint = normal_endpoint(endpoint)
    return {
        "STORAGE_EMULATOR_HOST": endpoint,  # gcsfs, google-cloud-storage
        "TENSORSTORE_GCS_HTTP_URL": endpoint,  # tensorstore (orbax's arrays)
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator",  # tensorstore: a bearer token instead of looking for credentials
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",  # gcsfs: no Storage Control gRPC probe (no emulator has it)
    }


_emulated: list[str] = []  # the endpoint `configure` set in fsspec's defaults, if any


def configure(endpoint: str | None) -> None:
    """Point this process's storage clients at `endpoint` (an emulator's URL), or at Google's (None).

    Call before the process first touches a bucket: tensorstore reads its settings when it
    opens a gs:// store (one opened before keeps the endpoint it had), gcsfs and etils.epath
    cache their file systems (dropped here, so the next use gets the new setting).
    """
    import fsspec

    endpoint = normal_endpoint(endpoint) if endpoint else None
    if endpoint:
        os.environ.update(endpoint_env(endpoint))
    else:
        for name in _ENDPOINT_VARS:
            os.environ.pop(name, None)
    for protocol in ("gs", "gcs"):  # fsspec's defaults for gcsfs, merged into what the user may have set
        conf = fsspec.config.conf.setdefault(protocol, {})
        conf["use_listings_cache"] = False  # others write where this process lists
        if endpoint:
            conf.update(token="anon", endpoint_url=endpoint)
        elif _emulated:
            for key in ("token", "endpoint_url"):
                conf.pop(key, None)
    _emulated[:] = [endpoint] if endpoint else []
    if endpoint:  # the plain GCSFileSystem, also when gcsfs was imported before the variable was set
        from gcsfs.core import GCSFileSystem

        for protocol in ("gs", "gcs"):
            fsspec.register_implementation(protocol, GCSFileSystem, clobber=True)
    _forget_clients()


def configure_from_environment() -> None:
    """`configure` for the emulator ``STORAGE_EMULATOR_HOST`` names, unless this process already is: that one
    variable is all gcsfs and google-cloud-storage need, but tensorstore (orbax's reads and writes) reads its own
    and without it goes to Google's servers, waiting on credentials this machine does not have."""
    host = os.environ.get("STORAGE_EMULATOR_HOST")
    if host and _emulated != [normal_endpoint(host)]:
        configure(host)


def _forget_clients() -> None:
    """Drop cached clients made with the old settings (gcsfs instances, etils.epath's, our own)."""
    _gcs_clients.clear()
    if "gcsfs" in sys.modules:
        from gcsfs.core import GCSFileSystem

        GCSFileSystem.clear_instance_cache()
        for cls in type.__subclasses__(GCSFileSystem):
            cls.clear_instance_cache()
    if "etils.epath" in sys.modules:
        from etils.epath import backend

        with contextlib.suppress(AttributeError):
            backend.fsspec_backend._get_filesystem.cache_clear()


_gcs_clients: dict[str | None, Any] = {}


def gcs_client(endpoint: str | None):
    """A google-cloud-storage client: for `endpoint` (an emulator, anonymous), else this process's setting."""
    endpoint = endpoint or os.environ.get("STORAGE_EMULATOR_HOST") or None
    endpoint = normal_endpoint(endpoint) if endpoint else None
    client = _gcs_clients.get(endpoint)
    if client is None:
        from google.cloud import storage as gcs

        if endpoint:
            from google.auth.credentials import AnonymousCredentials

            client = gcs.Client(project="emulator", credentials=AnonymousCredentials(),
                                client_options={"api_endpoint": endpoint})
        else:
            client = gcs.Client()  # application default credentials: on a TPU VM its service account
        _gcs_clients[endpoint] = client
    return client
