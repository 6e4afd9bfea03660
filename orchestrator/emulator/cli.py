"""`orchestrator emulator`: the emulated Google Cloud from the command line.

    orchestrator emulator                      the TPU API alone, on 127.0.0.1:8470 (nodes without hosts)
    orchestrator emulator --vms                the GCP world: the TPU API with share-nothing VMs behind its
                                               nodes and Cloud Storage with a bucket; prints the job-file lines
    orchestrator emulator slices               what the running one has: slices, states, hosts
    orchestrator emulator reclaim SLICE        the service takes a spot slice back (SUSPENDING, then PREEMPTED)
    orchestrator emulator poweroff SLICE [--host N [--silent]]   its VMs, or one, powered off (silent: no reset)
    orchestrator emulator notice SLICE [--host N]     a preemption notice on its VMs' metadata servers

The subcommands act on the `--vms` emulator of the same state directory ($ORCHESTRATOR_HOME), through its
control API (`cloud.find_running`). Exit codes as the rest of the command: 2 for a slice or host that does
not exist (one `error:` line), 1 when no emulator runs or it failed.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import urllib.error
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn, Optional, TypeVar

import typer

from orchestrator.cluster.home import Home
from orchestrator.emulator.control import ControlClient, ControlError
from orchestrator.emulator.machines import MAX_TIME_SCALE
from orchestrator.emulator.metadata import NOTICE_EVENTS
from orchestrator.emulator.runfile import Running, find_running

if TYPE_CHECKING:
    from orchestrator.emulator.cloud import LocalCloud

EXIT_FAILED, EXIT_USAGE = 1, 2
T = TypeVar("T")

app = typer.Typer(add_completion=False, help="A local emulator of Google Cloud's TPU API (127.0.0.1); with --vms, "
                  "share-nothing VMs behind its nodes and Cloud Storage beside it.")

HostOpt = typer.Option(None, "--host", help="One host's number (0, 1, ...); default: every host of the slice.")


def _fail(message: str, code: int = EXIT_USAGE) -> NoReturn:
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise typer.Exit(code)


@app.callback(invoke_without_command=True)
def serve(ctx: typer.Context,
          port: int = typer.Option(8470, help="The TPU API's port; 0 picks a free port."),
          time_scale: float = typer.Option(0.05, help="Multiplies the real service's timings."),
          seed: int = typer.Option(0, help="Seed of the random transient errors."),
          vms: bool = typer.Option(False, "--vms", help="Share-nothing VMs behind the nodes, and Cloud Storage "
                                   "with a bucket; prints the job-file lines that use them."),
          storage_port: int = typer.Option(8471, help="With --vms: Cloud Storage's port; 0 picks a free port."),
          ) -> None:
    """Serve the emulator until interrupted (Ctrl-C); the subcommands act on a running one."""
    if ctx.invoked_subcommand is not None:
        return
    for name, value in (("--port", port), ("--storage-port", storage_port)):
        if not 0 <= value <= 65535:
            _fail(f"{name} must be 0 to 65535 (0 picks a free port), got {value}")
    if not 0 < time_scale <= MAX_TIME_SCALE:  # NaN too: its every wait would never end
        _fail(f"--time-scale must be above 0 and at most {MAX_TIME_SCALE:g}, got {time_scale}")
    if not vms:
        from orchestrator.emulator.__main__ import main

        raise typer.Exit(main(["--port", str(port), "--time-scale", str(time_scale), "--seed", str(seed)]))
    if os.geteuid() != 0:
        _fail("--vms boots each host in mount and PID namespaces of its own (unshare), which needs root; run it as "
              "root, or without --vms for the TPU API alone", EXIT_FAILED)
    home = Home.default()
    running = find_running(home)
    if running is not None:
        _fail(f"an emulator already runs for {home.root} (process {running.pid}, {running.url}); "
              "stop it first (Ctrl-C in its shell)", EXIT_FAILED)
    from orchestrator.emulator.cloud import LocalCloud

    raise typer.Exit(_serve_world(LocalCloud(home, port=port, storage_port=storage_port, time_scale=time_scale,
                                             seed=seed)))


def _serve_world(cloud: LocalCloud) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # set first: a Ctrl-C while it starts stops it once started
        signal.signal(sig, lambda *_: stop.set())
    try:
        cloud.start()
    except (OSError, RuntimeError, ValueError) as e:
        _fail(f"the emulator did not start: {e}", EXIT_FAILED)
    try:
        r = cloud.running()
        print(f"TPU API emulator on {r.url}, its nodes' hosts share-nothing VMs (their logs in "
              f"{cloud.home.root / 'logs' / 'emulator'})", flush=True)
        print(f"Cloud Storage emulator on {r.storage_url}, bucket {r.bucket}", flush=True)
        print(f"control token: {r.control_token}", flush=True)
        print(f"\n# A job file's lines for it (checkpoints in gs://{r.bucket}/checkpoints/<job name>):\n"
              f"{cloud.job_lines()}\n", flush=True)
        print(f"For `orchestrator data prepare -o gs://{r.bucket}/...`: export STORAGE_EMULATOR_HOST={r.storage_url}\n"
              "From another shell: orchestrator emulator slices | reclaim SLICE | poweroff SLICE [--host N] | "
              "notice SLICE [--host N]\nCtrl-C stops it and powers its VMs off.", flush=True)
        stop.wait()
    finally:
        cloud.stop()
    return 0


@app.command()
def slices() -> None:
    """The running emulator's slices: state, and each host's VM."""
    state = _act(lambda c: c.state())
    hosts = state.get("hosts", {})
    qrs = {q["tpu"]["nodeSpec"][0]["nodeId"]: q for q in state["queuedResources"]}
    nodes = {n["name"].rsplit("/", 1)[1]: n for n in state["nodes"]}
    if not qrs and not nodes:
        print("no slices")
    for name in sorted(set(qrs) | set(nodes)):
        qr_state = qrs[name]["state"]["state"] if name in qrs else "-"
        node = nodes.get(name)
        vms = ", ".join(f"{h['host']}:{_vm_state(h)}" for h in hosts.get(name, [])) or "-"
        print(f"{name}  {node['acceleratorType'] if node else '-'}  queued resource {qr_state}  "
              f"node {node['state'] if node else '-'}  hosts {vms}")


def _vm_state(host: dict) -> str:
    if not host["alive"]:
        return "off"
    noticed = [k.removeprefix("instance/") for k, v in host["metadata"].items() if v not in ("FALSE", "NONE")
               and k in {key for key, _ in NOTICE_EVENTS.values()}]
    return ("booted" if host["booted"] else "booting") + "".join(f" ({n} notice)" for n in noticed)


@app.command()
def reclaim(slice_name: str = typer.Argument(..., metavar="SLICE", help="The slice (its node or queued resource).")
            ) -> None:
    """The service takes a spot slice back: SUSPENDING now, its node PREEMPTED and VMs off after the grace."""
    name = _act(lambda c: c.reclaim(slice_name), slice_name)
    print(f"reclaimed {name}: SUSPENDING; its node is PREEMPTED and its VMs powered off after the grace period")


@app.command()
def poweroff(slice_name: str = typer.Argument(..., metavar="SLICE", help="The slice (its node or queued resource)."),
             host: Optional[int] = HostOpt,
             silent: bool = typer.Option(False, "--silent", help="With --host: as a host that loses power, its "
                                         "processes frozen; its peers see silence, not a reset.")) -> None:
    """Power a slice's VMs off: every host (its node TERMINATED), or one (the API still says READY)."""
    name = _act(lambda c: c.power_off(slice_name, host=host, silent=silent), slice_name)
    if host is None:
        print(f"powered off every host of {name}: its node is TERMINATED")
    else:
        how = "silently, as a host that lost power" if silent else "as a crashed host"
        print(f"powered off host {host} of {name}, {how}: the API still says READY")


@app.command()
def notice(slice_name: str = typer.Argument(..., metavar="SLICE", help="The slice (its node or queued resource)."),
           host: Optional[int] = HostOpt,
           event: str = typer.Option("preempted", help=f"What is announced: {' or '.join(NOTICE_EVENTS)}.")) -> None:
    """Announce a preemption (or maintenance) on the metadata server of a slice's VMs, as GCE does."""
    if event not in NOTICE_EVENTS:
        _fail(f"--event must be {' or '.join(NOTICE_EVENTS)}, got {event!r}")
    told = _act(lambda c: c.notice(slice_name, host=host, event=event), slice_name)
    key, value = NOTICE_EVENTS[event]
    print(f"{key}={value} on the metadata server of host{'s' if len(told) > 1 else ''} "
          f"{', '.join(map(str, told))} of {slice_name}")


def _act(call: Callable[[ControlClient], T], slice_name: str | None = None) -> T:
    """`call` on the running emulator's control API; its errors as one `error:` line each."""
    running = _running()
    client = running.control()
    try:
        if slice_name is not None:
            _check_slice(client.state(), slice_name)
        return call(client)
    except ControlError as e:
        message = str(e).removeprefix(f"emulator control: {e.status}: ")
        _fail(message, EXIT_USAGE if e.status in (400, 404) else EXIT_FAILED)
    except (urllib.error.URLError, OSError) as e:
        _fail(f"the emulator at {running.url} (process {running.pid}) does not answer: {e}", EXIT_FAILED)


def _check_slice(state: dict, name: str) -> None:
    known = sorted({r["name"].rsplit("/", 1)[1] for r in [*state["queuedResources"], *state["nodes"]]})
    full = {r["name"] for r in [*state["queuedResources"], *state["nodes"]]}
    if name not in known and name not in full:
        _fail(f"no slice {name!r} in the emulator; its slices: {', '.join(known) or 'none yet'}")


def _running() -> Running:
    if os.geteuid() != 0:
        _fail("--vms boots each host in mount and PID namespaces of its own (unshare), which needs root; run it as "
              "root, or without --vms for the TPU API alone", EXIT_FAILED)
    home = Home.default()
    running = find_running(home)
    if running is None:
        _fail(f"no emulator with VMs runs for {home.root}; start one with `orchestrator emulator --vms` "
              "(in another shell; the same ORCHESTRATOR_HOME)", EXIT_FAILED)
    return running


def main(args: list[str]) -> int:
    """Run the command with `args` (what follows `orchestrator emulator`); its exit code."""
    try:
        app(args=args, prog_name="orchestrator emulator")
    except SystemExit as e:  # how click ends every command, usage errors included (exit 2)
        return e.code if isinstance(e.code, int) else EXIT_FAILED
    return 0
