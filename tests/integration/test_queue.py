"""The admission queue on a real local cluster: jobs that cannot get hosts wait QUEUED, in order.

The controller's pool is cut to two local hosts for these tests, so two one-host jobs
hold the machine while the others wait.
"""

from __future__ import annotations

import pytest
import ray

from orchestrator import JobState
from orchestrator.control.queue import queue_position
from tests.integration.test_local_jobs import tiny_spec
from tests.waiting import wait_for


def _entered(job, state: JobState) -> float:
    return next(e.at for e in job.events() if e.kind == "state" and e.to_state == state.value)


@pytest.fixture
def two_hosts(client):
    ctrl = client.controller()
    ray.get(ctrl.set_local_hosts.remote(2))
    yield client
    ray.get(ctrl.set_local_hosts.remote(8))


def test_jobs_wait_queued_for_hosts_without_failing_and_start_in_order(two_hosts, tmp_path):
    client = two_hosts
    holders = [client.submit(tiny_spec(f"hold-{i}", "v4-8", tmp_path, steps=60, interval=30)) for i in range(2)]
    wait_for(lambda: all(h.status().state is JobState.RUNNING for h in holders), 300, "the holders to run")

    big = client.submit(tiny_spec("big", "v4-16", tmp_path, steps=6, interval=3))  # 2 hosts
    wait_for(lambda: big.status().state is JobState.QUEUED, 300, "the big job to queue")
    urgent = client.submit(tiny_spec("urgent", "v4-8", tmp_path, steps=6, interval=3, priority=5))
    impatient = client.submit(tiny_spec("impatient", "v4-8", tmp_path, steps=6, interval=3, queue_timeout="PT2S"))
    doomed = client.submit(tiny_spec("doomed", "v4-8", tmp_path, steps=6, interval=3))
    wait_for(lambda: all(j.status().state is JobState.QUEUED for j in (urgent, doomed)), 300, "all to queue")

    # The line: priority first, then submission time.
    store = client.store
    assert queue_position(store, urgent.record()) == 1
    assert queue_position(store, big.record()) == 2
    wait_for(lambda: urgent.status().reason == "first in the queue; needs 1 host, 0 of 2 free (the others are "
             "held by running jobs)", 300, "urgent's reason")
    wait_for(lambda: big.status().reason.startswith(f"position 2 in the queue, behind {urgent.id} (priority 5)"),
             300, "big's reason")
    doomed.cancel()  # a queued job can be cancelled
    assert doomed.wait(timeout_s=60).state is JobState.CANCELLED
    st = impatient.wait(timeout_s=120)  # waited past its queue_timeout: FAILED, saying why
    assert st.state is JobState.FAILED and "queue_timeout" in st.reason and st.failures == 0

    for job in (*holders, urgent, big):
        st = job.wait(timeout_s=600)
        assert st.state is JobState.SUCCEEDED, (job.id, st.reason)
    assert urgent.record().failures == 0 and big.record().failures == 0  # waiting spent no failure budget
    assert _entered(urgent, JobState.PROVISIONING) < _entered(big, JobState.PROVISIONING)  # priority went first
    assert not [e for e in big.events() if (e.data or {}).get("outcome") == "provision_failed"]
