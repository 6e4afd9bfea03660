"""A multi-slice start on GCP waits on all its queued resources together, through the real TPU client.

The job's requests (`orchestrator.control.job.requests`) go through `GcpTpuProvider` and
google-cloud-tpu's REST transport to the emulator, whose zone has no capacity until the test gives
it to one queued resource (`Emulator.fill`): the second of the two. "Hosts joined Ray" is the
emulator's on_node_ready hook (`JoinedHosts`), so no Ray cluster is needed.
"""

from __future__ import annotations

import threading
import time

import pytest

from orchestrator.control.job.requests import Requests
from orchestrator.domain.spec import JobSpec
from orchestrator.emulator import Hooks, running_emulator
from orchestrator.errors import ProvisioningError
from orchestrator.providers.base import Slice
from orchestrator.providers.gcp import Polling
from orchestrator.state.events import EventKind, StateChange
from orchestrator.state.states import JobState, SliceState
from orchestrator.state.store import Store
from tests import waiting
from tests.integration.test_gcp_provider import PROJECT, ZONE_A, JoinedHosts, make_provider, qr_of

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def joined() -> JoinedHosts:
    return JoinedHosts()


@pytest.fixture
def emulator(joined):
    hooks = Hooks(on_node_ready=joined.ready, on_node_gone=joined.gone)
    with running_emulator(time_scale=0.002, seed=7, hooks=hooks) as emu:
        emu.stockout(ZONE_A)  # every queued resource waits for capacity until the test fills it
        yield emu


def two_spot_slices(tmp_path, *, autoscaled: bool) -> JobSpec:
    """2 x v4-8 spot on provider gcp (one zone); `autoscaled`: the cost policy's choice, which takes part."""
    raw = {"name": "two", "accelerator": "v4-8", "tier": "spot", "provider": "gcp",
           "gcp": {"project": PROJECT, "zones": [ZONE_A]},
           "workload": {"type": "lm", "steps": 20, "global_batch_size": 16, "seq_len": 16,
                        "model": {"d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64}},
           "checkpoint": {"interval_steps": 2, "directory": "gs://bucket/two"}}
    if autoscaled:
        raw |= {"autoscaling": {"accelerators": ["v4-8"], "max_slices": 2}, "deadline": "PT24H"}
        return JobSpec.from_dict(raw).moved("v4-8", "spot", slices=2)
    return JobSpec.from_dict(raw | {"slices": 2})


class Provisioning:
    """`Requests.provision_all` for job `two`, PROVISIONING, on the emulator: on its own thread, as the
    job's driver runs it, so that the test can give capacity meanwhile."""

    def __init__(self, tmp_path, emulator, joined, spec: JobSpec):
        self.store = Store(tmp_path / "state.db")
        self.store.create_job("two", spec.name, spec.model_dump(mode="json"))
        self.store.transition("two", JobState.PROVISIONING, "admitted")
        self.provider = make_provider(emulator, joined, zones=(ZONE_A,),
                                      polling=Polling(poll_s=0.02, capacity_wait_s=600, request_timeout_s=5))
        self.requests = Requests(self.store, "two", threading.Event(), self.transition)
        self.requests.use(self.provider)
        self.got: list[Slice] | None = None
        self.failed: ProvisioningError | None = None
        self._thread = threading.Thread(target=self._run, args=(spec,), daemon=True)
        self._thread.start()

    def transition(self, target: JobState, reason: str, *, data: StateChange | None = None) -> None:
        self.store.transition("two", target, reason, data=data)

    def _run(self, spec: JobSpec) -> None:
        deadline = time.monotonic() + 45
        try:
            self.got = self.requests.provision_all(spec, 1, 0, limit_s=None,
                                                   still_wanted=lambda s: time.monotonic() < deadline)
        except ProvisioningError as e:  # handed to the test, which raises it
            self.failed = e

    def result(self) -> list[Slice]:
        self._thread.join(timeout=50)
        if self.failed is not None:
            raise self.failed
        assert self.got is not None, "provision_all did not return (still waiting, or raised: see above)"
        return self.got

    def queued(self) -> bool:
        return self.store.job("two").state is JobState.QUEUED


def waits_for_capacity(emulator, name: str) -> bool:
    qr = qr_of(emulator, name)
    return qr is not None and qr["state"]["state"] == "WAITING_FOR_RESOURCES"


def test_an_autoscaled_spot_job_starts_on_the_second_queued_resource_when_it_fills_first(tmp_path, emulator, joined):
    asking = Provisioning(tmp_path, emulator, joined, two_spot_slices(tmp_path, autoscaled=True))
    waiting.wait_for(lambda: waits_for_capacity(emulator, "two-1") and waits_for_capacity(emulator, "two-1s1")
                     and asking.queued(), 20, "both queued resources waiting for capacity, the job QUEUED")
    emulator.fill("two-1s1")
    got = asking.result()
    assert [(s.name, s.state, len(s.hosts)) for s in got] == [("two-1s1", SliceState.READY, 1)]
    assert asking.provider.get("two-1").state is SliceState.RELEASED
    waiting.wait_for(lambda: qr_of(emulator, "two-1") is None, 10, "the first queued resource deleted")
    assert any(e.reason.startswith("1 of 2 slices could be had now") for e in asking.store.events("two")
               if e.kind is EventKind.AUTOSCALE)
    assert asking.store.job("two").state is JobState.PROVISIONING
    asking.provider.release("two-1s1")


def test_an_all_or_none_job_takes_its_slices_in_slice_order_whichever_fills_first(tmp_path, emulator, joined):
    asking = Provisioning(tmp_path, emulator, joined, two_spot_slices(tmp_path, autoscaled=False))
    waiting.wait_for(lambda: waits_for_capacity(emulator, "two-1") and waits_for_capacity(emulator, "two-1s1")
                     and asking.queued(), 20, "both queued resources waiting for capacity, the job QUEUED")
    emulator.fill("two-1s1")
    waiting.wait_for(lambda: asking.provider.get("two-1s1").state is SliceState.READY, 20, "the second READY")
    assert asking.got is None and asking.queued()  # the first still waits for capacity: so does the job
    emulator.fill("two-1")
    got = asking.result()
    assert [(s.name, s.state) for s in got] == [("two-1", SliceState.READY), ("two-1s1", SliceState.READY)]
    assert asking.store.job("two").state is JobState.PROVISIONING
    for s in got:
        asking.provider.release(s.name)
