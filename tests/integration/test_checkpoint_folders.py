"""One checkpoint folder belongs to one job identity, through the real controller (issue 24, item 4).

The refusals and the set-aside are unit-tested against a real store and folder
(tests/unit/test_ownership.py); here the same rules hold for a user of the Python API on a
real cluster: two submits at the same moment, a resubmit of a finished run, a resubmit with
another learning rate.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from orchestrator import JobState
from orchestrator.errors import FolderInUseError, FolderMismatchError
from orchestrator.state.events import EventKind
from tests.integration.test_local_jobs import tiny_spec


def test_one_folder_one_run_and_a_finished_run_says_so(client, tmp_path):
    spec = tiny_spec("owned", "v4-8", tmp_path, steps=4, interval=2)
    folder = spec.checkpoint.directory
    with ThreadPoolExecutor(2) as pool:  # the same job submitted twice at the same moment
        futures = [pool.submit(client.submit, spec) for _ in range(2)]
    outcomes = []
    for f in futures:
        try:
            outcomes.append(f.result())
        except FolderInUseError as e:
            outcomes.append(e)
    (refused,) = [o for o in outcomes if isinstance(o, FolderInUseError)]
    (job,) = [o for o in outcomes if not isinstance(o, Exception)]
    assert refused.other_job == job.id and f"in use by job {job.id}" in str(refused)
    first = job.wait(timeout_s=300)
    assert (first.state, first.reason, first.step) == (JobState.SUCCEEDED, "training finished", 4)

    again = client.submit(spec)  # the same run once more: nothing to train, and it says so
    st = again.wait(timeout_s=300)
    assert st.state is JobState.SUCCEEDED
    assert st.reason == (f"resumed a finished run: step 4 of 4 was already committed in {folder}; nothing to train "
                         "(to train again from step 0, submit with --fresh)")
    assert st.step == 4 and again.metrics() == []  # status shows 4/4, and no step of its own
    (claimed,) = [e for e in again.events() if e.kind is EventKind.FOLDER]
    assert claimed.payload.action == "resume" and claimed.payload.previous_job == job.id
    # Said before anything was provisioned or restored: no slice, no launch.
    assert not [e for e in again.events() if e.kind in (EventKind.RESTORE, EventKind.LAUNCHED)], again.events()
    assert client.store.slices(job_id=again.id) == []

    jobs = len(client.jobs())
    other = tiny_spec("owned", "v4-8", tmp_path, steps=4, interval=2, workload={
        **spec.workload.model_dump(mode="json"), "learning_rate": {"peak": 1e-3, "warmup_steps": 2}})
    with pytest.raises(FolderMismatchError) as mismatch:
        client.submit(other)
    assert mismatch.value.differences == [("workload.learning_rate.peak", 3e-3, 1e-3)]
    assert mismatch.value.owner == again.id and len(client.jobs()) == jobs  # nothing recorded
