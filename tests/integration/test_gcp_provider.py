"""The GCP slice provider, driven through the real TPU client over HTTP against the emulator.

Only the cloud is fake: requests go through google-cloud-tpu's REST transport to the
emulator on 127.0.0.1, which runs the queued-resource state machines at 1/500 speed.
"Hosts joined Ray" is the emulator's on_node_ready hook marking the slice's hosts as
joined, as the startup script would, so no Ray cluster is needed.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import threading
import time

import pytest
from google.auth.credentials import Credentials
from google.cloud import tpu_v2

from orchestrator import catalog
from orchestrator.catalog import Tier
from orchestrator.emulator import Hooks, running_emulator
from orchestrator.errors import ProvisioningError
from orchestrator.providers.base import (
    Host,
    Slice,
    SliceEventKind,
    SliceProvider,
    SliceRequest,
    host_node_labels,
    host_node_resources,
    host_resource,
)
from orchestrator.providers.gcp import (
    MANAGED_BY,
    CloudApiError,
    GcpTpuProvider,
    NoCapacityError,
    Polling,
    RetryPolicy,
    collect_leaked,
)
from orchestrator.providers.gcp.states import RESOURCE_EXHAUSTED, Seen, Tracked, judge
from orchestrator.providers.gcp.zones import ZonePlan
from orchestrator.providers.startup import WorkerSetup, startup_script
from orchestrator.state.states import SLICE_TRANSITIONS, SliceState
from tests import waiting

pytestmark = pytest.mark.timeout(60)

PROJECT = "test-proj"
ZONE_A, ZONE_B = "us-central2-b", "us-east5-a"
HEAD = "10.128.0.2:6379"
V4_32 = catalog.lookup("v4-32")
SECRET_TOKEN = "ya29.NEVER-LOG-THIS-TOKEN-4f1c9e"
RESERVATION_R1 = f"projects/{PROJECT}/locations/{ZONE_A}/reservations/r1"


class JoinedHosts:
    """Stands in for Ray: a slice's hosts join when its node is READY and leave when it goes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.slices: dict[str, int] = {}

    def ready(self, node_id: str, accelerator_type: str, worker_count: int, labels: dict[str, str],
              metadata: dict[str, str]) -> None:
        with self._lock:
            self.slices[node_id] = worker_count

    def gone(self, node_id: str, reason: str) -> None:
        with self._lock:
            self.slices.pop(node_id, None)

    def check(self, s: Slice) -> list[Host]:
        with self._lock:
            n = self.slices.get(s.name, 0)
        return [Host(i, host_resource(s.name, i), node_id=f"ray-{s.name}-{i}") for i in range(n)]


@pytest.fixture
def joined() -> JoinedHosts:
    return JoinedHosts()


@pytest.fixture
def emulator(joined):
    hooks = Hooks(on_node_ready=joined.ready, on_node_gone=joined.gone)
    with running_emulator(time_scale=0.002, seed=7, hooks=hooks) as emu:
        yield emu
    assert not [t for t in threading.enumerate() if t.name.startswith("tpu-emulator")]


def make_provider(emulator, joined, **kw) -> GcpTpuProvider:
    args = dict(
        endpoint=emulator.url,
        worker_setup=WorkerSetup(HEAD),
        retry=RetryPolicy(attempts=4, initial_s=0.01, max_s=0.05, total_s=10),
        polling=Polling(poll_s=0.02, capacity_wait_s=0.4, request_timeout_s=5),
        join_check=joined.check,
    )
    args.update(kw)
    return GcpTpuProvider(PROJECT, args.pop("zones", (ZONE_A, ZONE_B)), **args)


@pytest.fixture
def provider(emulator, joined) -> GcpTpuProvider:
    return make_provider(emulator, joined)


def req(name: str = "s1", job: str = "job-1", tier: Tier = Tier.SPOT, zone: str | None = None, t=V4_32):
    return SliceRequest(job_id=job, name=name, tpu_type=t, tier=tier, zone=zone)


def qr_of(emulator, name: str, zone: str = ZONE_A) -> dict | None:
    full = f"projects/{PROJECT}/locations/{zone}/queuedResources/{name}"
    return next((q for q in emulator.state()["queuedResources"] if q["name"] == full), None)


def create_foreign_qr(emulator, zone: str, name: str) -> None:
    """A queued resource made by someone else (no labels of ours), straight through the client."""
    parent = f"projects/{PROJECT}/locations/{zone}"
    node = tpu_v2.Node(accelerator_type="v4-8", runtime_version="tpu-ubuntu2204-base")
    spec = tpu_v2.QueuedResource.Tpu.NodeSpec(parent=parent, node_id=name, node=node)
    emulator.client().create_queued_resource(
        parent=parent, queued_resource_id=name, queued_resource=tpu_v2.QueuedResource(tpu={"node_spec": [spec]}))


def wait_for(cond, timeout_s: float = 5.0, what: str = "condition"):
    """`tests.waiting.wait_for` at this file's pace: the emulator's operations take milliseconds here."""
    return waiting.wait_for(cond, timeout_s, what, poll_s=0.01)


# -- lifecycle --------------------------------------------------------------------------


def test_is_a_slice_provider(provider):
    assert isinstance(provider, SliceProvider)


def test_create_poll_to_ready_then_release(emulator, joined):
    changes = []
    provider = make_provider(emulator, joined, on_change=changes.append)
    s = provider.request(req())
    assert s.state is SliceState.REQUESTED and s.zone == ZONE_A and s.provider == "gcp"

    s = provider.wait_ready("s1", timeout_s=10)
    assert s.state is SliceState.READY
    assert [h.worker_id for h in s.hosts] == [0, 1, 2, 3]
    assert provider.get("s1").state is SliceState.READY

    qr = qr_of(emulator, "s1")
    assert qr["state"]["state"] == "ACTIVE" and "spot" in qr
    node = qr["tpu"]["nodeSpec"][0]["node"]
    assert node["acceleratorType"] == "v4-32" and node["runtimeVersion"] == "tpu-ubuntu2204-base"
    assert node["labels"] == {"managed-by": MANAGED_BY, "orchestrator-job": "job-1", "orchestrator-slice": "s1"}
    assert f"ray start --address={HEAD}" in node["metadata"]["startup-script"]

    provider.release("s1")
    assert provider.get("s1").state is SliceState.RELEASED
    wait_for(lambda: qr_of(emulator, "s1") is None, what="queued resource deleted")
    assert not emulator.state()["nodes"]
    provider.release("s1")  # idempotent
    deletes = emulator.requests("queuedResources.delete")
    assert len(deletes) == 1 and deletes[0].status == 200
    # Every change of state was told, once each, in order (the queue's WAITING may be too brief to see).
    states = [c.state for c in changes]
    assert states[0] is SliceState.REQUESTED and states[-2:] == [SliceState.READY, SliceState.RELEASED]
    assert SliceState.PROVISIONING in states and all(a is not b for a, b in zip(states, states[1:], strict=False))
    assert {(c.name, c.job_id, c.tier) for c in changes} == {("s1", "job-1", Tier.SPOT)}


@pytest.mark.parametrize(
    ("tier", "expect"),
    [
        (Tier.SPOT, {"spot": {}}),
        (Tier.ON_DEMAND, {"guaranteed": {}}),
        (Tier.RESERVED, {"guaranteed": {}, "reservationName": RESERVATION_R1}),
    ],
)
def test_tiers_map_to_queued_resource_fields(emulator, joined, tier, expect):
    p = make_provider(emulator, joined, reservation={ZONE_A: "r1"})
    p.request(req(tier=tier))
    qr = qr_of(emulator, "s1")
    assert {k: qr[k] for k in ("spot", "guaranteed", "reservationName") if k in qr} == expect
    p.release("s1")


def test_reserved_without_reservation_is_refused(provider):
    with pytest.raises(ProvisioningError, match="reservation"):
        provider.request(req(tier=Tier.RESERVED))


# -- errors ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["unavailable", "rate_limited", "internal", "deadline"])
def test_transient_error_is_retried_then_succeeds(emulator, provider, kind):
    emulator.fail("queuedResources.create", kind, count=2)
    provider.request(req())
    assert emulator.request_count("queuedResources.create") == 3
    assert provider.wait_ready("s1", timeout_s=10).state is SliceState.READY
    provider.release("s1")


def test_random_transient_errors_through_a_whole_lifecycle(emulator, provider):
    emulator.random_errors(0.3, codes=(503, 429, 500), seed=3)
    provider.request(req())
    assert provider.wait_ready("s1", timeout_s=10).state is SliceState.READY
    provider.release("s1")
    emulator.clear_faults()
    wait_for(lambda: qr_of(emulator, "s1") is None, what="queued resource deleted")
    assert any(r.status in (503, 429, 500) for r in emulator.requests())


def test_transient_errors_give_up_after_the_attempts(emulator, provider):
    emulator.fail("queuedResources.create", "unavailable", count=-1)
    with pytest.raises(CloudApiError) as err:
        provider.request(req())
    assert err.value.transient and err.value.code == 503
    assert emulator.request_count("queuedResources.create") == 4


@pytest.mark.parametrize(
    ("kind", "code", "reason"),
    [
        ("permission", 403, "IAM_PERMISSION_DENIED"),
        ("invalid", 400, "BAD_REQUEST"),
        ("not_found", 404, "NotFound"),
        ("quota", 429, "QUOTA_EXCEEDED"),
    ],
)
def test_permanent_error_fails_at_once_with_its_reason(emulator, provider, kind, code, reason):
    emulator.fail("queuedResources.create", kind)
    with pytest.raises(ProvisioningError) as err:
        provider.request(req())
    e = err.value
    assert isinstance(e, CloudApiError) and not e.transient and e.code == code
    assert PROJECT in str(e) and ZONE_A in str(e) and reason in str(e)
    assert emulator.request_count("queuedResources.create") == 1  # no retry
    with pytest.raises(KeyError):
        provider.get("s1")


def test_invalid_body_is_a_permanent_error(emulator, provider):
    with pytest.raises(CloudApiError, match="queuedResourceId .Bad_Name. must match"):
        provider.request(req(name="Bad_Name"))


# -- capacity ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["wait", "fail"])
def test_stockout_falls_through_to_the_next_zone(emulator, provider, mode):
    emulator.stockout(ZONE_A, mode=mode)
    provider.request(req())
    s = provider.wait_ready("s1", timeout_s=10)
    assert s.state is SliceState.READY and s.zone == ZONE_B
    events = provider.poll_events()
    assert [e.kind for e in events] == [SliceEventKind.NO_CAPACITY]
    assert ZONE_A in events[0].reason
    wait_for(lambda: qr_of(emulator, "s1", ZONE_A) is None, what="zone A queued resource deleted")
    provider.release("s1")


def test_no_capacity_anywhere_is_a_transient_error_and_leaves_nothing(emulator, provider):
    emulator.stockout(ZONE_A)
    emulator.stockout(ZONE_B, accelerator_type="v4-32")
    provider.request(req())
    with pytest.raises(NoCapacityError) as err:
        provider.wait_ready("s1", timeout_s=10)
    assert err.value.transient and err.value.zones == (ZONE_A, ZONE_B)
    assert ZONE_A in str(err.value) and ZONE_B in str(err.value)
    assert [e.kind for e in provider.poll_events()] == [SliceEventKind.NO_CAPACITY] * 2
    wait_for(lambda: not emulator.state()["queuedResources"], what="every queued resource deleted")
    assert provider.get("s1").state is SliceState.RELEASED


def test_still_queued_at_the_callers_deadline_is_no_capacity(emulator, joined):
    changes = []
    p = make_provider(emulator, joined, polling=Polling(poll_s=0.02, capacity_wait_s=600), on_change=changes.append)
    emulator.stockout(ZONE_A)
    p.request(req(zone=ZONE_A))
    with pytest.raises(NoCapacityError, match=ZONE_A):
        p.wait_ready("s1", timeout_s=0.3)
    assert [e.kind for e in p.poll_events()] == [SliceEventKind.NO_CAPACITY]
    wait_for(lambda: qr_of(emulator, "s1") is None, what="queued resource deleted")
    # The wait in the queue was told: it is how a job learns the zone had no spot capacity.
    assert [c.state for c in changes] == [SliceState.REQUESTED, SliceState.WAITING, SliceState.RELEASED]


def illegal_moves(changes: list[Slice]) -> list[tuple[str, str]]:
    """The reported state changes that the slice lifecycle (`SLICE_TRANSITIONS`) does not allow."""
    states = [c.state for c in changes]
    return [(a.value, b.value) for a, b in zip(states, states[1:], strict=False) if b not in SLICE_TRANSITIONS[a]]


@pytest.mark.parametrize("mode", ["wait", "fail"])
def test_zone_fallthrough_reports_only_moves_the_lifecycle_allows(emulator, joined, mode):
    changes = []
    p = make_provider(emulator, joined, on_change=changes.append)
    emulator.stockout(ZONE_A, mode=mode)
    p.request(req())
    s = p.wait_ready("s1", timeout_s=10)
    assert s.state is SliceState.READY and s.zone == ZONE_B
    assert [e.kind for e in p.poll_events()] == [SliceEventKind.NO_CAPACITY]
    p.release("s1")
    states = [c.state for c in changes]
    # The same request, now in another zone: no GONE, no way back to REQUESTED.
    assert illegal_moves(changes) == [], states
    assert states[0] is SliceState.REQUESTED and states[-2:] == [SliceState.READY, SliceState.RELEASED]
    assert SliceState.GONE not in states and changes[-1].zone == ZONE_B
    if mode == "wait":  # queued in zone A past capacity_wait_s: the wait was told, then left behind
        assert SliceState.WAITING in states


def test_no_capacity_in_any_zone_reports_only_moves_the_lifecycle_allows(emulator, joined):
    changes = []
    p = make_provider(emulator, joined, on_change=changes.append)
    emulator.stockout(ZONE_A, mode="fail")
    emulator.stockout(ZONE_B, mode="fail")
    p.request(req())
    with pytest.raises(NoCapacityError):
        p.wait_ready("s1", timeout_s=10)
    states = [c.state for c in changes]
    assert illegal_moves(changes) == [], states
    assert states[0] is SliceState.REQUESTED and states[-1] is SliceState.RELEASED


@pytest.mark.parametrize(
    ("state", "seen", "zones_left", "expect"),
    [
        # A capacity refusal while provisioning, another zone left: not lost, the request goes on there...
        (SliceState.PROVISIONING, Seen("FAILED", error=(RESOURCE_EXHAUSTED, "no v4-32")), (ZONE_B,),
         SliceState.PROVISIONING),
        # ...and there its queue reads REQUESTED or WAITING: the slice does not go back.
        (SliceState.PROVISIONING, Seen("WAITING_FOR_RESOURCES"), (), SliceState.PROVISIONING),
        (SliceState.WAITING, Seen("ACCEPTED"), (), SliceState.WAITING),
        # The last zone's refusal is the end of the request.
        (SliceState.WAITING, Seen("FAILED", error=(RESOURCE_EXHAUSTED, "no v4-32")), (), SliceState.GONE),
        # A reclaim notice before every host joined: a notice all the same.
        (SliceState.PROVISIONING, Seen("SUSPENDING", initiator="SERVICE", node="READY"), (), SliceState.PREEMPTING),
        (SliceState.READY, Seen("SUSPENDING", initiator="SERVICE", node="READY"), (), SliceState.PREEMPTING),
    ],
)
def test_a_look_moves_a_slice_only_along_its_lifecycle(state, seen, zones_left, expect):
    t = Tracked(req(), ZonePlan(ZONE_A, zones_left, (ZONE_A,)), since=0.0, state=state,
                seen=Seen("WAITING_FOR_RESOURCES"), ever_up=state is SliceState.READY)
    after, _ = judge(t, seen, now=1.0, accept_grace_s=30, capacity_wait_s=900, where=f"{PROJECT}/{ZONE_A}")
    assert after.state is expect


def test_without_fallthrough_the_policy_gets_the_zone(emulator, joined):
    p = make_provider(emulator, joined, zone_fallthrough=False)
    emulator.stockout(ZONE_B)
    p.request(req(zone=ZONE_B))
    with pytest.raises(NoCapacityError, match=ZONE_B) as err:
        p.wait_ready("s1", timeout_s=10)
    assert err.value.zones == (ZONE_B,)
    assert emulator.request_count("queuedResources.create", zone=ZONE_A) == 0


# -- losing a slice -------------------------------------------------------------------------


def test_reclaim_reaches_poll_events(emulator, provider, joined):
    provider.request(req())
    provider.wait_ready("s1", timeout_s=10)
    assert provider.poll_events() == []
    emulator.reclaim("s1")
    events = wait_for(provider.poll_events, what="an event")
    while events[-1].kind is not SliceEventKind.RECLAIMED:  # a look within the grace saw the notice first
        events += provider.poll_events()
    assert [e.kind for e in events][-1] is SliceEventKind.RECLAIMED
    assert set(e.kind for e in events) <= {SliceEventKind.PREEMPTION_NOTICE, SliceEventKind.RECLAIMED}
    assert "SERVICE" in events[-1].reason
    wait_for(lambda: provider.poll_events() == [] and provider.get("s1").state is SliceState.GONE, what="GONE")
    # The hosts leave with the nodes; the emulator tells its "Ray" on its own thread, as Ray learns of a
    # VM's death a moment after the API says PREEMPTED, so this too is waited for.
    wait_for(lambda: "s1" not in joined.slices, what="the slice's hosts gone")
    provider.release("s1")
    wait_for(lambda: qr_of(emulator, "s1") is None, what="queued resource deleted")


def test_dead_host_is_host_lost(emulator, provider):
    provider.request(req())
    provider.wait_ready("s1", timeout_s=10)
    emulator.terminate("s1")
    events = provider.poll_events()
    assert [e.kind for e in events] == [SliceEventKind.HOST_LOST]
    assert provider.get("s1").state is SliceState.GONE
    provider.release("s1")


def test_hosts_that_never_join_time_out_and_leave_nothing(emulator, joined):
    p = make_provider(emulator, joined, join_check=lambda s: [])
    p.request(req())
    with pytest.raises(ProvisioningError, match="0/4 hosts joined") as err:
        p.wait_ready("s1", timeout_s=1.0)
    assert not err.value.transient
    wait_for(lambda: qr_of(emulator, "s1") is None, what="queued resource deleted")


# -- leaks ------------------------------------------------------------------------------


def test_gc_deletes_slices_of_jobs_that_are_gone(emulator, joined, provider):
    provider.request(req("live", job="job-live"))
    provider.request(req("leak", job="job-dead"))
    provider.request(req("leak-b", job="job-dead", zone=ZONE_B))
    create_foreign_qr(emulator, ZONE_A, "theirs")  # someone else's: not ours to delete

    restarted = make_provider(emulator, joined)  # a new controller knows nothing of them
    assert {s.name for s in restarted.list()} == {"live", "leak", "leak-b"}
    assert collect_leaked(restarted, {"job-live"}, dry_run=True) == ["leak", "leak-b"]
    assert qr_of(emulator, "leak") is not None

    assert collect_leaked(restarted, {"job-live"}) == ["leak", "leak-b"]
    wait_for(lambda: qr_of(emulator, "leak") is None and qr_of(emulator, "leak-b", ZONE_B) is None, what="gc")
    assert qr_of(emulator, "live") is not None and qr_of(emulator, "theirs") is not None
    assert collect_leaked(restarted, {"job-live"}) == []
    assert [s.name for s in restarted.list(job_id="job-live")] == ["live"]


def test_a_restarted_controller_releases_by_name_only_what_is_ours(emulator, joined, provider):
    provider.request(req("mine"))
    create_foreign_qr(emulator, ZONE_B, "mine")
    restarted = make_provider(emulator, joined)
    with pytest.raises(KeyError):
        restarted.get("mine")
    restarted.release("mine")
    wait_for(lambda: qr_of(emulator, "mine") is None, what="ours deleted")
    assert qr_of(emulator, "mine", ZONE_B) is not None  # same name, not labelled by us: kept
    restarted.release("mine")  # idempotent
    restarted.release("never-existed")


def test_a_second_request_for_the_same_slice_adopts_it(emulator, joined, provider):
    provider.request(req())
    again = make_provider(emulator, joined)  # e.g. a restarted controller asks again
    assert again.request(req()).name == "s1"
    assert again.wait_ready("s1", timeout_s=10).state is SliceState.READY
    assert emulator.request_count("queuedResources.create") == 2
    again.release("s1")


def test_a_released_slice_is_forgotten_after_a_while_and_a_live_one_never(emulator, joined):
    """A controller that runs for weeks follows what is live: a slice released `forget_after_s` ago leaves the
    provider's records (and its events no one took), so each look no longer walks every slice ever asked for."""
    p = make_provider(emulator, joined, polling=Polling(poll_s=0.02, capacity_wait_s=60, request_timeout_s=5,
                                                        forget_after_s=0.3))
    for name in ("s1", "s2"):
        p.request(req(name=name))
        p.wait_ready(name, timeout_s=10)
    p.release("s1")
    assert p.get("s1").state is SliceState.RELEASED  # still known just after its release
    waiting.wait_for(lambda: p.poll_events() is not None and "s1" not in p._tracked, 10, "s1 forgotten")
    with pytest.raises(KeyError):
        p.get("s1")
    time.sleep(0.4)
    p.poll_events()
    assert p.get("s2").state is SliceState.READY  # live: never forgotten
    assert p.request(req(name="s1")).state is not SliceState.RELEASED  # asked for again: a new slice
    for name in ("s1", "s2"):
        p.release(name)


# -- credentials ------------------------------------------------------------------------


class FakeCredentials(Credentials):
    """Credentials whose token is a string we can search the logs for."""

    def refresh(self, request) -> None:
        self.token = SECRET_TOKEN

    @property
    def expired(self) -> bool:
        return False

    @property
    def valid(self) -> bool:
        return self.token is not None


def test_token_is_sent_but_never_logged(emulator, joined, caplog):
    caplog.set_level(logging.DEBUG)  # every logger, every level
    p = make_provider(emulator, joined, credentials=FakeCredentials())
    emulator.fail("queuedResources.get", "unavailable", count=1)
    p.request(req())
    p.wait_ready("s1", timeout_s=10)
    emulator.fail("queuedResources.create", "permission")
    with pytest.raises(CloudApiError):
        p.request(req("s2"))
    p.release("s1")
    assert emulator.requests() and all(r.authorized for r in emulator.requests())
    assert any("retry" in r.getMessage() for r in caplog.records)  # the retry was logged...
    for r in caplog.records:  # ...and nothing anywhere carries the token
        assert SECRET_TOKEN not in r.getMessage()
        assert SECRET_TOKEN not in repr(r.__dict__)
    assert SECRET_TOKEN not in repr(p) and SECRET_TOKEN not in repr(vars(p))


# -- the startup script -------------------------------------------------------------------


def _fake_bin(path, name: str, body: str) -> None:
    f = path / name
    f.write_text("#!/bin/bash\n" + body)
    f.chmod(f.stat().st_mode | stat.S_IEXEC)


@pytest.mark.parametrize("worker", [0, 3])
def test_startup_script_joins_each_host_with_its_resources(tmp_path, worker):
    """Run the real script with fake curl (metadata server) and a fake Ray."""
    bin_dir, venv, out = tmp_path / "bin", tmp_path / "venv", tmp_path / "ray-args"
    bin_dir.mkdir()
    (venv / "bin").mkdir(parents=True)
    _fake_bin(bin_dir, "curl", f"echo {worker}\n")
    _fake_bin(venv / "bin", "ray", f'[ "$1" = start ] && printf "%s\\n" "$@" > {out}\nexit 0\n')
    _fake_bin(bin_dir, "gcloud", "echo token-from-secret-manager\n")
    setup = WorkerSetup(HEAD, venv=str(venv), ray_token_secret="ray-token", log_file=str(tmp_path / "log"))
    script = tmp_path / "startup.sh"
    script.write_text(startup_script(setup, V4_32, "s1"))
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    subprocess.run(["bash", str(script)], env=env, check=True, timeout=30)

    args = out.read_text().splitlines()
    assert args[:2] == ["start", f"--address={HEAD}"]
    flags = dict(a.removeprefix("--").split("=", 1) for a in args[1:])
    resources = json.loads(flags["resources"])
    labels = dict(kv.split("=") for kv in flags["labels"].split(","))
    assert resources == host_node_resources(V4_32, "s1", worker)
    assert labels == host_node_labels(V4_32, "s1", worker)
    assert "token-from-secret-manager" not in (tmp_path / "log").read_text()


def test_startup_script_rejects_a_worker_number_the_slice_lacks(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _fake_bin(bin_dir, "curl", "echo 9\n")
    setup = WorkerSetup(HEAD, venv=str(tmp_path / "venv"), log_file=str(tmp_path / "log"))
    script = tmp_path / "startup.sh"
    script.write_text(startup_script(setup, V4_32, "s1"))
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    assert subprocess.run(["bash", str(script)], env=env, timeout=30).returncode == 1
    assert "not a host of v4-32" in (tmp_path / "log").read_text()


def test_suspending_is_a_notice_within_the_grace_then_a_reclaim(joined):
    """SUSPENDING (initiator SERVICE) with the nodes still up is a notice: the hosts have their grace to save."""
    hooks = Hooks(on_node_ready=joined.ready, on_node_gone=joined.gone)
    with running_emulator(time_scale=0.05, seed=7, hooks=hooks) as emu:  # a 1.5 s grace
        p = make_provider(emu, joined, polling=Polling(poll_s=0.02, capacity_wait_s=60, request_timeout_s=5))
        p.request(req())
        p.wait_ready("s1", timeout_s=30)
        emu.reclaim("s1")
        events = wait_for(p.poll_events, what="the notice")
        assert [e.kind for e in events] == [SliceEventKind.PREEMPTION_NOTICE], events
        assert p.get("s1").state is SliceState.PREEMPTING
        events = wait_for(p.poll_events, what="the reclaim")
        assert [e.kind for e in events] == [SliceEventKind.RECLAIMED]
        assert p.get("s1").state is SliceState.GONE
        p.release("s1")


def test_a_request_expires_in_the_cloud_at_its_valid_until(emulator, joined):
    """The queue timeout is the queued resource's own validUntil: it fails there, unfilled, and
    the provider's look calls it no capacity and leaves nothing behind."""
    p = make_provider(emulator, joined, zones=(ZONE_A,), polling=Polling(poll_s=0.02, capacity_wait_s=600,
                                                                          request_timeout_s=5))
    emulator.stockout(ZONE_A, mode="wait")
    p.request(SliceRequest(job_id="job-1", name="s1", tpu_type=V4_32, tier=Tier.SPOT, queue_timeout_s=1.0))
    qr = wait_for(lambda: qr_of(emulator, "s1"), what="the queued resource")
    assert qr["queueingPolicy"]["validUntilDuration"].startswith("1")
    s = wait_for(lambda: (s := p.check("s1")).state.terminal and s, timeout_s=10, what="expiry")
    assert s.state is SliceState.RELEASED
    assert [e.kind for e in p.poll_events(slices=["s1"])] == [SliceEventKind.NO_CAPACITY]
    wait_for(lambda: qr_of(emulator, "s1") is None, what="queued resource deleted")
