"""The providers' facts (`orchestrator.domain.provider_facts`): one record for every provider a job file
may name, what each states, and the registry that gives a job its slices' provider."""

from __future__ import annotations

import typing

import pytest

from orchestrator import cluster
from orchestrator.control import spares
from orchestrator.control.controller import Controller
from orchestrator.domain.provider_facts import PROVIDERS, ReportRoute, facts
from orchestrator.domain.spec import JobSpec
from orchestrator.errors import SpecError
from orchestrator.providers.local import LocalProvider
from workers.notices import GCE_METADATA_URL

NAMES = set(typing.get_args(JobSpec.model_fields["provider"].annotation))


def test_every_provider_the_spec_accepts_has_facts_and_a_slice_provider():
    assert NAMES == {"local", "gcp"}
    assert set(PROVIDERS) == NAMES
    assert set(Controller.SLICE_PROVIDERS) == NAMES
    assert all(facts(name).name == name for name in NAMES)


@pytest.mark.parametrize("name, expected", [
    ("local", dict(poll_interval_s=0.2, limited_by_local_hosts=True, queues_capacity_locally=True, ships_code=False,
                   report_route=ReportRoute.DIRECT, metadata_url=None, owns_cloud_resources=False,
                   needs_gcp_config=False, hosts_share_disk=True, replays_capacity_trace=True, zone="local",
                   spare_workers=False)),
    ("gcp", dict(poll_interval_s=5.0, limited_by_local_hosts=False, queues_capacity_locally=False, ships_code=True,
                 report_route=ReportRoute.INBOX, metadata_url=GCE_METADATA_URL, owns_cloud_resources=True,
                 needs_gcp_config=True, hosts_share_disk=False, replays_capacity_trace=False, zone=None,
                 spare_workers=True)),
])
def test_the_facts_of_each_provider(name, expected):
    f = facts(name)
    assert {k: getattr(f, k) for k in expected} == expected
    assert set(expected) | {"name"} == set(f.__dataclass_fields__)  # every fact is stated above


def test_an_unknown_provider_names_the_field_and_the_valid_ones():
    with pytest.raises(SpecError) as e:
        facts("aws")
    assert e.value.problems == [("provider", "unknown provider 'aws'; valid: gcp, local")]


def test_a_spec_reads_its_providers_facts():
    assert JobSpec(name="a").provider_facts is facts("local")
    spec = JobSpec(name="a", provider="gcp", gcp={"project": "p", "zones": ["us-central2-b"], "bucket": "bkt"})
    assert spec.provider_facts is facts("gcp")


@pytest.mark.parametrize("provider, chosen, wanted", [
    ("local", None, False), ("gcp", None, True), ("local", True, True), ("gcp", False, False)])
def test_spare_workers_are_the_providers_unless_the_spec_says(provider, chosen, wanted):
    where = {"local": {}, "gcp": {"gcp": {"project": "p", "zones": ["us-central2-b"], "bucket": "bkt"}}}[provider]
    spec = JobSpec.from_dict({"name": "a", "provider": provider, "recovery": {"spare_workers": chosen}, **where})
    assert spares.wanted(spec) is wanted


def test_fault_injection_is_the_local_providers(tmp_path):
    provider = LocalProvider(cluster.Home(tmp_path).ensure(), "127.0.0.1:1")
    provider.inject_fault("short_host", worker_id=1)
    assert provider.short_hosts == {1}
    provider.inject_fault("clear")
    assert provider.short_hosts == set()
    with pytest.raises(ValueError, match="unknown fault 'flood'"):
        provider.inject_fault("flood")
    assert not hasattr(Controller, "inject_fault")  # no part of the controller's API
