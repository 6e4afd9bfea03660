"""One worker per TPU host: a Ray actor pinned to its host that joins the slice's JAX runtime.

The controller creates one `HostWorker` per host of a slice (all or none, through a
placement group), asks worker 0 for a coordinator address, then calls `run` on all of
them at once (`jax.distributed.initialize` blocks until every process has joined).
Workers report to the controller by name: a heartbeat with the step after every
step, metrics from worker 0, and their log lines, each tagged with the host.
"""

from __future__ import annotations

import importlib
import io
import logging
import socket
import sys
import threading
import time
import traceback
from typing import Any

import ray

from workers import runtime

log = logging.getLogger(__name__)


class _LineBuffer(io.TextIOBase):
    """Collects what user code prints or logs, to ship with the next report."""

    def __init__(self, echo):
        self._echo, self._lock, self._lines, self._partial = echo, threading.Lock(), [], ""

    def write(self, s: str) -> int:
        self._echo.write(s)
        with self._lock:
            text = self._partial + s
            *full, self._partial = text.split("\n")
            self._lines.extend(full)
        return len(s)

    def drain(self) -> list[str]:
        with self._lock:
            lines, self._lines = self._lines, []
        return lines


class HostWorker:
    def __init__(self, *, job_id: str, generation: int, rank: int, num_hosts: int, devices_per_host: int,
                 platform: str | None, compile_cache_dir: str | None, controller: tuple[str, str] | None):
        self.job_id, self.generation, self.rank, self.num_hosts = job_id, generation, rank, num_hosts
        self.devices_per_host = devices_per_host
        self._controller_name = controller
        self._controller = None
        self._stop = threading.Event()
        self._out = _LineBuffer(sys.stdout)
        runtime.configure(platform=platform, devices_per_host=devices_per_host, compile_cache_dir=compile_cache_dir)
        handler = logging.StreamHandler(self._out)
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logging.getLogger().addHandler(handler)
        logging.getLogger().setLevel(logging.INFO)
        logging.getLogger("absl").setLevel(logging.WARNING)  # orbax narrates every save at INFO

    # -- called by the controller -------------------------------------------------

    def info(self) -> dict:
        ctx = ray.get_runtime_context()
        return {"node_id": ctx.get_node_id(), "ip": ray.util.get_node_ip_address(), "rank": self.rank}

    def coordinator_address(self) -> str:
        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((ip, 0))
            return f"{ip}:{s.getsockname()[1]}"

    def request_stop(self, reason: str) -> None:
        """A preemption notice: save at the current step, commit, and return from `run`."""
        log.warning("stop requested: %s", reason)
        self._stop.set()

    def run(self, coordinator: str | None, workload: dict) -> dict:
        """Train; returns {"outcome": "succeeded"|"stopped"|"failed", ...}. Never raises for user errors."""
        t0 = time.perf_counter()
        try:
            runtime.initialize(coordinator_address=coordinator, num_processes=self.num_hosts, process_id=self.rank)
            init_s = time.perf_counter() - t0
            self._send("ready", {"init_s": init_s})
            if workload["type"] == "lm":
                result = self._run_lm(workload)
            else:
                result = self._run_entrypoint(workload)
            self._send("log", {})
            return result
        except Exception as e:  # the boundary of user code: report it, typed, with its traceback
            tb = traceback.format_exc()
            print(tb, file=self._out)
            self._send("log", {})
            return {"outcome": "failed", "error": f"{type(e).__name__}: {e}", "traceback": tb, "rank": self.rank}

    # -- workloads ----------------------------------------------------------------

    def _run_lm(self, workload: dict) -> dict:
        from workers.train import Trainer, TrainConfig  # after runtime.configure

        cfg = TrainConfig.from_dict(workload["config"])
        trainer = Trainer(cfg, may_write=self._may_write)

        def on_ready(t):
            self._send("timings", {"restore_s": t.restore_s, "compile_s": t.compile_s,
                                   "restored_step": t.restored_step})

        every = max(1, cfg.steps // 10)

        def on_step(r):
            if self.rank == 0 and ((r.step + 1) % every == 0 or r.step + 1 == cfg.steps):
                log.info("step %d/%d loss %.4f (%.0f tokens/s)", r.step + 1, cfg.steps, r.loss, r.tokens_per_s)
            self._send("step", {"step": r.step, "loss": r.loss, "tokens_per_s": r.tokens_per_s,
                                "step_time_s": r.step_time_s})

        _, done = trainer.run(on_step=on_step, on_ready=on_ready, should_stop=self._stop.is_set)
        outcome = "succeeded" if done >= cfg.steps else "stopped"
        return {"outcome": outcome, "steps": done, "rank": self.rank}

    def _run_entrypoint(self, workload: dict) -> dict:
        from workers.context import WorkerContext

        module_name, fn_name = workload["entrypoint"].split(":")
        if workload.get("workdir") and workload["workdir"] not in sys.path:
            sys.path.insert(0, workload["workdir"])
        fn = getattr(importlib.import_module(module_name), fn_name)
        ctx = WorkerContext(rank=self.rank, num_hosts=self.num_hosts, args=workload.get("args", {}),
                            checkpoint_dir=workload.get("checkpoint_dir"), stop_requested=self._stop.is_set,
                            report=lambda step, loss, tokens_per_s=None: self._send(
                                "step", {"step": step, "loss": loss, "tokens_per_s": tokens_per_s}))
        fn(ctx)
        return {"outcome": "succeeded", "rank": self.rank}

    # -- reporting ----------------------------------------------------------------

    def _may_write(self) -> bool:
        """Fencing: only the job's current generation may write checkpoints."""
        ctrl = self._ctrl()
        if ctrl is None:
            return True
        try:
            return ray.get(ctrl.current_generation.remote(self.job_id), timeout=30) == self.generation
        except Exception:
            self._controller = None
            log.warning("could not reach the controller to check the generation; not writing")
            return False

    def _ctrl(self):
        if self._controller is None and self._controller_name:
            name, namespace = self._controller_name
            try:
                self._controller = ray.get_actor(name, namespace=namespace)
            except ValueError:
                return None
        return self._controller

    def _send(self, kind: str, payload: dict[str, Any]) -> None:
        payload = dict(payload, lines=self._out.drain())
        ctrl = self._ctrl()
        if ctrl is None:
            return
        try:
            ctrl.report.remote(self.job_id, self.generation, self.rank, kind, payload)
        except Exception:  # a restarting controller: look it up again next time
            self._controller = None
