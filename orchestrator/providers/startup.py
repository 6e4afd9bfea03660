"""The startup script of a slice's TPU VMs: install the worker environment, join the Ray cluster.

Every host of a slice runs the same script (it is the node's ``startup-script``
metadata, run as root at each boot). A host learns its worker number from the
metadata server (``instance/attributes/agent-worker-number``, set on TPU VMs) and
picks its own Ray resources and labels from a table baked into the script, built by
`base.host_node_resources` / `base.host_node_labels`, so a GCP host carries exactly
what a local fake host carries.

The Ray cluster token, when token authentication is on (Ray 2.60's default), is read
from Secret Manager at boot and never written into the script or the metadata:
instance metadata is readable by anyone who can view the project.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field

from orchestrator.catalog import TpuType
from orchestrator.providers import worker_env
from orchestrator.providers.base import host_node_labels, host_node_resources
from orchestrator.providers.worker_env import WORKER_DISTRIBUTIONS

__all__ = ["WORKER_DISTRIBUTIONS", "WorkerSetup", "startup_script", "worker_constraints", "worker_requirements"]

# GCE_METADATA_HOST is the variable Google's own libraries read to find the metadata server.
METADATA_URL = ("http://${GCE_METADATA_HOST:-metadata.google.internal}"
                "/computeMetadata/v1/instance/attributes/agent-worker-number")


def worker_requirements() -> tuple[str, ...]:
    """The worker environment, pinned to the versions this controller runs (installed from the
    project's constraints.txt): a host must unpickle what the controller sends and write
    checkpoints the controller's tools read."""
    from importlib import metadata

    pins = []
    for dist, requirement in WORKER_DISTRIBUTIONS.items():
        try:
            pins.append(f"{requirement}=={metadata.version(dist)}")
        except metadata.PackageNotFoundError:  # not installed here: preflight says so (orchestrator.user.preflight)
            continue
    return tuple(pins)


def worker_constraints() -> tuple[str, ...]:
    """Every package the worker requirements bring, pinned to this machine's version (`worker_env.pins`): a
    host's environment is then the one preflight checks programs against and emulated VMs boot from, and
    the pins a job's own packages are installed with (`orchestrator.control.shipping.pip_env`) hold there."""
    return worker_env.pins()


@dataclass(frozen=True)
class WorkerSetup:
    """What a TPU VM needs to become a worker host of the orchestrator's Ray cluster.

    head_address: the Ray head's ``host:port`` as reachable from the TPU VMs' network.
    requirements: pip requirements of the worker environment (default: `worker_requirements`,
        the controller's own versions). The project's code is not among them: it is shipped
        with each job as a Ray runtime environment.
    constraints: pip constraints they are installed with (default: `worker_constraints`, the
        whole closure at the controller's versions).
    ray_token_secret: a Secret Manager secret holding the Ray cluster token (``ray
        get-auth-token``), or None when the cluster runs without token authentication.
    ray_command, ray_args: how the host runs ``ray start`` (default ``<venv>/bin/ray``) and
        extra arguments (an emulated VM on this machine keeps its node on 127.0.0.1).
    """

    head_address: str
    requirements: tuple[str, ...] = field(default_factory=worker_requirements)
    constraints: tuple[str, ...] = field(default_factory=worker_constraints)
    venv: str = "/opt/tpu-orchestrator/venv"
    python: str = "python3"
    ray_token_secret: str | None = None
    log_file: str = "/var/log/tpu-orchestrator-startup.log"
    ray_command: str | None = None
    ray_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        host, sep, port = self.head_address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"head_address must be host:port, got {self.head_address!r}")
        if bad := [c for c in self.constraints if not _plain(c)]:
            raise ValueError(f"constraints must be name==version lines, got {bad[:3]}")


def startup_script(setup: WorkerSetup, tpu_type: TpuType, slice_name: str) -> str:
    """The bash script every host of slice `slice_name` runs at boot."""
    q = shlex.quote
    cases = []
    for w in range(tpu_type.hosts):
        resources = json.dumps(host_node_resources(tpu_type, slice_name, w), sort_keys=True)
        labels = ",".join(f"{k}={v}" for k, v in sorted(host_node_labels(tpu_type, slice_name, w).items()))
        cases.append(f"  {w}) RESOURCES={q(resources)}; LABELS={q(labels)} ;;")
    token = ""
    if setup.ray_token_secret:
        # set +x: the token must not reach the log, even if someone turns tracing on.
        token = (
            "set +x\n"
            "export RAY_AUTH_MODE=token\n"
            f'RAY_AUTH_TOKEN="$(gcloud secrets versions access latest --secret={q(setup.ray_token_secret)})"\n'
            "export RAY_AUTH_TOKEN\n"
        )
    venv = q(setup.venv)
    ray = setup.ray_command or f"{venv}/bin/ray"
    extra = "".join(f" {q(a)}" for a in setup.ray_args)
    return f"""#!/bin/bash
# Written by tpu-orchestrator for slice {slice_name} ({tpu_type.name}, {tpu_type.hosts} hosts):
# installs the worker environment and joins the Ray cluster at {setup.head_address}.
set -euo pipefail
exec >>{q(setup.log_file)} 2>&1

WORKER_ID="$(curl -sSf --retry 10 --retry-connrefused -H 'Metadata-Flavor: Google' "{METADATA_URL}")"
case "$WORKER_ID" in
{chr(10).join(cases)}
  *) echo "worker number '$WORKER_ID' is not a host of {tpu_type.name}" >&2; exit 1 ;;
esac

# The environment survives reboots; install it once.
if [ ! -x {venv}/bin/ray ]; then
  {q(setup.python)} -m venv {venv}
  cat > {venv}/constraints.txt <<'CONSTRAINTS'
{chr(10).join(setup.constraints)}
CONSTRAINTS
  {venv}/bin/pip install --quiet -c {venv}/constraints.txt {" ".join(q(r) for r in setup.requirements)}
fi

{token}{ray} stop --force >/dev/null 2>&1 || true
{ray} start --address={q(setup.head_address)} --resources="$RESOURCES" --labels="$LABELS"{extra}
echo "worker $WORKER_ID of {slice_name} joined {setup.head_address}"
"""


def _plain(constraint: str) -> bool:
    """A ``name==version`` line that cannot end the script's here-document or run anything."""
    return all(c.isalnum() or c in "-_.=+!<>~" for c in constraint) and constraint != "CONSTRAINTS"
