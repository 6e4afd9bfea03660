"""A Python API user's terminal during a host loss: the job's own story, none of Ray's messages.

The user's program runs in a process of its own (a driver of the session's cluster), trains a
2-host job, and a host is removed under it. Ray publishes the node's death to every driver
("(raylet) The node with node id ... has been marked dead"); it goes to the state
directory's logs/driver.log, not to the program's output.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from tests.conftest import REPO
from tests.integration.test_local_jobs import tiny_spec

PROGRAM = textwrap.dedent("""
    import json, sys, time
    from orchestrator import Client, JobSpec
    from orchestrator.cluster import kill_host

    client = Client()
    job = client.submit(JobSpec.from_dict(json.loads(sys.argv[1])))
    while job.status().step < 3 and not job.status().done:
        time.sleep(0.1)
    live = client.store.slices(job_id=job.id, live_only=True)
    kill_host(client.home, live[0].data["pgids"][1])
    log = client.home.root / "logs" / "driver.log"
    deadline = time.monotonic() + 120  # the cluster's word on the dead node comes once its heartbeats are missed
    while time.monotonic() < deadline and not (log.exists() and "marked dead" in log.read_text()):
        time.sleep(0.5)
    while time.monotonic() < deadline and job.status().preemptions < 1:  # the controller's word on it, too
        time.sleep(0.5)
    job.cancel()
    st = job.wait(timeout_s=300)
    print("job", st.state.value, "preemptions", st.preemptions)
    client.close()
""")


def test_a_python_api_user_sees_no_ray_messages_on_a_host_loss(client, tmp_path, session_home):
    spec = tiny_spec("quiet", "v4-16", tmp_path, steps=100000, interval=1000)
    r = subprocess.run([sys.executable, "-c", PROGRAM, json.dumps(spec.model_dump(mode="json"))], cwd=REPO,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().splitlines() == ["job CANCELLED preemptions 1"], r.stdout
    for said in ("(raylet)", "marked dead", "WARNING", "node id"):
        assert said not in r.stdout + r.stderr, r.stdout + r.stderr
    assert r.stderr.strip() == "", r.stderr
    log = (session_home / "logs" / "driver.log").read_text()  # Ray did say it: into the log
    assert "(raylet) The node with node id" in log and "marked dead" in log
