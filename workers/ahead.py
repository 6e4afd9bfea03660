"""The program of the runtime a lost slice would leave behind, compiled while the job trains.

When a slice of an N-slice job is lost, the survivors form a runtime of N - 1 slices and
restore from their memory (`workers.memory`) in about a second; what is left is compiling
the step for N - 1 slices (3 s for the small model on these hosts, minutes for a real one).
The built-in trainer's program is known before it is traced (`programs.program_id`), so it
can be compiled ahead, once the job has measured what its copy in memory costs (its first
steps):

- the first host of slice 0 rehearses that runtime beside its own: it starts as many
  processes as the survivors would have hosts (`rehearse`, below), on its own address, each
  with the host's devices, and process 0 of them traces and compiles the step exactly as the
  survivors' process 0 would, and keeps it in this host's executable cache
  (`programs.compile_ahead`). The processes run at a lower priority than training.
- The executable goes to the first host of slice 1 through the live runtime's key-value
  store, sealed with the launch's key: when slice 0 is the one lost, that host becomes the
  survivors' process 0. Every other host gets it from their process 0 at the restore, as
  after any restart (`programs.compile_keyed`).

Only on CPU hosts: a TPU VM cannot split its chips between the rehearsal's processes. For TPU
hosts the controller compiles the step for the survivors' topology off the hosts and keeps it in
the job's storage (`orchestrator.control.compile_ahead`, `workers.stored_programs`). Anything
that fails leaves the survivors to compile as they did before.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from workers.order import BuiltInTrainer, LaunchOrder
from workers.settings import LmSettings, TrainingSettings

log = logging.getLogger(__name__)

_KEY_CHARS = 64  # a program id: a sha256 in hex
_STORE_NAME = "ahead/program"
_TIMEOUT_S = 900


@dataclasses.dataclass(frozen=True)
class Rehearsal:
    """What the rehearsal's processes are told (pickled into their private folder)."""

    lm: LmSettings
    settings: TrainingSettings  # of the runtime one slice smaller
    processes: int
    devices_per_host: int
    compile_cache_dir: str


class CompileAhead:
    """This host's part in compiling the one-slice-smaller program: call `after_step` after each step."""

    def __init__(self, rehearsal: Rehearsal, *, rank: int, send=None):
        self.rehearsal, self.rank, self._send = rehearsal, rank, send
        self._started = self._shared = False
        self._steps = 0
        self._made: tuple[str, bytes] | None = None  # (program id, kept bytes) once rank 0's rehearsal is done

    @classmethod
    def for_host(cls, order: LaunchOrder, *, rank: int, num_hosts: int, devices_per_host: int,
                 platform: str | None, cache: str | None, send=None) -> CompileAhead | None:
        """The host's part, or None: not the built-in trainer, one slice, not CPU, no executable cache
        (`cache`, the host's), or not a first host of slice 0 or 1."""
        program = order.program
        if not isinstance(program, BuiltInTrainer) or program.ahead is None or platform != "cpu" or not cache:
            return None
        smaller, per_slice = program.ahead, num_hosts // order.settings.slices
        if rank % per_slice or rank // per_slice > 1:
            return None  # the survivors' process 0 is the first host of slice 0, or of slice 1 when slice 0 is lost
        return cls(Rehearsal(program.lm, smaller, per_slice * smaller.slices, devices_per_host, cache),
                   rank=rank, send=send)

    @property
    def settled(self) -> bool:
        """Whether this host's part is over: the program passed on (host 0), or taken (slice 1)."""
        return self._shared

    def after_step(self) -> None:
        """Start the rehearsal (host 0, once the copy's cadence is decided), pass its program on, or take it
        (slice 1)."""
        from workers.memory import Keeping

        self._steps += 1
        try:
            if self.rank == 0 and not self._started and self._steps > Keeping.DECIDE_AFTER + 1:
                # After the steps that measure the copy in memory: a compile beside them would inflate it.
                self._started = True
                threading.Thread(target=self._rehearse, daemon=True, name="compile-ahead").start()
            elif self.rank == 0 and self._made is not None and not self._shared:
                self._shared = True
                self._publish(*self._made)
            elif self.rank != 0 and not self._shared:
                self._shared = self._take()
        except Exception as e:  # never stops training: the survivors then compile it themselves
            log.warning("compile ahead: %s: %s", type(e).__name__, e, exc_info=True)
            self._shared = True

    # -- host 0 ------------------------------------------------------------------------

    def _rehearse(self) -> None:
        from workers import programs
        from workers.protocol import CompiledAhead

        t0 = time.perf_counter()
        try:
            key, made = rehearse(self.rehearsal)
            path = programs.kept_program_path(key)
            if path is None or not path.exists():
                raise RuntimeError("it kept no program")
        except Exception as e:
            log.warning("compile ahead: the rehearsal failed (%s: %s); a lost slice's survivors will compile",
                        type(e).__name__, e, exc_info=True)
            self._made = ("", b"")  # slice 1's host stops asking
            return
        seconds = time.perf_counter() - t0
        slices = self.rehearsal.settings.slices
        log.info("compile ahead: the program for %d slice(s) %s in %.1f s", slices,
                 "compiled" if made else "was kept already", seconds)
        self._made = (key, path.read_bytes())
        if self._send is not None:
            self._send(CompiledAhead(slices, seconds, compiled=made))

    def _publish(self, key: str, blob: bytes) -> None:
        from jax._src import distributed

        from workers import runtime

        client = distributed.global_state.client
        if client is not None:
            runtime.publish(client, _STORE_NAME, key.encode() + blob)

    # -- the first host of slice 1 -----------------------------------------------------

    def _take(self) -> bool:
        """Whether host 0's program arrived (and is kept here); False while it has not."""
        import jax
        from jax._src import distributed

        from workers import programs, runtime

        client = distributed.global_state.client
        if client is None:
            return True
        try:
            sealed = client.key_value_try_get_bytes(_STORE_NAME)
        except jax.errors.JaxRuntimeError:  # NOT_FOUND: not there yet
            return False
        payload = runtime.open_sealed(_STORE_NAME, sealed)
        if not payload:  # not authentic, or host 0's rehearsal failed
            return True
        key, blob = payload[:_KEY_CHARS].decode(), payload[_KEY_CHARS:]
        programs.keep_program(key, blob)
        slices = self.rehearsal.settings.slices
        log.info("compile ahead: kept the program for %d slice(s) from host 0", slices)
        if self._send is not None:
            from workers.protocol import CompiledAhead

            self._send(CompiledAhead(slices, 0.0, compiled=False))
        return True


def rehearse(rehearsal: Rehearsal, *, timeout_s: float = _TIMEOUT_S) -> tuple[str, bool]:
    """Run the smaller runtime's processes on this host; (program id, whether it was compiled now)."""
    with tempfile.TemporaryDirectory(prefix="compile-ahead-") as folder:  # private (0700)
        work = Path(folder)
        (work / "rehearsal.pkl").write_bytes(pickle.dumps(rehearsal))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            coordinator = f"127.0.0.1:{s.getsockname()[1]}"
        root = str(Path(__file__).resolve().parents[1])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
        procs = []
        with open(work / "log", "w") as out:
            for i in range(rehearsal.processes):
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "workers.ahead", "--folder", folder, "--coordinator", coordinator,
                     "--process-id", str(i)], env=env, stdout=out, stderr=subprocess.STDOUT, cwd=root))
            try:
                code = procs[0].wait(timeout=timeout_s)
            finally:
                for p in procs[1:]:
                    try:
                        p.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        p.kill()
                if procs[0].poll() is None:
                    procs[0].kill()
        result = work / "result.json"
        if code != 0 or not result.exists():
            tail = (work / "log").read_text(errors="replace")[-6000:]
            raise RuntimeError(f"the rehearsal's process 0 exited with {code}: {tail}")
        answer = json.loads(result.read_text())
        return answer["key"], answer["compiled"]


def _rehearsal_process(folder: Path, coordinator: str, process_id: int) -> None:
    """One process of the rehearsal: join its runtime; process 0 compiles the step and keeps it."""
    from workers import programs, runtime

    r: Rehearsal = pickle.loads((folder / "rehearsal.pkl").read_bytes())
    s = r.settings
    runtime.configure(platform="cpu", devices_per_host=r.devices_per_host, compile_cache_dir=r.compile_cache_dir)
    runtime.initialize(coordinator_address=coordinator, num_processes=r.processes, process_id=process_id,
                       host_address="127.0.0.1", slice_id=process_id * s.slices // r.processes,
                       num_slices=s.slices)
    import jax
    from jax._src import distributed

    client = distributed.global_state.client
    if process_id != 0:  # its devices are all process 0 needs of it (the backend forms with every process)
        assert client is not None, "a process other than 0 is in a runtime of several"
        jax.devices()
        client.blocking_key_value_get("ahead/done", _TIMEOUT_S * 1000)
        client.key_value_set(f"ahead/bye/{process_id}", "1")
        return
    from workers import api
    from workers.train import Trainer

    trainer = Trainer(r.lm, api.Context(rank=0, num_hosts=r.processes, settings=s))
    key = trainer.program_id("train_step")
    compiled = programs.compile_ahead(key, trainer.lower_step)
    (folder / "result.json").write_text(json.dumps({"key": key, "compiled": compiled}))
    if client is not None:
        client.key_value_set("ahead/done", "1")
        for i in range(1, r.processes):
            client.blocking_key_value_get(f"ahead/bye/{i}", 30_000)


def main() -> None:
    p = argparse.ArgumentParser(description="one process of a compile-ahead rehearsal (started by CompileAhead)")
    p.add_argument("--folder", type=Path, required=True)
    p.add_argument("--coordinator", required=True)
    p.add_argument("--process-id", type=int, required=True)
    a = p.parse_args()
    os.nice(10)  # training goes first on the host's cores
    logging.basicConfig(level=logging.INFO)
    try:
        _rehearsal_process(a.folder, a.coordinator, a.process_id)
    except BaseException:
        logging.exception("compile ahead: process %d failed", a.process_id)
        sys.stdout.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no shutdown barrier: the processes leave one by one


if __name__ == "__main__":
    main()
