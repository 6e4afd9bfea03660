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
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator import catalog, cluster
from orchestrator.catalog import Tier
from orchestrator.control import ownership
from orchestrator.control.ownership import OnExisting
from orchestrator.control.shipping import pack_folder
from orchestrator.domain.spec import JobSpec, LmWorkload
from orchestrator.errors import (
    ClusterError,
    JobNotFoundError,
    JobStateError,
    SpecError,
    StoreFaultError,
)
from orchestrator.observe.metrics import read_store_fault
from orchestrator.state.states import JobState
from orchestrator.state.store import JobRecord, Store
from orchestrator.user.connection import ClusterLink
from orchestrator.user.entrypoint import check_entrypoint
from orchestrator.user.job import CLUSTER_GONE, Job, JobStatus, _status
from orchestrator.user.preflight import gcp_problems
from workers import storage

if TYPE_CHECKING:
    from orchestrator.user.compiled import CompiledOption
    from orchestrator.user.planning import JobPlan

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlanAnswer:
    """`Client.plan`'s answer: the expected cost of each option and the policy's plan; with `compile`, the TPU
    compiler's row for each option (`refusal()` says why one cannot run), else None."""

    costs: JobPlan
    compiled: list[CompiledOption] | None

    @property
    def refusals(self) -> list[str]:
        return [line for r in self.compiled or [] if (line := r.refusal()) is not None]


class Client(ClusterLink):
    """The Python API (see this module's docstring); its link to the cluster is `ClusterLink`'s."""

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
        from orchestrator.user.exporting import export_job

        return export_job(self.store, self.home, job_id, out, step=step, latest=latest, force=force, subtree=subtree)

    def plan(self, spec: JobSpec, *, compile: bool = False, deadline_hours: float | None = None,
             trace: str | Path | None = None, progress: Callable[[str], None] = lambda line: None) -> PlanAnswer:
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
        return PlanAnswer(plan_spec(spec, deadline_hours=deadline_hours, trace_path=trace,
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
        from orchestrator.control.queue import queue_positions

        records = self.store.jobs()
        places = queue_positions(records)  # one read of the line for all (a read of it per job was quadratic)
        return [self._status_of(j, places) for j in records]

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

    def _status_of(self, job: JobRecord, places: dict[str, int] | None = None) -> JobStatus:
        """The job's status, with its place in the queue (`places`: every queued job's, read once for many)
        and, while not ended, whether a cluster runs it."""
        from orchestrator.control.queue import queue_position
        from orchestrator.observe.timeline import deadline_line, move_line, plan_line, wall_time

        st = replace(_status(job, self.store.last_step(job.id)), wall_s=wall_time(self.store, job),
                     plan=plan_line(self.store, job))
        if st.done:
            return st
        place = queue_position(self.store, job) if places is None else places.get(job.id)
        return replace(st, queue_position=place, cluster=self.cluster_state(),
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
