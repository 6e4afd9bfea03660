"""Partial responses: the emulator answers only the fields an `X-Goog-FieldMask` header or a `fields` parameter
names, as Google's APIs do, and refuses a mask that names no field of the answer; the provider's zone listing
asks for the states alone (`TpuApi.list_zone(states_only=True)`) and reads from them what a full listing gives."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request

import pytest
from google.api_core import exceptions as gexc
from google.cloud import tpu_v2

from orchestrator.emulator import fieldmask
from orchestrator.emulator.errors import ApiError
from orchestrator.providers.gcp.api import BRIEF_NODES, BRIEF_QRS, RetryPolicy, TpuApi
from orchestrator.providers.gcp.looks import ZoneListing
from tests.emulator_fixture import emulator_fixture

pytestmark = pytest.mark.timeout(60)

PROJECT, ZONE = "p", "us-central2-b"
PARENT = f"projects/{PROJECT}/locations/{ZONE}"
NODES = tpu_v2.ListNodesResponse.pb().DESCRIPTOR

emulator = emulator_fixture(time_scale=0.002)


def test_a_mask_keeps_the_fields_it_names_in_each_element_of_a_list():
    payload = {"nodes": [{"name": "a", "state": "READY", "labels": {"job": "j"},
                          "networkEndpoints": [{"ipAddress": "10.0.0.1", "port": 8470}]}],
               "nextPageToken": "2", "unreachable": ["z"]}
    tree = fieldmask.parse("nodes(name,state,networkEndpoints.ipAddress),nextPageToken")
    fieldmask.check(tree, NODES, "m")
    assert fieldmask.apply(payload, tree, NODES) == {
        "nodes": [{"name": "a", "state": "READY", "networkEndpoints": [{"ipAddress": "10.0.0.1"}]}],
        "nextPageToken": "2"}
    same = fieldmask.parse("nodes.name, nodes.state,nodes.network_endpoints.ip_address,next_page_token")
    fieldmask.check(same, NODES, "m")  # proto names and spaces too
    assert fieldmask.apply(payload, same, NODES) == fieldmask.apply(payload, tree, NODES)
    assert fieldmask.parse("*") is None and fieldmask.parse("") is None
    assert fieldmask.apply(payload, None, NODES) is payload


@pytest.mark.parametrize("mask, why", [
    ("nodes.nme", "has no field 'nme'"),
    ("nodes(name", "')' expected"),
    ("nodes.name.x", "has no fields of its own"),
    ("nodes,", "a field name expected"),
    ("nodes.*", "'*' only as the whole mask"),
    ("nodes;", "cannot read it"),
])
def test_a_mask_that_names_no_field_or_cannot_be_read_is_refused(mask, why):
    with pytest.raises(ApiError, match=re.escape(why)) as e:
        fieldmask.check(fieldmask.parse(mask), NODES, mask)
    assert e.value.http == 400


def _create(client, name: str) -> None:
    node = tpu_v2.Node(accelerator_type="v4-16", runtime_version="tpu-ubuntu2204-base", labels={"job": "j1"},
                       metadata={"startup-script": "#!/bin/bash\n" + "echo a long script\n" * 200})
    spec = tpu_v2.QueuedResource(tpu=tpu_v2.QueuedResource.Tpu(node_spec=[
        tpu_v2.QueuedResource.Tpu.NodeSpec(parent=PARENT, node_id=name, node=node)]),
        spot=tpu_v2.QueuedResource.Spot())
    client.create_queued_resource(parent=PARENT, queued_resource_id=name, queued_resource=spec)


def _api(emulator) -> TpuApi:
    return TpuApi(PROJECT, endpoint=emulator.url, credentials=None, impersonate=None,
                  retry=RetryPolicy(attempts=1), request_timeout_s=10, sleep=time.sleep)


def test_the_zone_listing_asks_for_the_states_alone_and_a_look_reads_the_same_from_them(emulator):
    client = emulator.client()
    _create(client, "q1")
    deadline = time.monotonic() + 10
    while client.get_queued_resource(name=f"{PARENT}/queuedResources/q1").state.state.name != "ACTIVE":
        assert time.monotonic() < deadline, "the queued resource never became ACTIVE"
        time.sleep(0.02)
    api = _api(emulator)
    full, brief = api.list_zone(ZONE), api.list_zone(ZONE, states_only=True)
    node = f"{PARENT}/nodes/q1"
    assert brief[0][0].tpu.node_spec == [] and brief[1][node].metadata == {}  # no spec, no startup script
    assert brief[0][0].state.state.name == "ACTIVE" and brief[1][node].state.name == "READY"
    looks = [ZoneListing(0.0, {q.name.rsplit("/", 1)[1]: q for q in qrs}, nodes, fresh_for=1.0)
             .seen("q1", node, lambda: None) for qrs, nodes in (full, brief)]
    assert looks[0] == looks[1] and looks[0].addresses  # the same reading, addresses included
    sizes = [len(urllib.request.urlopen(urllib.request.Request(
        f"{emulator.url}/v2/{PARENT}/nodes", headers=h)).read()) for h in ({}, {"X-Goog-FieldMask": BRIEF_NODES})]
    assert sizes[1] * 10 < sizes[0]


def test_the_api_refuses_a_bad_mask_with_400_and_the_fields_parameter_works_too(emulator):
    client = emulator.client()
    with pytest.raises(gexc.BadRequest, match="has no field 'nope'"):
        client.list_queued_resources(parent=PARENT, metadata=[("x-goog-fieldmask", "queuedResources.nope")])
    assert emulator.request_count("queuedResources.list") == 1  # answered, with the API's own 400
    _create(client, "q2")
    with pytest.raises(urllib.error.HTTPError) as e:  # a create with a bad mask changes nothing
        urllib.request.urlopen(urllib.request.Request(
            f"{emulator.url}/v2/{PARENT}/queuedResources?queuedResourceId=q3&fields=(", data=b"{}",
            headers={"Content-Type": "application/json"}))
    assert e.value.code == 400
    assert [q.name.rsplit("/", 1)[1] for q in client.list_queued_resources(parent=PARENT)] == ["q2"]
    body = json.loads(urllib.request.urlopen(f"{emulator.url}/v2/{PARENT}/queuedResources?fields={BRIEF_QRS}").read())
    assert set(body) == {"queuedResources"} and set(body["queuedResources"][0]) == {"name", "state"}
