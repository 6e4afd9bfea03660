"""The GCP world on this machine: the TPU API emulator with share-nothing VMs behind its nodes, and a Cloud
Storage emulator with one bucket, all on 127.0.0.1 (`orchestrator emulator --vms`).

    with LocalCloud(home).start() as cloud:
        print(cloud.job_lines())          # the job-file lines that point a job at it
        ...                               # until interrupted

Each host of a node is an `EmulatedVm` with its own metadata server (as each GCE VM has), which is where
`orchestrator emulator notice` announces a preemption; the VMs join the cluster of the state directory
(`home`) with its token, which their fake Secret Manager hands out as `RAY_TOKEN_SECRET`.

While it runs, `home`/emulator.json (mode 600: it holds the control token) says where: its process, the TPU
API's URL and control token, the storage URL (`runfile`). The other subcommands read it; it is removed at stop.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict
from pathlib import Path

from orchestrator.cluster import Home, ensure_token
from orchestrator.emulator.__main__ import _write_private
from orchestrator.emulator.machines import MachineTimings
from orchestrator.emulator.ray_backing import RayBackedNodes
from orchestrator.emulator.runfile import RUN_FILE, Running
from orchestrator.emulator.server import Emulator, serve
from orchestrator.emulator.storage import StorageEmulator, serve_storage

log = logging.getLogger(__name__)

PROJECT = "emulated-project"
ZONE = "us-central2-b"
BUCKET = "emulated-bucket"
RAY_TOKEN_SECRET = "ray-token"


class LocalCloud:
    def __init__(self, home: Home, *, port: int = 8470, storage_port: int = 8471, time_scale: float = 0.05,
                 seed: int = 0):
        self.home = home
        self.port, self.storage_port, self.time_scale, self.seed = port, storage_port, time_scale, seed
        self.emulator: Emulator | None = None
        self.storage: StorageEmulator | None = None
        self.backing: RayBackedNodes | None = None

    def start(self) -> LocalCloud:
        """Start the storage emulator, then the TPU API with its VMs, then record where; on any failure,
        stop what started."""
        ensure_token(self.home)
        token = self.home.token_file.read_text().strip()
        try:
            self.storage = serve_storage((BUCKET,), port=self.storage_port or None)
            # The address is for Ray nodes that are no VMs; a VM joins the head its startup script names.
            self.backing = RayBackedNodes(self.home, "", share_nothing=True, secrets={RAY_TOKEN_SECRET: token})
            # A node provisioned 12x faster than the rest of the API: its VMs boot and join Ray before the
            # provider's first look at the slice (as the share-nothing tests do).
            timings = MachineTimings(scale=self.time_scale, provision_s=10.0)
            self.emulator = serve(port=self.port, timings=timings, seed=self.seed, hooks=self.backing.hooks(),
                                  hosts=self.backing)
            _write_private(self.run_file, json.dumps(asdict(self.running())) + "\n")
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def run_file(self) -> Path:
        return self.home.root / RUN_FILE

    def running(self) -> Running:
        assert self.emulator is not None and self.storage is not None, "started"
        return Running(pid=os.getpid(), url=self.emulator.url, control_token=self.emulator.control_token,
                       storage_url=self.storage.url, project=PROJECT, zone=ZONE, bucket=BUCKET)

    def job_lines(self) -> str:
        """The job-file lines that send a job here (checkpoints in the bucket, under checkpoints/<job name>)."""
        r = self.running()
        return "\n".join([
            "provider: gcp",
            "gcp:",
            f"  project: {r.project}",
            f"  zones: [{r.zone}]",
            f"  endpoint: {r.url}",
            f"  ray_token_secret: {RAY_TOKEN_SECRET}",
            f"  bucket: {r.bucket}",
            "storage:",
            f"  endpoint: {r.storage_url}",
        ])

    def stop(self) -> None:
        """Stop everything it started: the API (no more hooks), every VM, the storage emulator; forget where."""
        try:
            if self.emulator is not None:
                self.emulator.stop()
        finally:
            try:
                if self.backing is not None:
                    self.backing.close()
            finally:
                if self.storage is not None:
                    self.storage.stop()
                if self.emulator is not None:  # only ours: another emulator's file stays
                    self.run_file.unlink(missing_ok=True)

    def __enter__(self) -> LocalCloud:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
