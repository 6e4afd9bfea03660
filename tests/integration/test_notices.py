"""SIGTERM on a multi-host runtime: the project's notice and JAX's own preemption notifier both hear it.

`jax.distributed.initialize` starts XLA's preemption notifier, which sets its own SIGTERM
handler in C: the project's (a Python handler) was silently replaced, so a SIGTERM to a
worker of a multi-host slice gave no notice. Two real JAX processes here, as two hosts.
"""

from __future__ import annotations

import subprocess
import sys

from orchestrator.cluster import free_port
from tests.conftest import REPO

HOST = """
import os, signal, sys, threading, time
import jax
jax.config.update("jax_platforms", "cpu")
from workers import notices, runtime

rank, address = int(sys.argv[1]), sys.argv[2]
heard = []
notices.install_sigterm(heard.append)  # on the main thread, as HostWorker.__init__ does


def train():  # the training thread, as HostWorker._main
    from jax.experimental import multihost_utils

    runtime.initialize(coordinator_address=address, num_processes=2, process_id=rank, host_address="127.0.0.1")
    for step in range(100):
        if rank == 1 and step == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)  # a step's work: the main thread runs the signal handler before this step's sync point
        if multihost_utils.reached_preemption_sync_point(step):  # JAX's own notifier: every process, one step
            print(f"jax sync point at step {step}; project heard {heard}", flush=True)
            return
    print(f"no jax sync point; project heard {heard}", flush=True)


t = threading.Thread(target=train)
t.start()
while t.is_alive():
    time.sleep(0.02)  # Python runs signal handlers on the main thread
"""


def test_sigterm_reaches_the_project_and_jax_on_a_two_process_runtime():
    address = f"127.0.0.1:{free_port()}"
    procs = [subprocess.Popen([sys.executable, "-c", HOST, str(rank), address], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True) for rank in (0, 1)]
    try:
        outs = [p.communicate(timeout=180)[0].strip() for p in procs]
    finally:
        for p in procs:
            p.kill()
    step = outs[0].split("step ")[1].split(";")[0]
    assert outs == [f"jax sync point at step {step}; project heard []",
                    f"jax sync point at step {step}; project heard ['SIGTERM']"], outs
