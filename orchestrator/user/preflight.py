"""What `validate` and `submit` check on `provider: gcp` before anything is provisioned.

A TPU VM shares nothing with this machine, so a job that cannot work there should fail
here, in seconds, with the field to fix, not after a slice was paid for:
- the Ray head's address must be one the VMs can reach (not this machine's loopback,
  unless the TPU API itself is an emulator on this machine);
- the worker environment must be buildable: every package the hosts import is installed
  here, so its version can be pinned (`orchestrator.providers.startup.worker_requirements`);
- every module a user program imports must be on the hosts: the project's packages (their
  closure, `orchestrator.providers.worker_env`) or one the job's folder declares in its
  ``requirements.txt`` (`import_problems`);
- the job's checkpoint folder, in a bucket, must be reachable and writable (a probe object
  is written and deleted; `storage_problems`, for any provider).
"""

from __future__ import annotations

import ipaddress
import logging
import subprocess
from importlib import metadata
from pathlib import Path
from urllib.parse import urlparse

from orchestrator.domain import requirements
from orchestrator.domain.spec import EntrypointWorkload, JobSpec

Problem = tuple[str, str]

log = logging.getLogger(__name__)


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def head_problems(spec: JobSpec, cluster_address: str | None) -> list[Problem]:
    """The head address the VMs would be given (`gcp.head_address`, else the cluster's)."""
    if not spec.provider_facts.needs_gcp_config or spec.gcp is None:
        return []
    address = spec.gcp.head_address or cluster_address
    if address is None:
        return []  # `validate` without a cluster: checked again by `submit`
    host = address.rpartition(":")[0]
    emulated = spec.gcp.endpoint is not None and _loopback(urlparse(spec.gcp.endpoint).hostname or "")
    if _loopback(host) and not emulated:
        field = "gcp.head_address" if spec.gcp.head_address else "gcp.head_address (unset: the cluster's address)"
        return [(field, f"{address} is this machine's loopback; TPU VMs cannot reach it. Give the Ray head's "
                        f"address as the VMs see it (its internal IP and GCS port, e.g. 10.128.0.5:6379)")]
    return []


def environment_problems(spec: JobSpec) -> list[Problem]:
    """Packages the hosts import that are missing here, so the worker environment cannot be pinned."""
    if not spec.provider_facts.ships_code:
        return []
    from orchestrator.providers.startup import WORKER_DISTRIBUTIONS

    missing = []
    for dist in WORKER_DISTRIBUTIONS:
        try:
            metadata.version(dist)
        except metadata.PackageNotFoundError:
            missing.append(dist)
    if missing:
        return [("provider", f"the TPU VMs' environment cannot be pinned: {', '.join(missing)} not installed "
                             f"here (pip install 'tpu-orchestrator[gcs]')")]
    return []


def import_problems(spec: JobSpec, folder: str | Path | None = None) -> list[Problem]:
    """Modules an entrypoint program imports (`orchestrator.user.imports`) that the hosts would not have:
    neither in the hosts' own environment, checked in a clean copy of it (an isolated interpreter that
    sees nothing of this machine's packages beyond the hosts'), nor given by a package the job's folder
    declares. `folder`: the job's folder, if not the spec's workdir. Nothing is installed."""
    w = spec.workload
    folder = folder or spec.workdir
    if not spec.provider_facts.ships_code or not isinstance(w, EntrypointWorkload) or folder is None:
        return []
    from orchestrator.providers.worker_image import worker_image
    from orchestrator.user.imports import missing_on_hosts, program, provided_by

    prog = program(folder, w.entrypoint.partition(":")[0])
    if prog.unreadable:
        return [("workload.entrypoint", f"{where}: {why}: Python cannot read the program there")
                for where, why in prog.unreadable.items()]
    outside = prog.outside
    if not outside:
        return []
    declared, problems = requirements.read(folder)
    if problems:
        return problems
    try:
        absent = missing_on_hosts(list(outside), worker_image().python)
    except (OSError, subprocess.SubprocessError) as e:  # no venv module here, a full disk: the hosts will tell
        log.warning("the program's imports were not checked: the hosts' environment could not be made here (%s)", e)
        return []
    missing = [m for m in absent if m not in provided_by([r.name for r in declared])]
    installed = metadata.packages_distributions()
    out = []
    for m in sorted(missing):
        if m == "orchestrator":
            out.append(("workload.entrypoint", f"imports 'orchestrator' ({outside[m]}), the control plane, which the "
                                               f"hosts do not have; a program imports workers (workers.api)"))
            continue
        here = installed.get(m)
        hint = f" (e.g. {here[0]}=={metadata.version(here[0])}, the version installed here)" if here else ""
        out.append(("workload.entrypoint", f"imports {m!r} ({outside[m]}), which the hosts do not have; add it to "
                                           f"{requirements.FILE} in the job's folder{hint}"))
    return out


def storage_problems(spec: JobSpec) -> list[Problem]:
    """The job's checkpoint folder in a bucket: reachable and writable with this machine's credentials
    (a probe object written, read back and deleted), checked where it would otherwise fail only on a host."""
    directory = spec.checkpoint.directory
    if not spec.provider_facts.hosts_share_disk and directory is None and spec.gcp is not None and spec.gcp.bucket:
        directory = spec.with_checkpoint_directory("").checkpoint.directory
    if directory is None or "://" not in directory:
        return []
    from workers import storage

    try:
        storage.check_writable(directory, endpoint=spec.storage.endpoint)
    except storage.StorageError as e:
        field = "checkpoint.directory" if spec.checkpoint.directory else "gcp.bucket"
        return [(field, str(e))]
    return []


def gcp_problems(spec: JobSpec, cluster_address: str | None = None, *,
                 folder: str | Path | None = None) -> list[Problem]:
    """Everything above: the head, the worker environment, then (if those hold) the program's imports and the
    bucket. `folder`: the job's folder when the spec has no workdir (`Client.submit(spec, workdir=...)`)."""
    problems = head_problems(spec, cluster_address) + environment_problems(spec)
    return problems or import_problems(spec, folder) or storage_problems(spec)
