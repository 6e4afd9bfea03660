"""What a job's loop needs of the controller that runs it: a narrow surface, so the loop can be
driven by a test's world (`tests/unit/driver_world.py`) as by the real `Controller`."""

from __future__ import annotations

from typing import Protocol

from orchestrator.cluster.home import Home
from orchestrator.control.queue import AdmissionQueue
from orchestrator.control.store_faults import HeldWrites, StoreHealth
from orchestrator.domain.spec import JobSpec
from orchestrator.providers.base import SliceProvider
from orchestrator.state.store import Store


class LocalHosts(Protocol):
    """The provider of this machine's hosts: how many a job may hold at once."""

    max_hosts: int


class JobServices(Protocol):
    @property
    def store(self) -> Store: ...  # the store itself (reports go through `held`; the loop's own writes wait)

    @property
    def store_health(self) -> StoreHealth: ...

    @property
    def held(self) -> HeldWrites: ...  # the store's one writer: every write, in order, many a transaction

    @property
    def home(self) -> Home: ...

    @property
    def queue(self) -> AdmissionQueue: ...

    @property
    def provider(self) -> LocalHosts: ...

    def provider_for(self, spec: JobSpec) -> SliceProvider: ...
