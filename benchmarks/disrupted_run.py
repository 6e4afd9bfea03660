"""A disrupted run on a local cluster of its own, for the README's pictures.

One 2-host job is disrupted in every way the local cluster can show: a worker process
killed (a worker crash), a preemption notice (SIGTERM to a worker), a host removed (host
lost), a worker frozen (SIGSTOP) past the heartbeat timeout (it answers nothing on a host
still up: another worker crash), the controller killed (Ray restarts it and the new one
adopts the running workers), and a resize to a smaller slice (a move). Two other jobs
share the cluster: one runs, one waits in the queue for hosts.
While they run, headless Chromium takes the dashboard's jobs page and the job's page;
at the end the job's report is drawn.

    python benchmarks/disrupted_run.py --out benchmarks/results

writes dashboard-jobs.png, dashboard-job.png and report-disrupted.png there (about 5 minutes
on 2 cores; needs Debian's chromium for the screenshots).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

MODEL = {"d_model": 64, "n_layers": 1, "n_heads": 4, "d_ff": 128}


def spec(name: str, accelerator: str, ckpt: Path, steps: int, interval: int, batch: int = 16, **extra):
    from orchestrator import JobSpec

    return JobSpec.from_dict({
        "name": name, "accelerator": accelerator,
        "workload": {"type": "lm", "steps": steps, "global_batch_size": batch, "seq_len": 32, "model": MODEL,
                     "learning_rate": {"warmup_steps": 10}},
        "checkpoint": {"interval_steps": interval, "directory": str(ckpt / name)},
        "recovery": {"start_timeout_s": 180, "heartbeat_timeout_s": 45, "max_preemptions": 20,
                     "max_failures": 10}, **extra})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="disrupted-run-"))
    os.environ["ORCHESTRATOR_HOME"] = str(home)

    import ray

    from orchestrator import Client
    from orchestrator.cluster import kill_host
    from orchestrator.observe.report import write_report

    client = Client(home=home)
    client.connect()
    try:
        job = client.submit(spec("gru-lm-disruption", "v4-16", home, steps=2500, interval=100))
        other = client.submit(spec("tiny-lm", "v4-8", home, steps=200000, interval=5000))

        def running_at(step: int) -> None:
            while True:
                st = job.status()
                if st.done:
                    raise SystemExit(f"the job ended early: {st.state.value} {st.reason}")
                if st.state.value == "RUNNING" and st.step >= step:
                    return
                time.sleep(0.1)

        def pids() -> list[int]:
            return [e.data["pids"] for e in job.events() if e.kind.value == "launched"][-1]

        running_at(150)
        print("a worker process killed", flush=True)
        os.kill(pids()[1], signal.SIGKILL)
        running_at(job.status().step + 150)
        print("a preemption notice (SIGTERM to a worker)", flush=True)
        os.kill(pids()[0], signal.SIGTERM)
        running_at(job.status().step + 150)
        print("a host removed", flush=True)
        kill_host(client.home, client.store.slices(job_id=job.id, live_only=True)[0].data["pgids"][1])
        running_at(job.status().step + 150)
        print("a worker frozen", flush=True)
        frozen = pids()[1]
        os.kill(frozen, signal.SIGSTOP)
        running_at(job.status().step + 150)
        print("the controller killed", flush=True)
        ray.kill(client.controller(), no_restart=False)
        time.sleep(5)
        running_at(job.status().step + 100)
        queued = client.submit(spec("big-lm", "v4-64", home, steps=100, interval=50, batch=64))
        print("resize to v4-8", flush=True)
        client.resize(job.id, "v4-8", reason="a smaller slice is enough now")
        running_at(job.status().step + 100)
        shots(client, job.id, args.out)
        st = job.wait(timeout_s=1200)
        print("job", st.state.value, st.reason, flush=True)
        for j in (other, queued):
            if not j.status().done:
                j.cancel()
        write_report(client.store, job.id, args.out / "report-disrupted.png", force=True)
        print("wrote", args.out / "report-disrupted.png", flush=True)
        return 0 if st.state.value == "SUCCEEDED" else 1
    finally:
        client.down()


def shots(client, job_id: str, out: Path) -> None:
    """The jobs page and the job's page, as headless Chromium draws them after their first updates."""
    import ray

    chromium = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
    if chromium is None:
        print("no chromium: no dashboard screenshots", flush=True)
        return
    url = ray.get(client.controller().dashboard_url.remote(), timeout=60)
    token = client.home.token_file.read_text().strip()
    for name, path, size in (("dashboard-jobs.png", "", "1400,760"),
                             ("dashboard-job.png", f"job/{job_id}", "1400,1500")):
        with tempfile.TemporaryDirectory() as profile:  # the login link sets the session cookie, then the page loads
            subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                            "--disable-background-networking", "--disable-component-update", "--disable-sync",
                            "--hide-scrollbars", f"--user-data-dir={profile}", f"--window-size={size}",
                            "--virtual-time-budget=8000", f"--screenshot={out / name}", f"{url}{path}?token={token}"],
                           check=True, timeout=120, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    print("wrote", out / "dashboard-jobs.png", out / "dashboard-job.png", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
