"""The step after a profile capture does not wait for the trace's files (issue 40: 18 s under load).

`jax.profiler.stop_trace` stops collecting and then writes the trace (the XSpace, the trace
viewer's JSON, a Perfetto copy) on its caller's thread; a host's `Profiler` stops collecting on
the training loop and leaves the writing to its publishing thread (`workers.profiling.stop_collecting`).
"""

from __future__ import annotations

import threading
import time

import jax.numpy as jnp
import numpy as np
from jax._src import profiler as jax_profiler

from orchestrator.user.capture import read_host
from tests.unit.test_profiling import request, step
from workers import api
from workers.profiling import Profiler
from workers.protocol import ProfileDone, StepDone

WAIT_S = 30.0  # how long the writer waits for the loop to go on before it writes anyway


def test_the_trace_is_written_off_the_loop_after_the_next_step_is_reported(tmp_path, monkeypatch):
    reports: list = []
    loop_thread = threading.current_thread()
    written: list[tuple[threading.Thread, list[int]]] = []  # (the writer's thread, the steps reported by then)
    real = jax_profiler._write_perfetto_trace_file

    def perfetto(log_dir):
        # Off the loop, the writer waits until the loop reports the step after the capture (step 6): the loop
        # must not need the trace written to go on. On the loop it would wait for itself: it writes at once.
        deadline = time.monotonic() + WAIT_S
        while threading.current_thread() is not loop_thread and time.monotonic() < deadline:
            if any(isinstance(r, StepDone) and r.step >= 6 for r in list(reports)):
                break
            time.sleep(0.01)
        written.append((threading.current_thread(), [r.step for r in list(reports) if isinstance(r, StepDone)]))
        return real(log_dir)

    monkeypatch.setattr(jax_profiler, "_write_perfetto_trace_file", perfetto)
    profiler = Profiler(0, 1, reports.append)
    ctx = api.local_context(steps=10, send=reports.append, profiler=profiler,
                            agreed_stop=lambda: profiler.vote(False))
    with ctx.loop({"w": jnp.ones(8)}) as loop:
        for s in loop:
            if s == 2:
                profiler.request(request(tmp_path, 3))  # agreed after step 2: traces steps 3-5, stops before 6
            state, loss = step(loop.state, np.float32(s % 3))
            loop.done(state, loss=loss)

    ((thread, reported),) = written
    assert thread is not loop_thread, "the trace was written on the training loop"
    assert 6 in reported, f"the trace was written before the step after the capture was reported ({reported})"
    (done,) = [r for r in reports if isinstance(r, ProfileDone)]
    assert (done.first_step, done.steps, done.error) == (3, 3, None)
    host = read_host(done.path, 0)  # the files the publishing thread wrote: whole, as before
    assert host.xplane and host.perfetto and host.error is None
    assert (host.summary.program, host.summary.executions) == ("jit_step", 3)
