"""What compiling ahead off the hosts costs: per option, the compile's time, CPU and memory on this machine.

    python benchmarks/compile_ahead.py [--models 100m,small] [--out benchmarks/results/compile_ahead.json]

A running job's controller compiles the step for the shapes the job may need next
(`orchestrator.control.compile_ahead`): each option here goes through the same process the
controller starts (`compile_in_process`: ``nice 19``, its own process, the executable sealed
and written to a job folder), one process per option so each is measured alone:

- ``100m``: the ~100M job of ``benchmarks/tpu_compile.py`` running on 2 x v4-16, and its next
  shapes with XLA's TPU compiler: the survivors of a lost slice (1 x v4-16), a move the cost
  policy could request (1 x v4-32), a resize to 2 x v4-32;
- ``small``: the CPU stand-ins' path (a rehearsal of the survivors' runtime) for the small model
  of the tests, 2 x v4-8 -> 1 x v4-8.

Per option: ``wall_s`` (the whole process: start, imports, compile, seal, write), ``compile_s``
(the compile and store alone, as the process timed it), ``cpu_s`` (user + system of the process
and its children), ``peak_rss_mib`` (the largest resident set of the process or of any of its
children), and the stored object's size. Beside the compiles, a thread of this process stands for
the controller's loop: it sleeps 50 ms at a time and records how late it wakes (``controller_lag``,
idle and while a compile runs). This machine has 2 cores shared with other work: indicative only.

Writes `benchmarks/results/compile_ahead.json` (`--out` elsewhere).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import threading
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SMALL = {"name": "small", "accelerator": "v4-8", "slices": 2,
         "workload": {"type": "lm", "steps": 10, "global_batch_size": 8, "seq_len": 16,
                      "model": {"d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64}}}


def jobs(model: str):
    """The running job's spec, and the shapes compiled ahead for it (with the hosts' platform)."""
    from orchestrator.control.compile_ahead import NextShape
    from orchestrator.domain.spec import JobSpec

    if model == "small":
        return JobSpec.from_dict(SMALL), "cpu", [NextShape("v4-8", 1, "survivors")]
    from benchmarks.tpu_compile import job_spec

    spec = job_spec(model)
    spec = spec.moved("v4-16", spec.tier.value, slices=2)
    shapes = [NextShape("v4-16", 1, "survivors"), NextShape("v4-32", 1, "move"), NextShape("v4-32", 2, "resize")]
    return spec, "tpu", shapes


class Lag:
    """A controller-like loop: sleeps `period_s` at a time and records how late each wake-up is."""

    def __init__(self, period_s: float = 0.05):
        self.period_s = period_s
        self.late: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.perf_counter()
            time.sleep(self.period_s)
            self.late.append(time.perf_counter() - t0 - self.period_s)

    def measure(self, seconds: float | None = None, until=None) -> dict:
        self.late = []
        if seconds is not None:
            time.sleep(seconds)
        else:
            until()
        late = sorted(self.late)
        return {"wakeups": len(late), "p50_ms": round(1e3 * statistics.median(late), 2),
                "p99_ms": round(1e3 * late[int(0.99 * (len(late) - 1))], 2), "max_ms": round(1e3 * late[-1], 2)}

    def start(self) -> Lag:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="100m,small")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "compile_ahead.json"))
    a = p.parse_args()

    from orchestrator.cluster.home import Home
    from orchestrator.control.compile_ahead import compile_in_process, job_key, option_for

    lag = Lag().start()
    t_all = time.perf_counter()
    rows, idle = [], lag.measure(seconds=5.0)
    with tempfile.TemporaryDirectory(prefix="compile-ahead-bench-") as tmp:
        home = Home(Path(tmp) / "state")
        job_key(home, "bench")
        for model in a.models.split(","):
            spec, hosts_are, shapes = jobs(model)
            for shape in shapes:
                option = option_for(spec, shape, hosts_are)
                answer: dict = {}
                t0 = time.perf_counter()

                def run(option=option, answer=answer) -> None:
                    answer.update(compile_in_process([option], directory=str(Path(tmp) / "job"), endpoint=None,
                                                     key_file=home.job_dir("bench") / "programs.key"))

                busy = lag.measure(until=run)  # measured while this option compiles
                wall = time.perf_counter() - t0
                [r] = answer["options"]
                row = {"model": model, "running_on": f"{spec.slices} x {spec.accelerator}",
                       "option": f"{shape.slices} x {shape.accelerator}", "why": shape.why, "target": option.target,
                       "hosts_are": hosts_are, "ok": r["ok"], "wall_s": round(wall, 1),
                       "compile_s": round(r["seconds"], 1), "cpu_s": round(answer["cpu_s"], 1),
                       "peak_rss_mib": round(answer["peak_rss_mib"]), "stored_mib": round((r["size"] or 0) / 2**20, 2),
                       "controller_lag": busy, "error": r.get("error")}
                print(json.dumps(row), flush=True)
                rows.append(row)
    lag.stop()
    try:
        libtpu = metadata.version("libtpu")
    except metadata.PackageNotFoundError:
        libtpu = None
    import jax

    out = {"command": "python benchmarks/compile_ahead.py " + " ".join(sys.argv[1:]),
           "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}, 2 cores shared with other work",
           "jax": jax.__version__, "libtpu": libtpu, "wall_s": round(time.perf_counter() - t_all, 1),
           "controller_lag_idle": idle, "rows": rows,
           "notes": "Each option compiled in a process of its own at nice 19, as the controller starts it; cpu_s "
                    "and peak_rss_mib of that process and its children (the CPU path's rehearsal processes). "
                    "controller_lag: how late a 50 ms sleep of a thread in this process wakes, idle and while "
                    "the option compiles (the controller's loop is such a thread)."}
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
