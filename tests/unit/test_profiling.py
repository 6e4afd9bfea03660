"""A host's side of profile captures (`workers.profiling`) around the training API's loop, in this process."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from orchestrator.user.capture import read_host
from workers import api
from workers.profiling import CaptureRequest, Profiler
from workers.protocol import ProfileDone, StepDone


@jax.jit
def step(state, x):
    """A tiny linear model's SGD step."""
    def loss(w):
        return jnp.mean((jnp.tanh(jnp.arange(8.0) * w) - x) ** 2)

    value, grad = jax.value_and_grad(loss)(state["w"])
    return {"w": state["w"] - 0.1 * grad}, value


def train(steps: int, profiler: Profiler | None = None, ask_at: dict | None = None) -> tuple[list, list]:
    """Run `steps` steps through `api.Loop`; `ask_at`: {step: request}, handed to the profiler as step starts."""
    reports: list = []
    ctx = api.local_context(steps=steps, send=reports.append, profiler=profiler,
                            agreed_stop=(lambda: profiler.vote(False)) if profiler else None)
    with ctx.loop({"w": jnp.ones(8)}) as loop:
        for s in loop:
            if ask_at and s in ask_at:
                profiler.request(ask_at[s])
            state, loss = step(loop.state, np.float32(s % 3))
            loop.done(state, loss=loss)
    losses = [r.loss for r in reports if isinstance(r, StepDone)]
    return losses, [r for r in reports if isinstance(r, ProfileDone)]


def request(tmp_path: Path, steps: int, *, number: int = 1, hosts=(0,), memory: bool = False) -> CaptureRequest:
    return CaptureRequest(number, f"c{number}", steps, tuple(hosts), str(tmp_path / "profiles" / f"c{number}"), memory)


def test_a_capture_traces_exactly_the_steps_asked_from_the_agreed_step(tmp_path):
    plain, _ = train(10)
    sent = []
    profiler = Profiler(0, 1, sent.append)
    losses, _ = train(10, profiler, {2: request(tmp_path, 3, memory=True)})
    assert losses == plain  # to the bit
    (done,) = [r for r in sent if isinstance(r, ProfileDone)]
    # Asked during step 2, agreed after it, traced from the next step on.
    assert (done.first_step, done.steps, done.error) == (3, 3, None)
    folder = Path(done.path)
    assert folder == tmp_path / "profiles" / "c1" / "host-0"
    meta = json.loads((folder / "capture.json").read_text())
    assert (meta["first_step"], meta["steps"], meta["steps_asked"]) == (3, 3, 3)
    assert len(meta["memory"]) == len(jax.local_devices()) and (folder / "memory.prof").stat().st_size > 0
    host = read_host(str(folder), 0)
    assert host.xplane and host.perfetto and host.error is None
    assert (host.summary.program, host.summary.executions) == ("jit_step", 3)
    assert not profiler.busy


def test_a_capture_longer_than_what_is_left_ends_with_training(tmp_path):
    sent = []
    profiler = Profiler(0, 1, sent.append)
    train(6, profiler, {1: request(tmp_path, 20)})
    (done,) = sent
    assert (done.first_step, done.steps, done.error) == (2, 4, None)
    assert read_host(done.path, 0).summary.executions == 4


def test_a_capture_agreed_on_the_last_step_never_begins(tmp_path):
    sent = []
    profiler = Profiler(0, 1, sent.append)
    train(4, profiler, {3: request(tmp_path, 2)})
    (done,) = sent
    assert done.path is None and done.steps == 0
    assert done.error == "training stopped after step 4 before the capture could begin"
    assert not (tmp_path / "profiles").exists()


def test_a_host_not_chosen_only_votes(tmp_path):
    sent = []
    profiler = Profiler(0, 2, sent.append)  # rank 0 of 2; the capture is host 1's
    profiler.num_hosts = 1  # one process here: vote as one host does, without the collective
    train(5, profiler, {1: request(tmp_path, 2, hosts=(1,))})
    assert sent == [] and not profiler.busy and not (tmp_path / "profiles").exists()


def test_the_vote_takes_the_newest_request_every_host_holds():
    profiler = Profiler(0, 1, lambda r: None)
    assert profiler.vote(False) is False and not profiler.busy
    profiler.request(CaptureRequest(4, "c4", 2, (0,), "/unused"))
    assert profiler.vote(True) is True and profiler.busy  # a stop rides on the same vote
    profiler.request(CaptureRequest(3, "c3", 2, (0,), "/unused"))  # older than one agreed: never begins
    profiler.vote(False)
    assert profiler._next.capture_id == "c4"


def test_a_trace_already_running_is_reported_not_raised(tmp_path):
    sent = []
    profiler = Profiler(0, 1, sent.append)
    jax.profiler.start_trace(str(tmp_path / "mine"))  # the program's own
    try:
        losses, _ = train(5, profiler, {1: request(tmp_path, 2)})
    finally:
        jax.profiler.stop_trace()
    (done,) = sent
    assert done.path is None and done.error.startswith("could not start jax.profiler:")
    assert len(losses) == 5
