"""Programs that end in each of the ways the recovery rules tell apart (`tests/integration/test_endings.py`)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from workers import api


def _train(ctx: api.Context, on_step, shape=(8, 8)) -> None:
    state = ctx.restore_or_init(lambda key: {"w": jax.random.normal(key, shape)})  # random: no compression helps
    with ctx.loop(state) as loop:
        for step in loop:
            on_step(step)
            loop.done({"w": loop.state["w"] + 1.0}, loss=jnp.float32(1.0))


def exits_0_at_step_0(ctx: api.Context) -> None:
    _train(ctx, lambda step: sys.exit(0))


def exits_3(ctx: api.Context) -> None:
    _train(ctx, lambda step: sys.exit(3) if step == 1 else None)


def aborts_once(ctx: api.Context) -> None:
    """A native abort (as an XLA check failure ends a process) at step 2 of the first run; the next run finishes."""
    marker = Path(ctx.args["marker"])

    def step(s: int) -> None:
        if s == 2 and ctx.rank == 0 and not marker.exists():
            marker.write_text("aborted once")
            os.write(2, b"F1125 12:00:00.000000 4242 pjrt_client.cc:77] Check failed: buffer != nullptr "
                        b"(0 vs. 1) device buffer gone\n")
            os.abort()

    _train(ctx, step)


def hangs_at_step_2(ctx: api.Context) -> None:
    _train(ctx, lambda step: time.sleep(3600) if step == 2 else None)


def big_state(ctx: api.Context) -> None:
    _train(ctx, lambda step: None, shape=(1024, 1024))  # 4 MiB of float32 a checkpoint


def starts_a_daemon(ctx: api.Context) -> None:
    """A daemon that forks twice and leaves the session (no process group or session kill reaches it)."""
    if ctx.rank == 0:
        child = os.fork()
        if child == 0:
            os.setsid()
            if os.fork() == 0:
                Path(ctx.args["pidfile"]).write_text(str(os.getpid()))
                while True:
                    time.sleep(1)
            os._exit(0)
        os.waitpid(child, 0)
    _train(ctx, lambda step: None)
