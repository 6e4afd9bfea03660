"""A job's export from the state directory: which checkpoint, the folder to write, and what it writes."""

from __future__ import annotations

import os
from pathlib import Path

from orchestrator import cluster
from orchestrator.domain.spec import EntrypointWorkload, LmWorkload
from orchestrator.errors import JobStateError, OutputFileError
from orchestrator.state.states import JobState
from orchestrator.state.store import Store
from workers import storage


def export_job(store: Store, home: cluster.Home, job_id: str, out: str | Path, *, step: int | None, latest: bool,
               force: bool, subtree: str | None):
    """`Client.export`: see there."""
    from orchestrator.user.outputs import check_output_folder, check_reachable
    from workers.export import ExportError, export_checkpoint

    if latest and step is not None:
        raise ValueError("latest and step exclude each other: the newest committed step, or a given one")
    job = store.find_job(job_id)
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
    directory = spec.checkpoint.directory or str(home.default_checkpoint_dir(job.name))
    try:
        out = check_output_folder(os.fspath(out), force=force)
        refuse_checkpoint_folders(store, home, out)
        in_bucket = next((url for url in (out, directory) if storage.is_url(url)), None)
        if in_bucket is not None:  # one endpoint serves both
            check_reachable(in_bucket, spec.storage.endpoint)
    except OutputFileError as e:
        raise ExportError(e.path, e.problem) from None
    storage.configure(spec.storage.endpoint)  # where the job's gs:// folders are
    return export_checkpoint(directory, out, step=step, config=config, force=force, subtree=subtree)


def refuse_checkpoint_folders(store: Store, home: cluster.Home, out: str | Path) -> None:
    """An ExportError if `out` is inside, is, or holds a job's checkpoint folder: writing (or with
    --force replacing) it there would break that job's checkpoints, and its next export or restore."""
    from workers.export import ExportError

    if storage.is_url(out):
        for job in store.jobs():
            url = job.spec.checkpoint.directory or ""
            their_prefix, my_prefix = url.rstrip("/") + "/", str(out).rstrip("/") + "/"
            if storage.is_url(url) and (my_prefix.startswith(their_prefix) or their_prefix.startswith(my_prefix)):
                raise ExportError(str(out), f"is inside or holds the checkpoint folder of job {job.id} "
                                            f"({url}); write the export elsewhere")
        return
    mine = Path(os.path.realpath(out))
    for job in store.jobs():
        folder = job.spec.checkpoint.directory or home.default_checkpoint_dir(job.name)
        if storage.is_url(folder):  # a bucket: not a path on this machine
            continue
        theirs = Path(os.path.realpath(folder))
        if mine == theirs or theirs in mine.parents:
            raise ExportError(str(out), f"is inside the checkpoint folder of job {job.id} ({folder}); "
                                        "write the export elsewhere")
        if mine in theirs.parents:
            raise ExportError(str(out), f"holds the checkpoint folder of job {job.id} ({folder}); "
                                        "write the export elsewhere")
