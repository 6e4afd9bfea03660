"""The emulator as a running thing: an HTTP server on loopback plus the handle that controls it.

    emu = serve(time_scale=0.01)          # started, on a free port of 127.0.0.1
    client = emu.client()                 # a real tpu_v2.TpuClient pointed at it
    emu.stockout("us-central2-b")         # inject faults from Python...
    emu.control().reclaim("s1")           # ...or over HTTP (a ControlClient with the token)
    emu.stop()

    emu = serve(manual_clock=True, time_scale=1.0)  # a test's own time: nothing moves by itself...
    emu.advance(145)                      # ...until it says: CREATING to ACTIVE, each state at its own time

The server only binds loopback addresses: a fake cloud reachable from the network is a
hazard, not a feature. The TPU API paths take anonymous calls, as the real client sends
them in tests. The control API under `/_emulator/` requires the emulator's control
token (``Authorization: Bearer <token>``): loopback alone does not keep out a web page
in a local browser, which can send a simple cross-origin POST without a preflight.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import secrets
import socket
import threading
from collections import deque
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer
from typing import Any, Protocol

from orchestrator.emulator.control import ControlClient
from orchestrator.emulator.errors import failed_precondition, invalid, no_such_host
from orchestrator.emulator.faults import Faults
from orchestrator.emulator.machines import MachineTimings
from orchestrator.emulator.routes import ApiHandler, EmulatorSurface, RequestRecord
from orchestrator.emulator.world import Hooks, World

log = logging.getLogger(__name__)

DEFAULT_TIME_SCALE = 0.05  # a two-minute provisioning takes 6 s

# What an HTTP header can carry as a bearer token: visible ASCII, no spaces.
_TOKEN_RE = re.compile(r"[\x21-\x7e]{16,}")


class HostControl(Protocol):
    """What backs the nodes' hosts with machines that can be powered off and told of a notice (VMs):
    `ray_backing.RayBackedNodes` in share-nothing mode. Errors are `ApiError`s, answered as such."""

    def power_off(self, node_id: str, host: int, *, silent: bool = False) -> None: ...

    def notice(self, node_id: str, host: int | None, event: str) -> list[int]: ...

    def describe(self) -> dict[str, list[dict[str, Any]]]: ...


@dataclass(frozen=True)
class EmulatorConfig:
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port
    timings: MachineTimings = field(default_factory=lambda: MachineTimings(scale=DEFAULT_TIME_SCALE))
    seed: int = 0  # seeds the random transient errors
    zones: tuple[str, ...] | None = None  # None: every zone exists; else others answer 404
    hooks: Hooks = field(default_factory=Hooks)
    # True: time stands still until `Emulator.advance` moves it (tests that step through states); else real time.
    manual_clock: bool = False
    # The control API's bearer token; None: a random one at start. Kept out of repr.
    control_token: str | None = field(default=None, repr=False)
    # The machines behind the nodes' hosts, for `power_off` of one host and `notice`; None: nodes without VMs.
    hosts: HostControl | None = None


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    # Every request is a connection of its own (HTTP/1.0), and a controller of many jobs makes them from many
    # threads at once: with socketserver's backlog of 5 the kernel dropped the connections over it, and each
    # waited a second or more for its SYN to be sent again (288 of 16,393 requests in a fleet run of 1,000
    # jobs). The TPU API's front end drops none of them, so neither does its stand-in.
    request_queue_size = 1024

    def __init__(self, address: tuple[str, int], emulator: EmulatorSurface):  # the type checker holds Emulator to it
        self.emulator = emulator
        super().__init__(address, ApiHandler)


class Emulator:
    """A running emulator and the Python side of its control API."""

    def __init__(self, config: EmulatorConfig | None = None):
        self.config = config or EmulatorConfig()
        _require_loopback(self.config.host)
        self.control_token = _control_token(self.config.control_token)
        self.faults = Faults(seed=self.config.seed)
        self.world = World(timings=self.config.timings, faults=self.faults, hooks=self.config.hooks,
                           zones=self.config.zones, manual_clock=self.config.manual_clock)
        # Bounded: a long-running emulator polled every few seconds must not grow forever.
        self._requests: deque[RequestRecord] = deque(maxlen=100_000)
        self._requests_lock = threading.Lock()
        self._httpd: _Server | None = None
        self._thread: threading.Thread | None = None

    # -- life ---------------------------------------------------------------------------

    def start(self) -> Emulator:
        self._httpd = _Server((self.config.host, self.config.port), self)
        self.world.start()
        # A short poll interval: shutdown() waits up to one interval, and tests stop often.
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="tpu-emulator-http", daemon=True)
        self._thread.start()
        log.info("TPU API emulator serving on %s", self.url)
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        self.world.stop()

    def __enter__(self) -> Emulator:
        return self if self._httpd is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        if self._httpd is None:
            raise RuntimeError("the emulator is not running")
        host, port = self._httpd.server_address[:2]
        assert isinstance(host, str), "an internet server's host (typeshed allows bytes for any family)"
        return f"http://{host}:{port}"

    def client(self, credentials: Any = None) -> Any:
        """A real `google.cloud.tpu_v2.TpuClient` over REST, pointed at this emulator."""
        from google.api_core.client_options import ClientOptions
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import tpu_v2

        return tpu_v2.TpuClient(
            credentials=credentials or AnonymousCredentials(),
            transport="rest",
            client_options=ClientOptions(api_endpoint=self.url),
        )

    def control(self, *, timeout_s: float = 10.0) -> ControlClient:
        """A `ControlClient` for this emulator's control API, with its token."""
        return ControlClient(self.url, token=self.control_token, timeout_s=timeout_s)

    # -- control ------------------------------------------------------------------------

    def fail(self, method: str, kind: str, *, count: int = 1, zone: str | None = None) -> None:
        """Answer the next `count` calls of `method` (e.g. ``queuedResources.create``, or
        ``*``) with error `kind` (unavailable, rate_limited, internal, deadline, quota,
        permission, invalid, not_found); ``count=-1`` until cleared."""
        self.faults.fail(method, kind, count=count, zone=zone)

    def random_errors(self, rate: float, *, codes: tuple[int, ...] = (503, 429), seed: int | None = None,
                      methods: tuple[str, ...] | None = None) -> None:
        self.faults.random_errors(rate, codes=codes, seed=seed, methods=methods)

    def stockout(self, zone: str, *, accelerator_type: str | None = None, mode: str = "wait") -> None:
        self.faults.stockout(zone, accelerator_type=accelerator_type, mode=mode)

    def clear_stockout(self, zone: str | None = None) -> None:
        self.faults.clear_stockout(zone)

    def clear_faults(self) -> None:
        self.faults.clear()

    def advance(self, seconds: float) -> None:
        """On a manual clock: let `seconds` of the emulator's time pass (the timings' seconds, times their scale);
        every automatic move that falls due meanwhile is made, in order, before this returns."""
        self.world.advance(seconds)

    def reclaim(self, name: str) -> str:
        """Reclaim a spot slice: queued resource SUSPENDING (initiator SERVICE), then nodes
        PREEMPTED and the queued resource SUSPENDED after the grace period."""
        return self.world.reclaim(name)

    def fill(self, name: str) -> str:
        """Capacity comes for one queued resource in WAITING_FOR_RESOURCES, whatever its zone's stockout: it
        provisions now (the others wait on). In process only, as `advance`: a test's way to say which request
        of several fills first."""
        return self.world.fill(name)

    def terminate(self, name: str) -> str:
        """A host of the node dies: the node becomes TERMINATED at once."""
        return self.world.terminate(name)

    def power_off(self, name: str, *, host: int | None = None, silent: bool = False) -> str:
        """Power a slice's VMs off: every host (the node TERMINATED, as `terminate`), or host number `host`
        alone (a crashed host: the API still says READY, as the real one does until it notices); `silent`: that
        host's processes frozen, so its peers see silence rather than a reset (`EmulatedVm.silence`)."""
        if host is None:
            if silent:
                raise invalid("a silent power-off names one host (--host N)")
            return self.terminate(name)
        node = self.world.node(name)
        if not 0 <= host < node.worker_count:
            raise no_such_host(node.node_id, host, node.worker_count)
        self._hosts().power_off(node.node_id, host, silent=silent)
        return node.name

    def notice(self, name: str, *, host: int | None = None, event: str = "preempted") -> list[int]:
        """Announce `event` (preempted, maintenance) on the metadata server of a slice's VMs, or of one;
        the hosts told."""
        node = self.world.node(name)
        if host is not None and not 0 <= host < node.worker_count:
            raise no_such_host(node.node_id, host, node.worker_count)
        return self._hosts().notice(node.node_id, host, event)

    def _hosts(self) -> HostControl:
        if self.config.hosts is None:
            raise failed_precondition("this emulator's nodes have no VMs behind them (`orchestrator emulator --vms` "
                                      "starts one that has)")
        return self.config.hosts

    def state(self) -> dict[str, Any]:
        hosts = {} if self.config.hosts is None else {"hosts": self.config.hosts.describe()}
        return {**self.world.snapshot(), "faults": self.faults.describe(), **hosts}

    def requests(self, method: str | None = None, *, zone: str | None = None) -> list[RequestRecord]:
        with self._requests_lock:
            return [r for r in self._requests if method in (None, r.method) and zone in (None, r.zone)]

    def request_count(self, method: str | None = None, *, zone: str | None = None) -> int:
        return len(self.requests(method, zone=zone))

    def record_request(self, rec: RequestRecord) -> None:
        """A request answered (the routes record each one)."""
        with self._requests_lock:
            self._requests.append(rec)


def serve(
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    time_scale: float = DEFAULT_TIME_SCALE,
    timings: MachineTimings | None = None,
    seed: int = 0,
    zones: tuple[str, ...] | None = None,
    hooks: Hooks | None = None,
    control_token: str | None = None,
    manual_clock: bool = False,
    hosts: HostControl | None = None,
) -> Emulator:
    """Start an emulator and return its handle; call ``stop()`` (or use it in ``with``).

    `control_token` is the control API's bearer token; by default a random one, read
    back as ``emu.control_token``. `manual_clock`: time moves only by ``emu.advance(seconds)``. `hosts`: the VMs
    behind the nodes (`ray_backing.RayBackedNodes`), for `power_off` of one host and `notice`."""
    if timings is None:
        timings = MachineTimings(scale=time_scale)
    config = EmulatorConfig(host=host, port=port, timings=timings, seed=seed, zones=zones, hooks=hooks or Hooks(),
                            control_token=control_token, manual_clock=manual_clock, hosts=hosts)
    return Emulator(config).start()


def _require_loopback(host: str) -> None:
    try:
        addr = ipaddress.ip_address(socket.gethostbyname(host))
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot resolve emulator host {host!r}: {e}") from None
    if not addr.is_loopback:
        raise ValueError(f"the emulator binds loopback addresses only (127.0.0.1), not {host!r}")


def _control_token(given: str | None) -> str:
    if given is None:
        return secrets.token_urlsafe(32)
    if not _TOKEN_RE.fullmatch(given):
        # The value itself stays out of the message: it may be a real secret mistyped.
        raise ValueError("a control token is at least 16 visible ASCII characters, without spaces")
    return given
