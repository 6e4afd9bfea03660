"""pytest fixtures for Cloud Storage: one emulator process for the session, and this process pointed at it.

    def test_x(gcs):                       # this process's clients point at the emulator for the test
        storage.write_text(gcs.folder + "/a.txt", "hi")
        spec = {..., "checkpoint": {"directory": gcs.folder}, "storage": {"endpoint": gcs.url}}

`gcs_emulator` (session) is the `orchestrator.emulator.storage.StorageEmulator` with the
bucket `test-bucket`; it is stopped, its process ended, at the end of the session. A test
that only hands the endpoint to a job (whose processes configure themselves from the spec)
can take `gcs_emulator` alone and pass `endpoint=` to `workers.storage` calls.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

BUCKET = "test-bucket"


@dataclass(frozen=True)
class Gcs:
    url: str  # the emulator's endpoint
    folder: str  # gs://test-bucket/<test>-<random>: a folder no other test uses


@pytest.fixture(scope="session")
def gcs_emulator():
    from orchestrator.emulator.storage import running_storage

    with running_storage(buckets=(BUCKET,)) as emu:
        yield emu


def unique_folder(request) -> str:
    name = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower()).strip("-")[:40]
    return f"gs://{BUCKET}/{name}-{secrets.token_hex(3)}"


@pytest.fixture
def gcs(gcs_emulator, request) -> Iterator[Gcs]:
    """This process's storage clients pointed at the session's emulator for one test, and a fresh folder."""
    from workers import storage

    storage.configure(gcs_emulator.url)
    try:
        yield Gcs(url=gcs_emulator.url, folder=unique_folder(request))
    finally:
        storage.configure(None)
