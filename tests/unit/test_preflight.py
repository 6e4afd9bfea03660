"""What `validate` and `submit` check on gcp before anything is provisioned (`orchestrator.user.preflight`)."""

from __future__ import annotations

from orchestrator import JobSpec
from orchestrator.user.preflight import gcp_problems, head_problems, storage_problems
from tests.storage_fixture import BUCKET, gcs, gcs_emulator  # noqa: F401 (fixtures)


def gcp_spec(**gcp) -> JobSpec:
    return JobSpec.from_dict({"name": "pre", "provider": "gcp",
                              "gcp": {"project": "p", "zones": ["us-central2-b"], "bucket": BUCKET, **gcp}})


def test_a_loopback_head_is_refused_for_real_tpu_vms():
    [(field, why)] = head_problems(gcp_spec(), "127.0.0.1:6379")
    assert field.startswith("gcp.head_address") and "cannot reach" in why
    [(field, _)] = head_problems(gcp_spec(head_address="localhost:6379"), None)
    assert field == "gcp.head_address"


def test_a_reachable_head_or_an_emulated_api_passes():
    assert head_problems(gcp_spec(head_address="10.128.0.5:6379"), "127.0.0.1:6379") == []
    assert head_problems(gcp_spec(endpoint="http://127.0.0.1:8470"), "127.0.0.1:6379") == []
    assert head_problems(gcp_spec(), None) == []  # `validate`: no cluster to ask yet
    assert gcp_problems(JobSpec.from_dict({"name": "pre"}), "127.0.0.1:6379") == []  # local: nothing to check


def test_the_bucket_is_probed_writable(gcs_emulator):
    spec = JobSpec.from_dict({**gcp_spec(head_address="10.0.0.2:6379").model_dump(mode="json"),
                              "storage": {"endpoint": gcs_emulator.url}})
    assert storage_problems(spec) == [] and gcp_problems(spec) == []
    missing = JobSpec.from_dict({**spec.model_dump(mode="json"),
                                 "gcp": {**spec.model_dump(mode="json")["gcp"], "bucket": "no-such-bucket"}})
    [(field, why)] = storage_problems(missing)
    assert field == "gcp.bucket" and "gs://no-such-bucket/checkpoints/pre" in why and "cannot write" in why
