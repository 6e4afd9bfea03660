"""The train step compiled off the hosts for the shapes a running job is likely to need next.

While a built-in-trainer job trains, its driver asks `ProgramsAhead.poll` (once a poll) which
shapes it may go on next (`next_shapes`): the survivors' slice count of a multi-slice job, the
shape of a request the cost policy made beside it (a move), the shape a resize names. For each
not yet done, a low-priority process on the controller's machine (``python -m
orchestrator.control.compile_ahead``, niced, never in the driver's thread) compiles the step
for that shape's target, seals it with the job's program key and writes it to the job's
storage (`workers.stored_programs`), where the hosts of that shape select it at their launch.

- TPU hosts: XLA's TPU compiler for the slice's topology (`workers.tpu_target.compile_train_step`).
- CPU stand-in hosts: a rehearsal of their runtime's processes (`workers.ahead.rehearse`), the only
  way to get their executable off the hosts. The hosts of a multi-slice job already rehearse
  the survivors' program among themselves (`workers.ahead`), so here this path is off unless the
  state directory holds a file named `CPU_SWITCH` (read at each poll, so a running controller can be
  switched): it is how the storage hand-off is shown without a TPU.

Which of the two the hosts are is what they say at their launch (`hosts_look_for`). Nothing
here may slow or fail the job: the process runs at the lowest priority, one at a time on the
controller's machine whatever the number of jobs, and any error is logged and recorded as an
event, never raised.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import pickle
import resource
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator import catalog
from orchestrator.control.launch import launch_order
from orchestrator.domain.spec import JobSpec, LmWorkload
from workers import stored_programs
from workers.order import BuiltInTrainer, StoredPrograms
from workers.settings import LmSettings, TrainingSettings

if TYPE_CHECKING:
    from orchestrator.cluster.home import Home
    from orchestrator.control.attempt import Attempt
    from orchestrator.state.protocol import JobStore

log = logging.getLogger(__name__)

CPU_SWITCH = "compile-ahead-cpu"  # in the state directory: compile ahead for CPU stand-in hosts too
AFTER_STEPS = 2  # the job's first steps measure its speed (and the copy in memory): a compile beside them would skew it
_KEY_FILE = "programs.key"
_TIMEOUT_S = 3600
# One compile at a time on the controller's machine, whatever the number of jobs: each takes a core and
# 1.5-1.9 GiB for a ~100M model (benchmarks/compile_ahead.py).
_ONE_AT_A_TIME = threading.Lock()


@dataclasses.dataclass(frozen=True)
class NextShape:
    """`slices` slices of `accelerator`, which the job may go on next, and why."""

    accelerator: str
    slices: int
    why: str


def next_shapes(spec: JobSpec, att: Attempt) -> list[NextShape]:
    """The shapes the job running as `spec` on `att`'s slices may need next, each once."""
    n = max(1, len(att.slices))
    shapes = []
    if n > 1:
        shapes.append(NextShape(spec.accelerator, n - 1, "the survivors of a lost slice"))
    if (w := att.waiting) is not None and (w.accelerator, w.count) != (spec.accelerator, n):
        shapes.append(NextShape(w.accelerator, w.count, "the request made beside the job (a move)"))
    if att.resize_to is not None and att.resize_to != spec.accelerator:
        shapes.append(NextShape(att.resize_to, n, "the resize asked for"))
    first = {(s.accelerator, s.slices): s for s in reversed(shapes)}  # the first reason given for a shape
    return [s for s in shapes if first[(s.accelerator, s.slices)] is s]


@dataclasses.dataclass(frozen=True)
class ProgramOption:
    """One program to compile ahead: the step the hosts of `target` would run."""

    target: str  # `workers.stored_programs.target_name`
    why: str
    lm: LmSettings
    settings: TrainingSettings
    platform: str  # "tpu" or "cpu" (stand-in hosts)
    hosts: int  # a slice's
    chips_per_host: int
    chip: str
    topology: str


def targets(t: catalog.TpuType, slices: int) -> dict[str, str]:
    """The target a host of `slices` x `t` selects by, on each platform it may be."""
    return {"tpu": stored_programs.target_name(t.generation.chip.name, t.topology, t.hosts, slices),
            "cpu": stored_programs.target_name("cpu", str(t.chips_per_host), t.hosts, slices)}


def option_for(spec: JobSpec, shape: NextShape, platform: str) -> ProgramOption:
    """What the hosts of `shape` run, resolved as their launch would (`JobDriver.on_slices`, `launch_order`)."""
    t = catalog.lookup(shape.accelerator)
    count = shape.slices if spec.autoscaling is not None else spec.slices
    on = spec if (t.name, count) == (spec.accelerator, spec.slices) else spec.moved(t.name, spec.tier.value,
                                                                                     slices=count)
    order = launch_order(on, t.chips, t.hosts, slices=shape.slices)
    assert isinstance(order.program, BuiltInTrainer), "only the built-in trainer's step is compiled ahead"
    return ProgramOption(targets(t, shape.slices)[platform], shape.why, order.program.lm, order.settings, platform,
                         t.hosts, t.chips_per_host, t.generation.chip.name, t.topology)


def job_key(home: Home, job_id: str) -> bytes:
    """The job's program key (made once, kept in its folder of the state directory, readable by its owner only)."""
    path = home.job_dir(job_id) / _KEY_FILE
    if path.exists():
        return bytes.fromhex(path.read_text().strip())
    path.parent.mkdir(parents=True, exist_ok=True)
    key, tmp = secrets.token_bytes(32), path.with_name(f"{_KEY_FILE}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key.hex())
    try:
        os.link(tmp, path)  # whole, and only if no other thread made it first
    except FileExistsError:
        key = bytes.fromhex(path.read_text().strip())
    finally:
        tmp.unlink()
    return key


def launch_programs(home: Home, job_id: str, spec: JobSpec, t: catalog.TpuType,
                    slices: int) -> StoredPrograms | None:
    """What a launch's hosts need to select their program from the job's storage (the launch order's
    ``programs``), or None: not the built-in trainer, or no checkpoint folder. Sent over Ray's
    authenticated channel, as the launch's key is; never logged."""
    if not isinstance(spec.workload, LmWorkload) or spec.checkpoint.directory is None:
        return None
    return StoredPrograms(spec.checkpoint.directory, job_key(home, job_id), targets(t, slices))


class ProgramsAhead:
    """A job's compile ahead into its storage: `poll` once a poll of a running attempt."""

    def __init__(self, home: Home, job_id: str, store: JobStore):
        self.home, self.job_id, self.store = home, job_id, store
        self.platform: str | None = None  # what the hosts are: "tpu", or "cpu" for stand-ins
        self._asked: set[str] = set()  # programs compiled (or tried): their target and settings
        self._busy = threading.Lock()
        self._generation, self._first_step = -1, -1  # the first step seen of the generation running

    def hosts_look_for(self, target: str) -> None:
        """Host 0 of the running generation looked for `target` in the job's storage: that says what hosts are."""
        self.platform = "cpu" if target.startswith("cpu:") else "tpu"

    def poll(self, spec_of: Callable[[], JobSpec], att: Attempt) -> None:
        """Start compiling for the shapes not done yet, once the hosts said what they are and trained
        `AFTER_STEPS` steps; `spec_of`: the job's spec as it runs (read only then)."""
        try:
            self._poll(spec_of, att)
        except Exception:  # never the job's failure: the hosts compile as before
            log.exception("job %s: compile ahead not started", self.job_id)

    def _poll(self, spec_of: Callable[[], JobSpec], att: Attempt) -> None:
        if self.platform is None or att.last_step < 0 or self._busy.locked():
            return
        if self._generation != att.generation:
            self._generation, self._first_step = att.generation, att.last_step
        if self.platform == "cpu" and not (self.home.root / CPU_SWITCH).exists():
            return
        spec = spec_of()
        if (att.last_step < self._first_step + AFTER_STEPS or not isinstance(spec.workload, LmWorkload)
                or spec.checkpoint.directory is None):
            return
        options = [option_for(spec, s, self.platform) for s in next_shapes(spec, att)]
        options = [o for o in options if _asked_key(o) not in self._asked]
        if not options:
            return
        self._asked.update(_asked_key(o) for o in options)
        self._busy.acquire()
        threading.Thread(target=self._run, args=(spec, options), daemon=True,
                         name=f"compile-ahead-{self.job_id}").start()

    def _run(self, spec: JobSpec, options: list[ProgramOption]) -> None:
        from orchestrator.state.events import ProgramStored

        try:
            try:
                with _ONE_AT_A_TIME:
                    answer = compile_in_process(options, directory=str(spec.checkpoint.directory),
                                                endpoint=spec.storage.endpoint,
                                                key_file=self.home.job_dir(self.job_id) / _KEY_FILE)
                results = answer["options"]
            except Exception as e:  # noqa: BLE001 -- a failed compile ahead only costs the hosts a compile
                log.warning("job %s: compile ahead failed: %s: %s", self.job_id, type(e).__name__, e)
                results = [{"target": o.target, "ok": False, "seconds": None, "size": None,
                            "error": f"{type(e).__name__}: {e}"[:500]} for o in options]
            for o, r in zip(options, results, strict=True):
                message = (f"compiled ahead for {r['target']} ({o.why}) in {r['seconds']:.1f} s and stored "
                           f"({r['size'] / 2**20:.1f} MiB): its hosts load it" if r["ok"] else
                           f"compile ahead for {r['target']} ({o.why}) failed: {r['error']}; its hosts will compile")
                try:
                    self.store.add_event(self.job_id, ProgramStored(r["target"], r["ok"], None, r["seconds"],
                                                                    r["size"], r.get("error")), message)
                except Exception:  # noqa: BLE001 -- an event that cannot be written is logged, never fatal here
                    log.exception("job %s: %s", self.job_id, message)
        finally:  # idle once its events are recorded
            self._busy.release()


def _asked_key(o: ProgramOption) -> str:
    return f"{o.target} {o.lm!r} {o.settings!r}"


def compile_in_process(options: list[ProgramOption], *, directory: str, endpoint: str | None, key_file: Path,
                       timeout_s: float = _TIMEOUT_S) -> dict:
    """Run `options` in a process of their own at the lowest priority; what it says (`_main`'s result.json)."""
    with tempfile.TemporaryDirectory(prefix="programs-ahead-") as folder:  # private (0700)
        work = Path(folder)
        (work / "request.pkl").write_bytes(pickle.dumps(
            {"options": options, "directory": directory, "endpoint": endpoint, "key_file": str(key_file)}))
        root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "JAX_PLATFORMS": "cpu",  # nothing runs: the TPU compiler needs no TPU
               "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
        with open(work / "log", "w") as out:
            p = subprocess.run([sys.executable, "-m", "orchestrator.control.compile_ahead", "--folder", folder],
                               env=env, stdout=out, stderr=subprocess.STDOUT, cwd=root, timeout=timeout_s)
        if p.returncode != 0 or not (work / "result.json").exists():
            tail = (work / "log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"the compile-ahead process exited with {p.returncode}: {tail}")
        return json.loads((work / "result.json").read_text())


# -- the process ---------------------------------------------------------------------------


def _compile_tpu(o: ProgramOption) -> bytes:
    from workers.tpu_target import Topology, compile_train_step, serialize

    compiled, _ = compile_train_step(o.lm, o.settings, Topology(o.chip, o.topology, o.hosts, o.settings.slices))
    return serialize(compiled)  # (payload, in_tree, out_tree) pickled: as `programs.keep_program` keeps it


def _compile_cpu(o: ProgramOption) -> bytes:
    from workers.ahead import Rehearsal, rehearse

    with tempfile.TemporaryDirectory(prefix="programs-cpu-") as cache:
        r = Rehearsal(o.lm, o.settings, o.hosts * o.settings.slices, o.chips_per_host, cache)
        key, _ = rehearse(r)
        return (Path(cache) / "executables" / f"program-{key}.pkl").read_bytes()


def _main(folder: Path) -> None:
    from workers import storage
    from workers.train import program_config

    request = pickle.loads((folder / "request.pkl").read_bytes())
    storage.configure(request["endpoint"])
    key = bytes.fromhex(Path(request["key_file"]).read_text().strip())
    results = []
    for o in request["options"]:
        t0 = time.perf_counter()
        try:
            kept = _compile_tpu(o) if o.platform == "tpu" else _compile_cpu(o)
            sid = stored_programs.stored_id("train_step", program_config(o.lm, o.settings))
            stored_programs.write(request["directory"], sid, o.target, kept, key, endpoint=request["endpoint"])
            results.append({"target": o.target, "ok": True, "seconds": time.perf_counter() - t0, "size": len(kept)})
        except Exception as e:  # one shape the compiler refuses leaves the others
            log.exception("compile ahead for %s failed", o.target)
            results.append({"target": o.target, "ok": False, "seconds": time.perf_counter() - t0, "size": None,
                            "error": f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"})
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    usage = {"cpu_s": me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime,
             "peak_rss_mib": max(me.ru_maxrss, children.ru_maxrss) / 1024}  # KiB on Linux
    (folder / "result.json").write_text(json.dumps({"options": results, **usage}))


def main() -> None:
    p = argparse.ArgumentParser(description="compile a job's step ahead into its storage (started by ProgramsAhead)")
    p.add_argument("--folder", type=Path, required=True)
    a = p.parse_args()
    os.nice(19)  # the controller and everything else on its machine go first
    logging.basicConfig(level=logging.INFO)
    _main(a.folder)


if __name__ == "__main__":
    main()
