"""One worker per TPU host: a Ray actor pinned to its host that joins the slice's JAX runtime.

The controller creates one `HostWorker` per host of a slice (all or none, through a
placement group), asks worker 0 for a coordinator address, then calls `start` on all
of them at once (`jax.distributed.initialize` blocks until every process has joined).
Each host runs on what it is (`workers.accelerator`): its TPU chips, checked against what
the slice claims before anything of the job's runs, or its CPU where its Ray node declares
that it stands in for them.
Training runs on a thread of the actor; the controller polls `result()`. Workers are
detached actors: if the controller dies, they train on, and the restarted controller
adopts them (`history()` fills in the steps it missed).

Workers report to the controller by name: a heartbeat with the step after every step,
metrics and save timings from worker 0, and their log lines, each tagged with the host.
A preemption notice (metadata server, SIGTERM, or the controller) stops every host at
the same step, after a committed checkpoint of that step.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import socket
import sys
import threading
import time
import traceback
from typing import TYPE_CHECKING

import ray

from policies.decisions.recovery import FailureCause, failure_cause
from workers import accelerator, beats, reaper, runtime, storage
from workers import fence as fences
from workers.host_errors import EntrypointError, error_chain, error_line
from workers.host_output import LineBuffer, route_logs
from workers.notices import MetadataWatcher, install_sigterm
from workers.order import BuiltInTrainer, LaunchOrder, UserEntrypoint
from workers.profiling import CaptureRequest, Profiler
from workers.protocol import Ending, Lines, Noticed, Ready, Report, Saved, StepDone, WorkerResult, saved_entry

if TYPE_CHECKING:
    from workers import api

log = logging.getLogger(__name__)


def _preload_lm() -> None:
    """What the built-in workload needs before its first step, none of which needs the runtime:
    the trainer's imports (orbax, optax, the model) and the training corpus, about 1.5 s of
    CPU together. Done while the controller still gathers the other hosts."""
    try:
        importlib.import_module("workers.train")
        importlib.import_module("workers.data").corpus()
    except Exception as e:  # noqa: BLE001 -- the training thread does it again, and reports the error there
        log.debug("preloading the trainer failed: %s", e)


class HostWorker:
    def __init__(self, *, job_id: str, generation: int, rank: int | None, num_hosts: int, devices_per_host: int,
                 compile_cache_dir: str | None,
                 controller: "tuple[str, str] | ray.actor.ActorHandle | None",  # a name, or the inbox
                 workload_type: str | None = None, claim: accelerator.HostClaim | None = None):
        """`rank` None: a spare, started while `generation - 1` trains, that waits imported on its host until
        `take` gives it its rank (`orchestrator.control.spares`)."""
        self.job_id, self.generation, self.rank, self.num_hosts = job_id, generation, rank or 0, num_hosts
        self._devices_per_host, self._compile_cache_dir = devices_per_host, compile_cache_dir
        self._claim = claim  # what the slice says this host is (`start` checks a TPU host against it)
        self._platform = accelerator.host_platform()  # what this host is, as its Ray node's environment says
        self._controller_name = controller
        self._controller: ray.actor.ActorHandle | None = None
        self._notice = threading.Event()
        self._beater: beats.Beater | None = None  # this host's sign of life to the controller (`start`)
        self._notice_reason: str | None = None
        self.multislice: dict[str, str] = {}  # this launch's multislice settings (`runtime.multislice_env`)
        self._result: WorkerResult | None = None
        self._done = threading.Event()  # set with `_result`
        self._ctx: api.Context | None = None  # the training API's context of the running program
        self._keeper = None  # this host's `workers.memory.HostMemory` (a multi-slice job's first tier), or None
        self._history: list[dict] = []
        self._fence_dir: str | None = None  # where the fence is: the job's checkpoint folder
        self._storage_endpoint: str | None = None
        self._steps_total: int | None = None  # for the progress lines in the log
        self._out = LineBuffer(sys.stdout)
        self._profiler = Profiler(self.rank, num_hosts, self._send)  # captures `orchestrator profile` asks for
        sys.stdout = self._out  # what the job's code prints reaches `orchestrator logs` (and still Ray's log file)
        runtime.configure(platform=self._platform, devices_per_host=devices_per_host,
                          compile_cache_dir=compile_cache_dir)
        route_logs(self._out)
        install_sigterm(self._on_notice)
        # What the job's code starts ends with this worker.
        reaper.guard(f"{job_id}-g{generation}-" + ("spare" if rank is None else f"w{rank}"))
        if workload_type == "lm":
            threading.Thread(target=_preload_lm, daemon=True, name="preload").start()

    # -- called by the controller -------------------------------------------------

    def info(self) -> dict:
        ctx = ray.get_runtime_context()
        return {"node_id": ctx.get_node_id(), "ip": ray.util.get_node_ip_address(), "rank": self.rank,
                "pid": os.getpid(), "multislice": self.multislice, "platform": self._platform}

    def take(self, rank: int, num_hosts: int,
             controller: "tuple[str, str] | ray.actor.ActorHandle | None") -> dict:
        """A spare becomes rank `rank` of its generation's `num_hosts` (only then known: which slices the
        launch has); `controller`: where it reports, which may have restarted since the spare was made."""
        self.rank, self.num_hosts = rank, num_hosts
        self._controller_name, self._controller = controller, None
        self._profiler = Profiler(rank, num_hosts, self._send)
        return self.info()

    def coordinator_address(self) -> str:
        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((ip, 0))
            return f"{ip}:{s.getsockname()[1]}"

    def coordinator_listening(self, address: str, timeout_s: float) -> bool:
        """Whether the runtime's coordinator, which process 0's `start` brings up, accepts connections.

        Another process that tries to join before it does backs off for up to a second
        before trying again, so the controller starts the others once this says yes.
        """
        host, port = address.rsplit(":", 1)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                socket.create_connection((host, int(port)), timeout=0.5).close()
                return True
            except OSError:
                time.sleep(0.02)
        return False

    def start(self, coordinator: str | None, order: LaunchOrder, share_key: bytes | None = None,
              beat: tuple[tuple[str, int], bytes, float] | None = None, *, keeper=None) -> None:
        """Begin running `order` (every host of the launch gets the same) on a thread; poll `result()` for the end.

        `share_key`: this launch's key for the bytes hosts hand each other through the
        runtime's coordinator (`runtime.initialize`); it comes over Ray's authenticated
        channel and is never logged. `beat`: where this host sends its beats, the launch's
        key that seals them (the same way, never logged) and their period (`workers.beats`).
        `keeper`: this host's own copy of the state in its memory (`workers.memory.HostMemory`), or None.
        """
        if beat is not None and self._beater is None:
            self.beat_to(*beat)
        self._keeper = keeper
        threading.Thread(target=self._main, args=(coordinator, order, share_key), daemon=True,
                         name="train").start()

    def beat_to(self, address: tuple[str, int], key: bytes, period_s: float) -> None:
        """Send this host's beats to `address` from now on, sealed with `key` (`workers.beats`): at `start`, and
        when a restarted controller adopts this worker (its monitor is a new one)."""
        if self._beater is not None:
            self._beater.stop()
        self._beater = beats.Beater((str(address[0]), int(address[1])), key, self.job_id, self.generation,
                                    self.rank, period_s).start()

    def result(self) -> WorkerResult | None:
        """None while training; then how it ended."""
        return self._result

    def wait_result(self, timeout_s: float) -> WorkerResult | None:
        """How it ended, as soon as it has; None if it still trains after `timeout_s` (the controller asks again,
        so a call never outlives a controller that went by long: `orchestrator.control.ends`)."""
        self._done.wait(timeout_s)
        return self._result

    def history(self) -> list[dict]:
        """Every step report of this worker so far, each with the checkpoint committed after it if one was
        (`protocol.saved_entry`), for a controller that missed some."""
        return list(self._history)

    def request_stop(self, reason: str) -> None:
        """A preemption notice from the controller: save at the current step, commit, stop."""
        self._on_notice(f"controller: {reason}")

    def request_profile(self, request: CaptureRequest) -> None:
        """A profile capture (`workers.profiling`): every host votes it; the chosen ones trace it."""
        self._profiler.request(request)

    # -- the training thread -------------------------------------------------------

    def _main(self, coordinator: str | None, order: LaunchOrder, share_key: bytes | None) -> None:
        t0 = time.perf_counter()
        watcher = None
        try:
            # Before anything touches a bucket: tensorstore, gcsfs and epath take their endpoint once.
            self._storage_endpoint = order.storage_endpoint
            storage.configure(self._storage_endpoint)
            self._fence_dir = order.fence_dir
            if order.metadata_url:
                watcher = MetadataWatcher(order.metadata_url, self._notice, self._on_notice)
            settings = order.settings
            self.multislice = runtime.initialize(
                coordinator_address=coordinator, num_processes=self.num_hosts, process_id=self.rank,
                host_address=ray.util.get_node_ip_address(), share_key=share_key,
                slice_id=self.rank * settings.slices // self.num_hosts, num_slices=settings.slices,
                platform=self._platform)
            if self._platform == accelerator.TPU:  # the backend starts here, once every process has joined
                kind = accelerator.check_tpu(self._claim, self._devices_per_host)
                log.info("on %d %s chips", self._devices_per_host, kind)
            self._send(Ready(time.perf_counter() - t0))
            if isinstance(order.program, BuiltInTrainer):
                result = self._run_lm(order, order.program)
            else:
                result = self._run_entrypoint(order, order.program)
        except accelerator.PlatformError as e:  # not the host its slice claims: nothing of the job's ran
            log.error("%s", e)
            result = WorkerResult(Ending.FAILED, self.rank, error=str(e), cause=FailureCause.PLATFORM.value)
        except fences.FolderTaken as e:  # at a save: the fence names another job
            log.error("%s", e)
            result = WorkerResult(Ending.FAILED, self.rank, error=str(e), cause=FailureCause.FOLDER_TAKEN.value)
        except SystemExit as e:  # the job's code called sys.exit(): an end it chose, never to be taken for a hang
            result = self._exited(e)
        except Exception as e:  # noqa: BLE001 -- the boundary of user code: reported, typed, with its traceback
            tb = traceback.format_exc()
            print(tb, file=self._out)
            chain = error_chain(e)
            cause = failure_cause(chain, importing=isinstance(e, EntrypointError))
            result = WorkerResult(Ending.FAILED, self.rank, error=error_line(e, chain, cause), traceback=tb,
                                  cause=cause.value)
        finally:
            if watcher:
                watcher.close()
        self._send(Lines(), wait=True)  # the last lines land before the controller sees the result
        self._result = result
        self._done.set()

    def _on_notice(self, reason: str) -> None:
        if not self._notice.is_set():
            self._notice_reason = reason
            self._notice.set()
            log.warning("preemption notice (%s): saving at the current step, then stopping", reason)
            self._send(Noticed(reason))

    def _any_host_noticed(self) -> bool:
        """Whether any host got a notice: all hosts must stop after the same step.

        The same one collective a step also agrees on the step a profile capture begins.
        """
        return self._profiler.vote(self._notice.is_set())

    def _context(self, order: LaunchOrder) -> api.Context:
        """The training API's context of the program this worker runs (kept, for its loop after a
        sys.exit): the launch's settings and this worker's hooks."""
        import jax

        from workers import api

        settings = order.settings
        if jax.default_backend() != "tpu":  # MFU against the slice type's peak means something only on its chips
            settings = dataclasses.replace(settings, peak_flops_per_chip=None)  # (CPU devices stand in locally)
        self._steps_total = settings.steps
        args = order.program.args if isinstance(order.program, UserEntrypoint) else {}
        self._ctx = api.Context(rank=self.rank, num_hosts=self.num_hosts, args=args, settings=settings,
                                stop_requested=self._notice.is_set, may_write=self._may_write,
                                agreed_stop=self._any_host_noticed, send=self._send, profiler=self._profiler,
                                keeper=self._keeper)
        return self._ctx

    def _ended(self, loop) -> WorkerResult:
        """How a program that ran the API's loop ended (all hosts get here together)."""
        from workers.api import param_checksums

        if loop.stopped and not loop.completed:
            log.warning("stopped after step %d with its checkpoint committed (%s)", loop.step,
                        self._notice_reason or "another host's notice")
            return WorkerResult(Ending.STOPPED, self.rank, steps=loop.step, notice=self._notice_reason)
        state = loop.state
        params = state["params"] if isinstance(state, dict) and "params" in state else state
        return WorkerResult(Ending.SUCCEEDED, self.rank, steps=loop.step, param_sums=param_checksums(params))

    def _run_lm(self, order: LaunchOrder, program: BuiltInTrainer) -> WorkerResult:
        from workers.ahead import CompileAhead
        from workers.train import Trainer  # after runtime.configure

        ctx = self._context(order)
        ahead = CompileAhead.for_host(order, rank=self.rank, num_hosts=self.num_hosts,
                                      devices_per_host=self._devices_per_host, platform=self._platform,
                                      cache=self._compile_cache_dir, send=self._send)
        trainer = Trainer(program.lm, ctx)
        self._look_for_stored_program(order, trainer)
        trainer.run(ahead=ahead)
        return self._ended(ctx.last_loop)

    def _look_for_stored_program(self, order: LaunchOrder, trainer) -> None:
        """Keep the train step compiled ahead for this host's shape, if the job's storage has one it can use."""
        from workers import programs, stored_programs
        from workers.protocol import ProgramLooked
        from workers.train import program_config

        def tell(found: stored_programs.Lookup, *, kept: bool = False) -> None:
            log.info("stored program for %s: %s", found.target, found.reason if found.used else
                     f"{'loading the one this host keeps' if kept else 'compiling'} ({found.reason})")
            self._send(ProgramLooked(found.target, found.used, found.reason, kept=kept))

        try:
            program_id = trainer.program_id("train_step")
            found = stored_programs.take(order.programs, endpoint=order.storage_endpoint, platform=self._platform,
                                         name="train_step", config=program_config(trainer.lm, trainer.settings),
                                         program_id=program_id)
        except Exception as e:  # never the job's failure: the host compiles as it would have
            log.warning("stored program: not looked for (%s: %s); compiling", type(e).__name__, e, exc_info=True)
            return
        if found is None or not found.used:
            if found is not None:
                path = programs.kept_program_path(program_id)
                tell(found, kept=path is not None and path.exists())
            return
        compile_step = trainer.compile

        def compile_and_tell():  # whether the runtime could load the executable is known once it compiled
            step = compile_step()
            tell(stored_programs.loaded(found, program_id))
            return step

        trainer.compile = compile_and_tell

    def _run_entrypoint(self, order: LaunchOrder, program: UserEntrypoint) -> WorkerResult:
        if program.workdir and program.workdir not in sys.path:
            sys.path.insert(0, program.workdir)
        try:
            fn = getattr(importlib.import_module(program.module), program.function)
        except Exception as e:  # the module, a module it imports, or the function: the same on every slice
            raise EntrypointError(f"cannot import the entrypoint {program.entrypoint}: {type(e).__name__}: {e}") \
                from e
        ctx = self._context(order)
        fn(ctx)
        if ctx.last_loop is not None:
            ctx.last_loop.close()
            return self._ended(ctx.last_loop)
        return WorkerResult(Ending.SUCCEEDED, self.rank)  # a program that runs its own loop

    def _exited(self, e: SystemExit) -> WorkerResult:
        """The job's code called sys.exit(): with status 0 and no step of the training API's loop
        left (or no such loop), the end of the program; otherwise a failure that says so."""
        code = e.code
        status = 0 if code is None else code if isinstance(code, int) else 1  # sys.exit("message") exits 1
        loop = getattr(self._ctx, "last_loop", None)
        if loop is not None:
            try:
                loop.close()  # the last save committed, as after a return
            except Exception as err:  # the exit is what this worker reports; the log keeps this
                log.error("after sys.exit(): the last save failed: %s: %s", type(err).__name__, err, exc_info=True)
        if status == 0 and (loop is None or loop.completed):
            return self._ended(loop) if loop is not None else WorkerResult(Ending.SUCCEEDED, self.rank)
        done = f" with {loop.step} of {loop.total} steps done" if loop is not None else ""
        message = f"the job's code called sys.exit({code!r}){done}"
        log.error("%s", message)
        return WorkerResult(Ending.FAILED, self.rank, steps=loop.step if loop is not None else None, error=message,
                            cause=FailureCause.EXIT.value, exit_code=status)

    # -- fencing and reporting ------------------------------------------------------

    def _may_write(self) -> bool:
        """Fencing: only the job's current generation may write checkpoints (`workers.fence.may_write`)."""
        return not self._fence_dir or fences.may_write(self._fence_dir, endpoint=self._storage_endpoint,
                                                       job_id=self.job_id, generation=self.generation)

    def _log_progress(self, r: StepDone) -> None:
        total = self._steps_total
        if self.rank != 0 or not total:
            return
        every = max(1, total // 10)
        if (r.step + 1) % every == 0 or r.step + 1 == total:
            rate = f" ({r.tokens_per_s:.0f} tokens/s)" if r.tokens_per_s else ""
            log.info("step %d/%d loss %.4f%s", r.step + 1, total, r.loss, rate)

    def _ctrl(self):
        if self._controller is None and self._controller_name and not isinstance(self._controller_name, tuple):
            self._controller = self._controller_name  # the controller's inbox (`workers.inbox`)
        if self._controller is None and self._controller_name and isinstance(self._controller_name, tuple):
            name, namespace = self._controller_name
            try:
                self._controller = ray.get_actor(name, namespace=namespace)
            except ValueError:
                return None
        return self._controller

    def _send(self, report: Report, *, wait: bool = False) -> None:
        if isinstance(report, StepDone):
            self._history.append({**dataclasses.asdict(report), "at": time.time()})
            self._log_progress(report)
        elif isinstance(report, Saved) and self._history:  # kept with the step it followed (`history`)
            self._history[-1] = {**self._history[-1], **saved_entry(report)}
        lines = self._out.drain()
        ctrl = self._ctrl()
        if ctrl is None:
            return
        try:
            sent = ctrl.report.remote(self.job_id, self.generation, self.rank, report, lines)
            if wait:
                ray.get(sent, timeout=10)
        except ray.exceptions.RayError as e:  # a restarting controller: look it up again next time
            print(f"report to the controller failed: {e!r}", file=sys.__stderr__, flush=True)  # Ray's worker log
            self._controller = None
