"""The read side over a synthetic preempted job: /metrics scraped over real HTTP, and its report files."""

from __future__ import annotations

import base64
import re
import struct
import threading
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from orchestrator.catalog import lookup
from orchestrator.observe.goodput import CATEGORIES
from orchestrator.observe.metrics import RemoteMetricsRefused, serve_metrics
from orchestrator.observe.report import write_report
from orchestrator.observe.report_series import NoStepsError, report_series
from orchestrator.state.states import JobState
from orchestrator.state.store import Store
from tests.unit.test_goodput import T0, preempted_job

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "state.db")
    preempted_job(s, "job-p")
    return s


@pytest.fixture
def metrics(store):
    """{(name, frozenset(labels.items())): value} from one scrape of a real server on 127.0.0.1."""
    server, port = serve_metrics(store)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            assert resp.status == 200
            text = resp.read().decode()
    finally:
        server.stop()
    assert not server.serving
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _value(metrics, metric, /, **labels):
    return metrics[(metric, frozenset(labels.items()))]


def test_scrape_carries_the_jobs_values_under_prometheus_names(metrics):
    assert _value(metrics, "orchestrator_job_completed_steps", job_id="job-p") == 20
    assert _value(metrics, "orchestrator_job_loss", job_id="job-p") == pytest.approx(5.0 / 20)
    assert _value(metrics, "orchestrator_job_tokens_per_second", job_id="job-p") == pytest.approx(1019.0)
    assert _value(metrics, "orchestrator_job_info", job_id="job-p", name="lm", accelerator="v4-8", tier="spot") == 1
    assert _value(metrics, "orchestrator_job_state", job_id="job-p", state="SUCCEEDED") == 1
    assert sum(_value(metrics, "orchestrator_job_state", job_id="job-p", state=s.value) for s in JobState) == 1
    assert _value(metrics, "orchestrator_job_goodput_ratio", job_id="job-p") == pytest.approx(30 / 110)
    assert sum(_value(metrics, "orchestrator_job_time_seconds", job_id="job-p", category=c)
               for c in CATEGORIES) == pytest.approx(110.0)
    spot = _value(metrics, "orchestrator_job_cost_dollars_total", job_id="job-p", accelerator="v4-8", tier="spot")
    assert spot == pytest.approx(lookup("v4-8").usd_per_hour("spot") * 47 / 3600)  # billed once out of the queue
    assert _value(metrics, "orchestrator_job_preemptions_total", job_id="job-p") == 1
    assert _value(metrics, "orchestrator_job_restarts_total", job_id="job-p") == 1


def test_each_scrape_reads_the_store_again(store):
    store.create_job("job-new", "new", {"accelerator": "v6e-4", "tier": "on-demand"}, at=T0)
    store.transition("job-new", JobState.PROVISIONING, "requesting", at=T0 + 1)
    server, port = serve_metrics(store, host="localhost")
    try:
        def scrape() -> str:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
                return resp.read().decode()
        assert 'orchestrator_job_state{job_id="job-new",state="PROVISIONING"} 1.0' in scrape()
        assert 'orchestrator_job_cost_dollars_total{accelerator="v6e-4",job_id="job-new",tier="on-demand"} 0.0' \
            in scrape()  # no slice yet: a zero for the spec's accelerator and tier, not a missing series
        store.record_steps("job-new", 1, [(0, 3.25, None, 0.5)], at=T0 + 2)
        assert 'orchestrator_job_loss{job_id="job-new"} 3.25' in scrape()
    finally:
        server.stop()


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "example.com"])
def test_serving_on_a_non_loopback_address_is_refused(store, host):
    with pytest.raises(RemoteMetricsRefused, match="allow_remote=True"):
        serve_metrics(store, host=host)


def test_stop_ends_the_serving_thread_and_frees_the_port(store):
    before = set(threading.enumerate())
    server, port = serve_metrics(store)
    assert server.serving
    server.stop()
    server.stop()  # idempotent
    assert not server.serving and set(threading.enumerate()) <= before
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_report_series_holds_what_the_picture_shows(store):
    s = report_series(store, "job-p")
    assert [iv.state for iv in s.states] == ["PENDING", "PROVISIONING", "STARTING", "RUNNING", "RECOVERING",
                                             "PROVISIONING", "STARTING", "RUNNING"]
    assert s.step == tuple(range(20)) and s.generation == (1,) * 8 + (2,) * 12
    assert s.loss[-1] == pytest.approx(5.0 / 20)
    assert [(m.kind, m.step, m.label) for m in s.markers] == [
        ("checkpoint", 8, "saved step 8"), ("preemption", 10, "preempted"), ("restore", 8, "restored step 8"),
        ("checkpoint", 16, "saved step 16")]
    assert [(sl.accelerator, sl.tier, sl.chips) for sl in s.slices] == [("v4-8", "spot", 4), ("v4-8", "on-demand", 4)]
    # The spot slice holds its chips once out of the queue (T0 + 16), the on-demand one from its request.
    chips = list(zip(s.chips_at, s.chips, strict=True))
    assert chips == [(T0, 0), (T0 + 16, 4), (T0 + 63, 0), (T0 + 64, 4), (T0 + 110, 0)]
    assert s.cost_usd[0] == 0 and s.cost_usd[-1] == pytest.approx(s.goodput.usd_total)
    assert list(s.cost_usd) == sorted(s.cost_usd)


def test_png_report_is_a_picture_of_sensible_size(store, tmp_path):
    path = write_report(store, "job-p", tmp_path / "job-p.png")
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and 30_000 < len(data) < 2_000_000
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk comes first
    assert (width, height) == (1100, 1600)


def test_html_report_embeds_the_picture_the_goodput_table_and_the_events(store, tmp_path):
    page = write_report(store, "job-p", tmp_path / "job-p.html").read_text()
    embedded = re.search(r'<img [^>]*src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert embedded and base64.b64decode(embedded.group(1))[:8] == PNG_SIGNATURE
    goodput_table = page[page.index('<table class="goodput">'):page.index("</table>")]
    assert re.search(r"<td>productive</td><td>30.0s</td><td>27.3%</td>", goodput_table)
    assert all(f"<td>{c.replace('_', ' ')}</td>" in goodput_table for c in CATEGORIES)
    assert "reclaimed (preemption 1 of at most 3)" in page and "restored step 8" in page
    training = page[page.index('<table class="training">'):]
    assert re.search(r"<td>tokens/s \(median\)</td><td>[\d,]+</td>", training)
    assert "http://" not in page and "https://" not in page  # self-contained: nothing fetched on opening


def test_a_job_without_steps_has_no_report(tmp_path):
    store = Store(tmp_path / "state.db")
    store.create_job("job-empty", "empty", {}, at=T0)
    with pytest.raises(ValueError, match="job-empty"):
        write_report(store, "job-empty", tmp_path / "r.png")
    with pytest.raises(NoStepsError):
        report_series(store, "job-empty")
    assert not (tmp_path / "r.png").exists()


def test_an_unknown_report_format_is_refused(store, tmp_path):
    with pytest.raises(ValueError, match=r"\.png or \.html"):
        write_report(store, "job-p", tmp_path / "r.pdf")
