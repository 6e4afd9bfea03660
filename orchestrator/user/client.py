"""The Python API: `Client().submit(JobSpec.from_yaml(path))` and the `Job` handle it returns.

With no address, the client uses the embedded local cluster: the one `orchestrator up`
started (recorded in the state directory), or a new one it starts itself. Reading a
job (status, events, metrics, logs) needs only the state directory, not Ray, so it
works from any shell.

Examples::

    from orchestrator import Client, JobSpec
    client = Client()
    job = client.submit(JobSpec.from_yaml("examples/tiny-lm.yaml"))
    final = job.wait()
    print(final.state, final.loss)
    client.close()  # stops the cluster if this client started it
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator import catalog, cluster
from orchestrator.catalog import Tier
from orchestrator.cluster.driver_output import keep_ray_quiet
from orchestrator.cluster.processes import stop_marked
from orchestrator.control import ownership
from orchestrator.control.ownership import OnExisting
from orchestrator.control.shipping import pack_folder
from orchestrator.domain.spec import EntrypointWorkload, JobSpec, LmWorkload
from orchestrator.errors import (
    ClusterError,
    JobNotFoundError,
    JobStateError,
    OrchestratorError,
    OutputFileError,
    SpecError,
    StoreFaultError,
)
from orchestrator.observe.metrics import read_store_fault
from orchestrator.state.states import JobState
from orchestrator.state.store import JobRecord, Store
from orchestrator.user.entrypoint import check_entrypoint
from orchestrator.user.job import CLUSTER_GONE, Job, JobStatus, _status
from orchestrator.user.preflight import gcp_problems
from workers import storage

if TYPE_CHECKING:
    from orchestrator.user.compiled import CompiledOption
    from orchestrator.user.planning import JobPlan

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Plan:
    """`Client.plan`'s answer: the expected cost of each option and the policy's plan; with `compile`, the TPU
    compiler's row for each option (`refusal()` says why one cannot run), else None."""

    costs: JobPlan
    compiled: list[CompiledOption] | None

    @property
    def refusals(self) -> list[str]:
        return [line for r in self.compiled or [] if (line := r.refusal()) is not None]


CONNECT_TRIES, CONNECT_WAIT_S = 2, 10.0  # joining a cluster this client started: tries, and the wait between


def _busy_advice(home: cluster.Home) -> str:
    """What to do when the cluster does not answer: how busy the machine is, where the logs are."""
    try:
        load = f"this machine's load average is {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; "
    except OSError:
        load = ""
    return (f"{load}Ray's head may still be starting: try again in a minute, or run `orchestrator down` then "
            f"`orchestrator up` and read {home.root / 'logs' / 'head.log'}")


class Client:
    def __init__(self, *, address: str | None = None, home: str | Path | None = None, stopping: bool = False):
        """`stopping`: for `down`, which must work even when the running cluster's store was deleted."""
        self.home = (cluster.Home(Path(home).expanduser().resolve()) if home else cluster.Home.default()).ensure()
        self.address = address
        # A new, empty store beside a running cluster's deleted one would hide every job it runs (and share
        # its write-ahead log): refused, saying how to get the jobs back.
        cluster_runs = self.home.cluster_file.exists() and not stopping
        try:
            self.store = Store(self.home.db, create=not cluster_runs)
        except StoreFaultError as e:
            raise StoreFaultError(e.path, e.cause, f"{e.detail}; {_advice(self.home, e.cause)}") from None
        self._connected = False
        self._owns_cluster = False
        self._cluster_seen: tuple[float, str] = (-1e9, "gone")
        self._fault_seen: tuple[float, str | None] = (-1e9, None)

    # -- cluster ---------------------------------------------------------------

    def connect(self) -> None:
        """Reach the cluster (starting the embedded one if needed) and its controller."""
        if self._connected:
            return
        import ray

        if self.address is None:
            cluster.apply_ray_env(self.home)
            info = cluster.read_cluster(self.home)
            if info is None:
                info = cluster.start_head(self.home, owner="submit")
                self._owns_cluster = True
            elif not cluster.answers(info):  # Ray's driver would retry a dead head for minutes
                raise ClusterError(f"the cluster at {info.address} (state in {self.home.root}) does not answer; "
                                   "`orchestrator down` stops what is left of it")
            address = info.address
        else:
            address = self.address
        keep_ray_quiet(self.home)  # Ray's own messages go to logs/driver.log, not to the user's terminal
        tries = CONNECT_TRIES if self._owns_cluster else 1  # a head just started on a loaded machine can be slow
        for attempt in range(1, tries + 1):
            try:
                ray.init(address=address, namespace=cluster.NAMESPACE, logging_level=logging.WARNING,
                         log_to_driver=False, configure_logging=False)
                break
            except ConnectionError as e:
                if attempt < tries:
                    log.warning("cannot reach the Ray cluster at %s yet (%s); trying again in %.0f s", address, e,
                                CONNECT_WAIT_S * attempt)
                    time.sleep(CONNECT_WAIT_S * attempt)
                    continue
                if self._owns_cluster:  # leave nothing running behind a failed start
                    cluster.stop_cluster(self.home)
                times = f"{tries} tries" if tries > 1 else "1 try"
                raise ClusterError(f"cannot reach the Ray cluster at {address} ({times}): {e}. "
                                   f"{_busy_advice(self.home)}") from None
        keep_ray_quiet(self.home)  # again: connecting set Ray's logging up anew
        self._connected = True
        try:
            self._ensure_controller(address)
        except Exception:
            self.close()
            raise

    def _ensure_controller(self, address: str):
        import ray

        from orchestrator.control.controller import Controller

        try:
            return ray.get_actor(cluster.CONTROLLER_NAME, namespace=cluster.NAMESPACE)
        except ValueError:
            pass
        has_head_resource = ray.cluster_resources().get(cluster.CONTROLLER_RESOURCE, 0) > 0
        ctrl = ray.remote(Controller).options(
            name=cluster.CONTROLLER_NAME, namespace=cluster.NAMESPACE, lifetime="detached", get_if_exists=True,
            num_cpus=0, max_concurrency=64, max_restarts=-1,
            resources={cluster.CONTROLLER_RESOURCE: 0.01} if has_head_resource else None,
        ).remote(str(self.home.root), address)
        # Ray types an actor handle's method as the class's own (without .remote).
        ray.get(ctrl.ping.remote(), timeout=120)  # type: ignore[attr-defined]
        return ctrl

    def controller(self):
        import ray

        self.connect()
        return ray.get_actor(cluster.CONTROLLER_NAME, namespace=cluster.NAMESPACE)

    @property
    def owns_cluster(self) -> bool:
        return self._owns_cluster

    def close(self, *, stop_owned_cluster: bool = True) -> None:
        """Disconnect; stop the embedded cluster if this client started it and no job is active."""
        if not self._connected:
            return
        import ray

        if stop_owned_cluster and self._owns_cluster and not self.store.jobs(active_only=True):
            self._shutdown_controller()
            ray.shutdown()
            cluster.stop_cluster(self.home)
        else:
            ray.shutdown()
        self._connected = False

    def _shutdown_controller(self) -> None:
        import ray

        try:
            ctrl = ray.get_actor(cluster.CONTROLLER_NAME, namespace=cluster.NAMESPACE)
            ray.get(ctrl.shutdown.remote(), timeout=120)
            ray.kill(ctrl, no_restart=True)
        except ValueError:
            pass

    def down(self) -> bool:
        """Cancel active jobs, release every slice, stop the embedded cluster. False if none ran.

        Only processes that are this cluster's nodes are stopped (`cluster.session_is_ours`);
        a recorded id that another program holds now is left alone and logged. A head that
        does not answer is stopped without asking its controller first.
        """
        info = cluster.read_cluster(self.home)
        if info is None:
            self._release_recorded_slices()
            stop_marked(self.home)  # what a job's code left running past the cluster
            (self.home.root / "metrics.json").unlink(missing_ok=True)
            return False
        import ray

        try:
            if cluster.answers(info):
                self.connect()
                self._shutdown_controller()
            else:
                log.warning("the cluster at %s does not answer; stopping its processes", info.address)
        except Exception:  # whatever the controller says, the cluster goes down
            log.exception("the controller did not shut down cleanly; stopping the cluster anyway")
        finally:
            ray.shutdown()
            self._connected = False
            self._release_recorded_slices()
            cluster.stop_cluster(self.home)
            stop_marked(self.home)  # what a job's code started and hid from the nodes' sessions
        (self.home.root / "metrics.json").unlink(missing_ok=True)  # its server went with the controller
        return True

    def _release_recorded_slices(self) -> list[int]:
        """Stop the hosts of every slice the store says is live; returns the ids left alone (not ours)."""
        from orchestrator.providers.local import release_recorded

        return [pgid for rec in self.store.slices(live_only=True)
                for pgid in release_recorded(self.home, self.store, rec)]

    # -- jobs ------------------------------------------------------------------

    def _ask(self, method: str, *args, timeout_s: float = 60):
        """Call the controller's `method` and wait for its answer.

        An `OrchestratorError` the controller raises is raised here as itself (not wrapped
        in Ray's `RayTaskError`); a controller that died or does not answer is a
        `ClusterError`. Any other error of the controller's stays a `RayTaskError`.
        """
        import ray

        ctrl = self.controller()
        try:
            return ray.get(getattr(ctrl, method).remote(*args), timeout=timeout_s)
        except ray.exceptions.RayTaskError as e:
            log.debug("controller.%s failed: %s", method, e)  # str(e) holds the remote traceback
            if isinstance(e.cause, OrchestratorError):
                raise e.cause from None
            raise
        except ray.exceptions.GetTimeoutError:
            raise ClusterError(f"the controller did not answer {method} within {timeout_s:g} s") from None
        except ray.exceptions.RayActorError as e:
            raise ClusterError(f"the controller died during {method}: {e.error_msg}") from None

    def submit(self, spec: JobSpec, *, workdir: str | Path | None = None, source: str = "<spec>",
               fresh: bool = False, resume_anyway: bool = False) -> Job:
        """Hand a job to the controller; returns at once with its handle.

        The job's checkpoint folder is its own (`orchestrator.control.ownership`): checkpoints of
        the same run there are resumed; `FolderInUseError` if a job that has not ended uses the
        folder; `FolderMismatchError`, naming each setting that differs, if the folder holds
        checkpoints of a run with another model, optimizer or data (or of a run nobody recorded).
        `fresh=True` moves any checkpoints there aside to ``<folder>.replaced-<UTC time>`` and starts
        from step 0; `resume_anyway=True` resumes them whatever run wrote them.

        Example::

            job = client.submit(spec)                   # resumes the same run's checkpoints, if any
            job = client.submit(spec, fresh=True)       # starts over; the old checkpoints are kept aside

        Raises `SpecError` if the controller refuses the spec (with its `problems`), or if
        the token files of `workload.data` are missing, truncated, of another dtype, beyond
        the model's vocabulary or too short, or if an entrypoint's module or function is not in
        the job's folder (`orchestrator.user.entrypoint`): checked here, before any cluster is
        started or slice provisioned. `source` (the job file) is named in those errors.
        """
        if fresh and resume_anyway:
            raise SpecError(source, [("", "fresh and resume_anyway exclude each other: start over, or resume")])
        on_existing = OnExisting.FRESH if fresh else OnExisting.RESUME_ANYWAY if resume_anyway else OnExisting.CHECK
        check_data(spec, source)
        check_entrypoint(spec, source, workdir)
        if self.address is None and (claimed := self._with_folder(spec)) is not None:
            # The controller's state directory is this one: refuse before any cluster starts. The controller
            # asks again, and records the job in the same transaction.
            ownership.claim(self.store, claimed, on_existing)
        # The embedded cluster always listens on 127.0.0.1; TPU VMs are told its address unless gcp.head_address.
        folder = spec.workdir or (str(Path(workdir).resolve()) if workdir else None)
        problems = gcp_problems(spec, self.address or "127.0.0.1:6379", folder=folder)  # the program's imports too
        if problems:
            raise SpecError(source, problems)
        code = None
        if spec.workload.type == "entrypoint":
            if folder is None:
                raise SpecError(source, [("workdir", "an entrypoint job needs the folder its module is imported "
                                                     "from (workdir, or submit(..., workdir=...))")])
            code = pack_folder(folder, source=source)  # shipped to every host: TPU VMs share no disk with us
        # Starting fresh moves the old checkpoints aside: one rename on disk, a copy of each object in a bucket.
        job_id = self._ask("submit", spec.model_dump(mode="json"), folder, code, on_existing.value,
                           timeout_s=600 if fresh else 60)
        return Job(self, job_id)

    def _with_folder(self, spec: JobSpec) -> JobSpec | None:
        """`spec` with its checkpoint folder resolved; None for a name no folder can have (a spec that skipped
        validation): the controller refuses it, naming the field."""
        try:
            return spec.with_checkpoint_directory(self.home.default_checkpoint_dir(spec.name))
        except ValueError:
            return None

    def export(self, job_id: str, out: str | Path, *, step: int | None = None, latest: bool = False,
               force: bool = False, subtree: str | None = None):
        """Write a job's trained parameters to `out` as safetensors with config.json (`workers.export`).

        The newest committed checkpoint of a SUCCEEDED job; for a job in any other state,
        `latest=True` takes its newest committed checkpoint and `step` a given one. Needs only
        the state directory and the checkpoint folder, not a cluster. Returns `Exported`.

        Raises `JobNotFoundError`, `JobStateError` (not SUCCEEDED, and neither `step` nor
        `latest`), `workers.export.ExportError` (no such checkpoint or step; `out` not empty
        without `force`, a file, a symbolic link, a name with a line break, a folder that
        cannot be made there, inside or around any job's checkpoint folder, or a bucket that
        does not answer: `orchestrator.user.outputs`, checked before the checkpoint is read),
        ValueError (both `step` and `latest`). `subtree`: the part of the state to write, as
        `workers.export.export_checkpoint` takes it (None: ``params``, or the whole state without one).

        Example::

            client.export("tiny-lm", "weights/")
            params, config = workers.export.load("weights/")
        """
        from orchestrator.user.outputs import check_output_folder, check_reachable
        from workers.export import ExportError, export_checkpoint

        if latest and step is not None:
            raise ValueError("latest and step exclude each other: the newest committed step, or a given one")
        job = self.store.find_job(job_id)
        if step is None and not latest and job.state is not JobState.SUCCEEDED:
            raise JobStateError(job.id, job.state.value, "exported without --latest or --step",
                                (JobState.SUCCEEDED.value,))
        spec = job.spec
        w = spec.workload
        lm = w if isinstance(w, LmWorkload) else None
        config = {"job": {"id": job.id, "name": job.name, "state": job.state.value},
                  "workload": w.entrypoint if isinstance(w, EntrypointWorkload) else "lm",
                  "model": lm.model.model_dump(mode="json") if lm else None,
                  "data": w.data.path if w.data else None}
        directory = spec.checkpoint.directory or str(self.home.default_checkpoint_dir(job.name))
        try:
            out = check_output_folder(os.fspath(out), force=force)
            self._refuse_checkpoint_folders(out)
            in_bucket = next((url for url in (out, directory) if storage.is_url(url)), None)
            if in_bucket is not None:  # one endpoint serves both
                check_reachable(in_bucket, spec.storage.endpoint)
        except OutputFileError as e:
            raise ExportError(e.path, e.problem) from None
        storage.configure(spec.storage.endpoint)  # where the job's gs:// folders are
        return export_checkpoint(directory, out, step=step, config=config, force=force, subtree=subtree)

    def _refuse_checkpoint_folders(self, out: str | Path) -> None:
        """An ExportError if `out` is inside, is, or holds a job's checkpoint folder: writing (or with
        --force replacing) it there would break that job's checkpoints, and its next export or restore."""
        from workers.export import ExportError

        if storage.is_url(out):
            for job in self.store.jobs():
                url = job.spec.checkpoint.directory or ""
                their_prefix, my_prefix = url.rstrip("/") + "/", str(out).rstrip("/") + "/"
                if storage.is_url(url) and (my_prefix.startswith(their_prefix) or their_prefix.startswith(my_prefix)):
                    raise ExportError(str(out), f"is inside or holds the checkpoint folder of job {job.id} "
                                                f"({url}); write the export elsewhere")
            return
        mine = Path(os.path.realpath(out))
        for job in self.store.jobs():
            folder = job.spec.checkpoint.directory or self.home.default_checkpoint_dir(job.name)
            if storage.is_url(folder):  # a bucket: not a path on this machine
                continue
            theirs = Path(os.path.realpath(folder))
            if mine == theirs or theirs in mine.parents:
                raise ExportError(str(out), f"is inside the checkpoint folder of job {job.id} ({folder}); "
                                            "write the export elsewhere")
            if mine in theirs.parents:
                raise ExportError(str(out), f"holds the checkpoint folder of job {job.id} ({folder}); "
                                            "write the export elsewhere")

    def plan(self, spec: JobSpec, *, compile: bool = False, deadline_hours: float | None = None,
             trace: str | Path | None = None, progress: Callable[[str], None] = lambda line: None) -> Plan:
        """What the job would cost on each option, and what the cost policy would do (`planning.plan_spec`);
        with `compile`, first the TPU compiler's verdict and figures for every option the job may run on
        (`compiled.compile_options`, reports kept under this home's ``tpu-programs``). Needs no cluster.

        Raises:
          ValueError: a field the plan lacks (a deadline, the token count; for a program of the user's own
            without `compile`, its FLOPs), or (`workers.api.StepNotDeclared`) a program that does not declare
            its step to `ctx.loop`.
          workers.tpu_target.TargetUnavailable: `compile` without XLA's TPU compiler (libtpu) here.
        """
        from orchestrator.user.compiled import compile_options, compiled_steps, model_flops_per_step
        from orchestrator.user.planning import plan_spec

        rows = compile_options(spec, cache_dir=self.home.tpu_programs, progress=progress) if compile \
            else None
        flops = model_flops_per_step(spec, rows)[0] if rows is not None else None
        return Plan(plan_spec(spec, deadline_hours=deadline_hours, trace_path=trace,
                              model_flops_per_step=None if isinstance(spec.workload, LmWorkload) else flops,
                              compiled=compiled_steps(spec, rows) if rows is not None else None), rows)

    def job(self, job_id: str) -> Job:
        """A job by id, unique id prefix, or name (its newest job)."""
        try:
            return Job(self, self.store.find_job(job_id).id)
        except JobNotFoundError:
            if (fault := self.store_fault()) is None:
                raise
            raise ClusterError(f"no job {job_id!r} in {self.home.db}, and {fault}") from None

    def jobs(self) -> list[JobStatus]:
        return [self._status_of(j) for j in self.store.jobs()]

    def cluster_state(self) -> str:
        """"up" while the embedded cluster runs, "gone" when it does not, "remote" for a cluster at `address`.

        Read from the state directory (a look at its processes), at most once a second.
        """
        if self.address is not None:
            return "remote"
        now = time.monotonic()
        if now - self._cluster_seen[0] > 1.0:
            self._cluster_seen = (now, "up" if cluster.read_cluster(self.home) is not None else "gone")
        return self._cluster_seen[1]

    def store_fault(self) -> str | None:
        """Why the controller cannot write the store now, with since when; None while it can (or no cluster runs).

        Asked of the controller's metrics endpoint (the store cannot say it), at most once a second.
        """
        now = time.monotonic()
        if now - self._fault_seen[0] <= 1.0:
            return self._fault_seen[1]
        line = None
        if self.cluster_state() == "up":
            try:
                url = json.loads((self.home.root / "metrics.json").read_text())["url"]
                fault = read_store_fault(url)
            except (OSError, ValueError, KeyError) as e:  # a controller starting or gone: nothing to say
                log.debug("no store health from the controller: %s", e)
                fault = None
            if fault is not None:
                since = time.strftime("%H:%M:%S", time.localtime(fault.get("since", time.time())))
                line = f"{fault['message']} since {since}; {_advice(self.home, fault['cause'], fault.get('held', 0))}"
        self._fault_seen = (now, line)
        return line

    def _status_of(self, job: JobRecord) -> JobStatus:
        """The job's status, with its place in the queue and, while not ended, whether a cluster runs it."""
        from orchestrator.control.queue import queue_position
        from orchestrator.observe.timeline import deadline_line, move_line, wall_time

        st = replace(_status(job, self.store.last_step(job.id)), wall_s=wall_time(self.store, job))
        if st.done:
            return st
        return replace(st, queue_position=queue_position(self.store, job), cluster=self.cluster_state(),
                       moving=move_line(self.store, job), warning=deadline_line(self.store, job),
                       store_fault=self.store_fault())

    def cancel(self, job_id: str) -> None:
        """Ask the job to stop: its hosts checkpoint the current step and stop, its slice is released.

        Raises `JobNotFoundError`, and `JobStateError` for a job that has already ended
        (SUCCEEDED, FAILED or CANCELLED): there is nothing to cancel.
        """
        job = self.store.find_job(job_id)
        if job.state.terminal:
            raise JobStateError(job.id, job.state.value, "cancelled",
                                tuple(s.value for s in JobState if not s.terminal),
                                why="it has ended: nothing to cancel")
        job_id = job.id
        running = cluster.read_cluster(self.home) is not None or self.address is not None
        try:
            self.store.update_job(job_id, cancel_requested=1)  # seen by the controller even if Ray is unreachable
        except StoreFaultError:
            if not running:  # no controller to hear it either
                raise
            log.warning("the store cannot be written now; the controller is told directly")
        if running:
            self._ask("cancel", job_id)

    def resize(self, job_id: str, accelerator: str, *, reason: str = "requested by the user",
               tier: Tier | str | None = None) -> Job:
        """Move a RUNNING job to another slice type (and tier); returns once the controller accepted.

        The job checkpoints its current step, releases its slice, gets one of `accelerator`
        and restores resharded onto it; global batch and schedule stay the same.

        Raises `JobNotFoundError`, `UnknownAcceleratorError` (checked here, before any
        cluster is asked), `SpecError` (a bad tier, or the job does not fit the new slice),
        and `JobStateError` if the job is not RUNNING.

        Example::

            client.resize("tiny-lm", "v4-32", reason="more chips are free")
            client.resize("tiny-lm-3f2a1c", "v4-16", tier="on-demand")
        """
        job = self.store.find_job(job_id)
        catalog.lookup(accelerator)
        if tier is not None:
            tier = _tier(tier).value
        if job.state.terminal:  # final: no need to start or ask a cluster to say so
            raise JobStateError(job.id, job.state.value, "resized", (JobState.RUNNING.value,))
        JobSpec.from_dict({**job.spec.model_dump(mode="json"), "accelerator": accelerator,
                           "tier": tier or job.spec.tier.value}, source=f"resize of {job.id} to {accelerator}")
        self._ask("resize", job.id, accelerator, reason, tier)  # JobStateError unless RUNNING
        return Job(self, job.id)

    def profile(self, job_id: str, *, steps: int = 3, host: int | None = None, memory: bool = False,
                timeout_s: float = 300.0, read: bool = True):
        """Trace `steps` steps of a RUNNING job on every host (or host `host`), from one step they all agree on.

        Blocks until the hosts are done (or `timeout_s`); returns the `Capture`
        (`orchestrator.user.capture`): where the traces are (beside the job's checkpoints,
        one folder per host), the steps traced, each host's device memory, and with `read`
        each host's summary read from its trace (step time, compute / collectives / idle,
        top ops). `memory`: also a pprof profile of device memory per host.

        Raises `JobNotFoundError`, `JobStateError` (the job is not RUNNING: queued, starting
        or ended), `ProfileError` (steps not 1 to 100, no such host, a capture already under
        way), `CaptureError` (training stopped before the capture began, or no host began it
        within `timeout_s`: a program that runs its own loop instead of `ctx.loop`).

        Example::

            capture = client.profile("tiny-lm", steps=3)
            print(capture.path, capture.traces[0].summary.step_time_s)
        """
        from orchestrator.user.capture import profile

        return profile(self, job_id, steps=steps, host=host, memory=memory, timeout_s=timeout_s, read=read)


def check_data(spec: JobSpec, source: str = "<spec>") -> None:
    """A `SpecError` on `workload.data.path` if its token files cannot be trained on (`workers.tokens.check`).

    A URL this machine cannot read (no filesystem library for it, such as gcsfs for gs://,
    or no permission: a bucket only the TPU VMs may read) is left to the workers, which
    check it again before their first step; a URL that answers "not found" is refused here.
    """
    from orchestrator.domain.spec import LmWorkload
    from workers.tokens import DataError, check

    w = spec.workload
    if w.data is None:
        return
    vocab = w.model.vocab_size if isinstance(w, LmWorkload) else None
    if storage.is_url(w.data.path):
        storage.configure(spec.storage.endpoint)  # the bucket as the job's hosts will reach it
    try:
        check(w.data.path, vocab_size=vocab, seq_len=w.seq_len)
    except DataError as e:
        raise SpecError(source, [("workload.data.path", str(e))]) from None
    except (ImportError, PermissionError, OSError) as e:
        if "://" not in w.data.path:
            raise SpecError(source, [("workload.data.path", f"{w.data.path}: cannot be read: {e}")]) from None
        log.warning("cannot check %s from here (%s: %s); the workers check it before their first step",
                    w.data.path, type(e).__name__, e)


def _advice(home: cluster.Home, cause: str, held: int = 0) -> str:
    """What a store fault means for the jobs, and what the user may do about it."""
    rescued = home.db.with_name(home.db.name + ".rescued")
    if cause == "deleted":
        return (f"the controller wrote what it had to {rescued}: stop the cluster (`orchestrator down`), "
                f"`mv {rescued} {home.db}`, and `orchestrator up` resumes every job from its last committed checkpoint")
    if cause == "replaced":
        return (f"put the cluster's own file back at {home.db} and the controller goes on by itself, or stop "
                "the cluster (`orchestrator down`)")
    return (f"training goes on and {held} records wait to be written: the job picks up by itself when the store "
            "can be written")


def _tier(value: Tier | str) -> Tier:
    try:
        return Tier(value)
    except ValueError:
        allowed = ", ".join(repr(t.value) for t in Tier)
        raise SpecError("<resize>", [("tier", f"{value!r} is not a tier; use one of {allowed}")]) from None




__all__ = ["CLUSTER_GONE", "Client", "Job", "JobStatus", "JobNotFoundError"]
