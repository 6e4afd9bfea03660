"""The TPU API emulator, through the real client and over raw HTTP.

These pin what the provider's tests rely on: the real API's state sequences, field
names and error shapes, and faults that do what they say.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request

import pytest
from google.api_core import exceptions as gexc
from google.cloud import tpu_v2
from google.longrunning import operations_pb2
from google.protobuf import json_format

from orchestrator.emulator import ControlClient, ControlError, Emulator, Hooks, running_emulator, serve
from orchestrator.emulator import machines as m
from tests.emulator_fixture import emulator_fixture

pytestmark = pytest.mark.timeout(60)

PROJECT, ZONE, ZONE_B = "p", "us-central2-b", "europe-west4-a"
PARENT = f"projects/{PROJECT}/locations/{ZONE}"
QR_NAME, NODE_NAME = f"{PARENT}/queuedResources/q1", f"{PARENT}/nodes/q1"
QRState = tpu_v2.QueuedResourceState.State


@pytest.fixture
def emulator():
    with running_emulator(time_scale=0.002) as emu:
        yield emu
    assert not [t for t in threading.enumerate() if t.name.startswith("tpu-emulator")]


fast_emulator = emulator_fixture("fast_emulator", time_scale=0.001)


def qr_spec(node_id: str = "q1", parent: str = PARENT, accelerator: str = "v4-16", spot: bool = True):
    node = tpu_v2.Node(accelerator_type=accelerator, runtime_version="tpu-ubuntu2204-base", labels={"job": "j1"})
    spec = tpu_v2.QueuedResource.Tpu.NodeSpec(parent=parent, node_id=node_id, node=node)
    tier = {"spot": tpu_v2.QueuedResource.Spot()} if spot else {"guaranteed": tpu_v2.QueuedResource.Guaranteed()}
    return tpu_v2.QueuedResource(tpu=tpu_v2.QueuedResource.Tpu(node_spec=[spec]), **tier)


def create(client, qr_id: str = "q1", parent: str = PARENT, **kw):
    return client.create_queued_resource(parent=parent, queued_resource_id=qr_id,
                                         queued_resource=qr_spec(qr_id, parent, **kw))


def wait_state(client, name: str, state, timeout_s: float = 5.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        qr = client.get_queued_resource(name=name)
        if qr.state.state == state:
            return qr
        time.sleep(0.005)
    raise AssertionError(f"{name} never reached {state.name}; last {qr.state.state.name}")


def state_of(client, name: str = QR_NAME) -> str:
    return client.get_queued_resource(name=name).state.state.name


# The real service's timings, on a manual clock: time passes only when a test calls `advance`.
STEPS = m.MachineTimings()
TO_ACTIVE_S = STEPS.accept_s + STEPS.queue_s + STEPS.capacity_s + STEPS.provision_s


def manual_emulator(**kwargs):
    return running_emulator(timings=STEPS, manual_clock=True, **kwargs)


def http(url: str, method: str = "GET", body: dict | None = None, **headers: str) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


# -- the state machines -------------------------------------------------------------------


def test_queued_resource_walks_the_real_states_in_order():
    # Each step's time passes on the manual clock, so every state is seen, however busy the machine.
    with manual_emulator() as emu:
        client = emu.client()
        create(client)
        seen, node_states = [state_of(client)], set()
        for step in ("accept", "queue", "capacity", "provision"):
            if seen[-1] == "PROVISIONING":
                node_states.add(client.get_node(name=NODE_NAME).state.name)
            emu.advance(STEPS.of(step))
            seen.append(state_of(client))
        assert seen == ["CREATING", "ACCEPTED", "WAITING_FOR_RESOURCES", "PROVISIONING", "ACTIVE"]
        assert node_states == {"CREATING"}
        node = client.get_node(name=NODE_NAME)
        assert node.state.name == "READY" and node.queued_resource == QR_NAME
        assert len(node.network_endpoints) == 2  # v4-16: two hosts
        assert node.scheduling_config.spot and node.labels["job"] == "j1"


def test_a_manual_clock_moves_only_when_advanced_and_only_forward():
    with manual_emulator() as emu:
        client = emu.client()
        create(client)
        emu.advance(STEPS.accept_s - 0.5)
        assert state_of(client) == "CREATING"
        emu.advance(0.5)
        assert state_of(client) == "ACCEPTED"
        with pytest.raises(ValueError, match="forward"):
            emu.advance(-1.0)
    with running_emulator(time_scale=0.002) as emu, pytest.raises(RuntimeError, match="manual_clock"):
        emu.advance(1.0)


def test_a_queued_resource_past_its_valid_until_fails_unbilled_on_the_emulator_s_clock():
    with manual_emulator() as emu:
        client = emu.client()
        emu.stockout(ZONE)
        spec = qr_spec()
        spec.queueing_policy = tpu_v2.QueuedResource.QueueingPolicy(valid_until_duration={"seconds": 600})
        client.create_queued_resource(parent=PARENT, queued_resource_id="q1", queued_resource=spec)
        emu.advance(590)
        assert state_of(client) == "WAITING_FOR_RESOURCES"
        emu.advance(30)
        qr = client.get_queued_resource(name=QR_NAME)
        assert qr.state.state == QRState.FAILED and qr.state.failed_data.error.code == 4  # DEADLINE_EXCEEDED


def test_create_operation_ends_when_the_queued_resource_is_accepted(emulator):
    op = create(emulator.client())
    assert not op.operation.done  # as the create call answered
    qr = op.result(timeout=10)
    assert qr.name == QR_NAME and qr.state.state != QRState.CREATING


def test_every_move_is_checked_against_the_table():
    with pytest.raises(m.EmulatorBug):
        m.check_qr("q", m.ACTIVE, m.PROVISIONING)
    with pytest.raises(m.EmulatorBug):
        m.check_node("n", m.N_PREEMPTED, m.N_READY)
    # Every state can reach DELETING, and DELETING is the end.
    assert all(m.DELETING in nxt for s, nxt in m.QR_TRANSITIONS.items() if s != m.DELETING)
    assert m.QR_TRANSITIONS[m.DELETING] == frozenset()


def test_delete_of_an_active_queued_resource_needs_force():
    # On the manual clock the forced delete stays DELETING until its time passes, however busy the machine.
    with manual_emulator() as emu:
        client = emu.client()
        create(client)
        emu.advance(TO_ACTIVE_S)
        assert state_of(client) == "ACTIVE"
        with pytest.raises(gexc.BadRequest, match="force"):
            client.delete_queued_resource(name=QR_NAME)
        with pytest.raises(gexc.BadRequest, match="queued resource"):
            client.delete_node(name=NODE_NAME)  # owned by the queued resource
        op = client.delete_queued_resource(request=tpu_v2.DeleteQueuedResourceRequest(name=QR_NAME, force=True))
        assert state_of(client) == "DELETING"
        emu.advance(STEPS.delete_s)
        op.result(timeout=10)
        with pytest.raises(gexc.NotFound):
            client.get_queued_resource(name=QR_NAME)
        with pytest.raises(gexc.NotFound):
            client.get_node(name=NODE_NAME)


def test_direct_node_create_and_delete(emulator):
    client = emulator.client()
    node = tpu_v2.Node(accelerator_type="v4-8", runtime_version="tpu-ubuntu2204-base")
    created = client.create_node(parent=PARENT, node_id="n1", node=node).result(timeout=10)
    assert created.state.name == "READY" and not created.queued_resource
    client.delete_node(name=f"{PARENT}/nodes/n1").result(timeout=10)
    with pytest.raises(gexc.NotFound):
        client.get_node(name=f"{PARENT}/nodes/n1")


def test_reclaim_suspends_then_preempts_and_calls_the_hooks_in_order():
    calls: list[tuple] = []
    hooks = Hooks(on_node_ready=lambda *a: calls.append(("ready", *a)),
                  on_node_gone=lambda *a: calls.append(("gone", *a)),
                  on_preemption_notice=lambda *a: calls.append(("notice", *a)))
    with manual_emulator(hooks=hooks) as emu:
        client = emu.client()
        create(client)
        emu.advance(TO_ACTIVE_S)
        assert state_of(client) == "ACTIVE"
        assert emu.reclaim("q1") == QR_NAME
        qr = client.get_queued_resource(name=QR_NAME)
        assert qr.state.state == QRState.SUSPENDING and qr.state.state_initiator.name == "SERVICE"
        assert client.get_node(name=NODE_NAME).state.name == "READY"  # the grace period
        emu.advance(STEPS.preempt_grace_s)
        assert state_of(client) == "SUSPENDED"
        assert client.get_node(name=NODE_NAME).state.name == "PREEMPTED"
    assert calls == [("ready", "q1", "v4-16", 2, {"job": "j1"}, {}), ("notice", "q1"), ("gone", "q1", "preempted")]


def test_a_failing_hook_is_logged_and_the_emulator_goes_on(caplog):
    def broken(*args):
        raise RuntimeError("hook broke")

    with running_emulator(time_scale=0.002, hooks=Hooks(on_node_ready=broken)) as emu:
        client = emu.client()
        create(client)
        wait_state(client, QR_NAME, QRState.ACTIVE)
        create(client, "q2")
        wait_state(client, f"{PARENT}/queuedResources/q2", QRState.ACTIVE)
    assert "hook broke" in caplog.text


def test_terminate_kills_a_node(emulator):
    client = emulator.client()
    create(client)
    wait_state(client, QR_NAME, QRState.ACTIVE)
    emulator.terminate("q1")
    assert client.get_node(name=NODE_NAME).state.name == "TERMINATED"


# -- faults ---------------------------------------------------------------------------------


def test_stockout_waits_until_cleared():
    with manual_emulator() as emulator:
        client = emulator.client()
        emulator.stockout(ZONE)
        create(client)
        emulator.advance(STEPS.accept_s + STEPS.queue_s)
        assert state_of(client) == "WAITING_FOR_RESOURCES"
        emulator.advance(100 * STEPS.capacity_s)
        assert client.get_queued_resource(name=QR_NAME).state.state == QRState.WAITING_FOR_RESOURCES
        emulator.clear_stockout(ZONE)
        emulator.advance(STEPS.capacity_s + STEPS.provision_s)
        assert state_of(client) == "ACTIVE"


def test_stockout_can_fail_with_resource_exhausted_and_spare_other_types(emulator):
    client = emulator.client()
    emulator.stockout(ZONE, accelerator_type="v4-16", mode="fail")
    create(client)
    create(client, "small", accelerator="v4-8")
    qr = wait_state(client, QR_NAME, QRState.FAILED)
    assert qr.state.failed_data.error.code == 8 and ZONE in qr.state.failed_data.error.message
    wait_state(client, f"{PARENT}/queuedResources/small", QRState.ACTIVE)


def test_scripted_errors_hit_only_their_method_zone_and_count(emulator):
    client = emulator.client()
    emulator.fail("queuedResources.get", "unavailable", count=2, zone=ZONE)
    create(client)
    create(client, "b1", parent=f"projects/{PROJECT}/locations/{ZONE_B}")
    client.get_queued_resource(name=f"projects/{PROJECT}/locations/{ZONE_B}/queuedResources/b1")
    for _ in range(2):
        with pytest.raises(gexc.ServiceUnavailable):
            client.get_queued_resource(name=QR_NAME)
    client.get_queued_resource(name=QR_NAME)
    assert [r.status for r in emulator.requests("queuedResources.get", zone=ZONE)] == [503, 503, 200]


@pytest.mark.parametrize(("kind", "exc", "reason"), [
    ("permission", gexc.Forbidden, "IAM_PERMISSION_DENIED"),
    ("quota", gexc.TooManyRequests, "QUOTA_EXCEEDED"),
    ("rate_limited", gexc.TooManyRequests, "RATE_LIMIT_EXCEEDED"),
    ("deadline", gexc.GatewayTimeout, None),
])
def test_error_kinds_reach_the_client_as_google_api_errors(emulator, kind, exc, reason):
    emulator.fail("queuedResources.create", kind)
    with pytest.raises(exc) as err:
        create(emulator.client())
    assert err.value.reason == reason
    assert emulator.state()["queuedResources"] == []  # a failed call changed nothing


def test_random_errors_replay_with_the_same_seed():
    def statuses() -> list[int]:
        with running_emulator(time_scale=0.002) as emu:
            emu.random_errors(0.5, codes=(503, 429), seed=42)
            client = emu.client()
            for _ in range(20):
                try:
                    client.list_queued_resources(parent=PARENT)
                except (gexc.ServiceUnavailable, gexc.TooManyRequests):
                    pass
            return [r.status for r in emu.requests()]

    first = statuses()
    assert first == statuses() and {503, 429, 200} <= set(first)


def test_faults_reject_what_they_do_not_know(emulator):
    with pytest.raises(ValueError, match="unknown method"):
        emulator.fail("queuedResources.explode", "unavailable")
    with pytest.raises(ValueError, match="unknown error kind"):
        emulator.fail("queuedResources.get", "meteor")
    with pytest.raises(ValueError, match="not transient"):
        emulator.random_errors(0.1, codes=(404,))
    with pytest.raises(ValueError, match="stockout mode"):
        emulator.stockout(ZONE, mode="sometimes")


# -- the wire ---------------------------------------------------------------------------------


def test_responses_parse_strictly_as_the_real_types(emulator):
    client = emulator.client()
    op = create(client)
    wait_state(client, QR_NAME, QRState.ACTIVE)
    base = f"{emulator.url}/v2/{PARENT}"
    for path, cls in [("/queuedResources/q1", tpu_v2.QueuedResource), ("/nodes/q1", tpu_v2.Node),
                      ("/queuedResources", tpu_v2.ListQueuedResourcesResponse),
                      ("/nodes", tpu_v2.ListNodesResponse)]:
        status, body = http(base + path)
        assert status == 200
        cls.from_json(json.dumps(body), ignore_unknown_fields=False)  # raises on an unknown field
    status, body = http(f"{emulator.url}/v2/{op.operation.name}")
    parsed = json_format.Parse(json.dumps(body), operations_pb2.Operation())
    assert parsed.done and parsed.response.type_url.endswith("google.cloud.tpu.v2.QueuedResource")
    status, body = http(base + "/queuedResources/q1?%24alt=json%3Benum-encoding%3Dint")
    assert body["state"]["state"] == QRState.ACTIVE.value  # numbers when the client asks for them


def test_requests_are_checked_like_the_real_api(emulator):
    base = f"{emulator.url}/v2/{PARENT}/queuedResources"
    status, body = http(base + "?queuedResourceId=q1", "POST", {"bogus": 1})
    assert status == 400 and body["error"]["status"] == "INVALID_ARGUMENT" and "bogus" in body["error"]["message"]
    spec = json.loads(tpu_v2.QueuedResource.to_json(qr_spec()))
    spec["tpu"]["nodeSpec"][0]["node"]["labels"] = {"Job": "UPPER"}
    status, body = http(base + "?queuedResourceId=q1", "POST", spec)
    assert status == 400 and "label" in body["error"]["message"]
    spec = json.loads(tpu_v2.QueuedResource.to_json(qr_spec(accelerator="v9-1")))
    assert http(base + "?queuedResourceId=q1", "POST", spec)[0] == 400
    create(emulator.client())
    with pytest.raises(gexc.Conflict):
        create(emulator.client())
    assert http(f"{emulator.url}/v2/nothing/here")[0] == 404


def test_lists_come_in_pages(emulator):
    client = emulator.client()
    for i in range(3):
        create(client, f"q{i}")
    names = [q.name for q in client.list_queued_resources(
        request=tpu_v2.ListQueuedResourcesRequest(parent=PARENT, page_size=2))]
    assert names == [f"{PARENT}/queuedResources/q{i}" for i in range(3)]
    assert emulator.request_count("queuedResources.list") == 2


def test_configured_zones_are_the_only_ones():
    with running_emulator(time_scale=0.002, zones=(ZONE,)) as emu:
        with pytest.raises(gexc.NotFound):
            create(emu.client(), parent=f"projects/{PROJECT}/locations/{ZONE_B}")
        create(emu.client())


def test_the_fixture_factory_gives_a_running_emulator(fast_emulator):
    client = fast_emulator.client()
    create(client)
    wait_state(client, QR_NAME, QRState.ACTIVE)


def test_serves_loopback_only():
    with pytest.raises(ValueError, match="loopback"):
        serve(host="0.0.0.0")
    with running_emulator(time_scale=0.002) as emu:
        assert emu.url.startswith("http://127.0.0.1:")


# -- the control API ----------------------------------------------------------------------------


def test_control_api_over_http(emulator):
    control = emulator.control()
    client = emulator.client()
    control.stockout(ZONE)
    create(client)
    wait_state(client, QR_NAME, QRState.WAITING_FOR_RESOURCES)
    assert control.state()["faults"]["stockouts"] == [{"zone": ZONE, "acceleratorType": None, "mode": "wait"}]
    control.clear_stockout()
    wait_state(client, QR_NAME, QRState.ACTIVE)
    assert control.reclaim("q1") == QR_NAME
    control.fail("nodes.get", "permission")
    with pytest.raises(gexc.Forbidden):
        client.get_node(name=NODE_NAME)
    assert any(r["method"] == "nodes.get" and r["status"] == 403 for r in control.requests())
    control.random_errors(1.0, codes=(503,), seed=1)
    with pytest.raises(gexc.ServiceUnavailable):
        client.get_node(name=NODE_NAME)
    control.clear_faults()
    client.get_node(name=NODE_NAME)
    with pytest.raises(ControlError, match="400"):
        control.fail("nodes.get", "meteor")
    with pytest.raises(ControlError, match="404"):
        control.reclaim("no-such-slice")


def test_control_api_without_the_token_is_refused_and_changes_nothing(emulator):
    client = emulator.client()
    create(client)
    wait_state(client, QR_NAME, QRState.ACTIVE)
    for control in (ControlClient(emulator.url), ControlClient(emulator.url, token="not-the-token-0123456789")):
        calls = (lambda c=control: c.reclaim("q1"), lambda c=control: c.stockout(ZONE), control.state, control.requests)
        for call in calls:
            with pytest.raises(ControlError) as e:
                call()
            assert e.value.status == 401 and "control token" in str(e.value)
    status, body = http(f"{emulator.url}/_emulator/terminate", "POST", {"name": "q1"}, Authorization="Bearer ")
    assert status == 401 and body["error"]["status"] == "UNAUTHENTICATED"
    state = emulator.control().state()  # the world as it was: no stockout, the slice still ACTIVE
    assert state["faults"]["stockouts"] == []
    assert [q["state"]["state"] for q in state["queuedResources"]] == ["ACTIVE"]
    assert [n["state"] for n in state["nodes"]] == ["READY"]


def test_control_post_must_be_json(emulator):
    # What a browser page could send without a preflight, were the token known.
    status, body = http(f"{emulator.url}/_emulator/stockout", "POST", {"zone": ZONE},
                        Authorization=f"Bearer {emulator.control_token}", **{"Content-Type": "text/plain"})
    assert status == 415 and "application/json" in body["error"]["message"]
    assert emulator.control().state()["faults"]["stockouts"] == []


def test_a_given_control_token_is_used_a_weak_one_refused():
    token = "a-given-token-0123456789"
    with running_emulator(time_scale=0.002, control_token=token) as emu:
        assert emu.control_token == token
        assert token not in repr(emu.config) and token not in repr(emu.control())
        ControlClient(emu.url, token=token).stockout(ZONE)
        assert emu.state()["faults"]["stockouts"][0]["zone"] == ZONE
    with pytest.raises(ValueError, match="16 visible ASCII"):
        serve(control_token="short")
    a, b = Emulator(), Emulator()  # not started: the token is made with the handle
    assert len(a.control_token) >= 32 and a.control_token != b.control_token


def test_request_log_keeps_no_header_values(emulator, caplog):
    caplog.set_level(logging.DEBUG)
    req = urllib.request.Request(f"{emulator.url}/v2/{PARENT}/nodes", headers={"Authorization": "Bearer s3cr3t-xyz"})
    urllib.request.urlopen(req, timeout=10).read()
    (rec,) = emulator.requests("nodes.list")
    assert rec.authorized and "s3cr3t-xyz" not in repr(rec)
    assert "s3cr3t-xyz" not in caplog.text


def test_the_api_refuses_what_a_browser_page_sends(emulator):
    """The API paths take no token, as the real client calls them anonymously; a request that
    carries an Origin header (browsers send one, the TPU client never does) is refused."""
    body = {"tpu": {"nodeSpec": [{"parent": PARENT, "nodeId": "n1", "node": {"acceleratorType": "v4-8",
                                                                              "runtimeVersion": "v2"}}]}}
    url = f"{emulator.url}/v2/{PARENT}/queuedResources?queuedResourceId=from-a-page"
    status, _ = http(url, "POST", body, Origin="http://evil.example")
    assert status == 403
    assert emulator.client().list_queued_resources(parent=PARENT).queued_resources == []
    status, _ = http(url, "POST", body)  # the same request from a program: served
    assert status == 200


def test_a_burst_of_connections_is_taken_not_dropped(emulator):
    """A controller of many jobs opens a connection a request (HTTP/1.0) from many threads at once. The
    server's backlog holds a burst of them: none waits for its SYN to be sent again (a second or more), as
    over socketserver's default backlog of 5 (the kernel drops what is over it)."""
    import select
    import socket
    from urllib.parse import urlsplit

    where = urlsplit(emulator.url)
    socks = [socket.socket() for _ in range(200)]
    try:
        for s in socks:
            s.setblocking(False)
            s.connect_ex((where.hostname, where.port))
        pending, deadline = set(socks), time.monotonic() + 0.5  # well under the first SYN resend (1 s)
        while pending and time.monotonic() < deadline:
            _, writable, _ = select.select([], list(pending), [], max(0.0, deadline - time.monotonic()))
            pending -= {s for s in writable if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0}
        assert not pending, f"{len(pending)} of {len(socks)} connections not taken in 0.5 s"
    finally:
        for s in socks:
            s.close()
