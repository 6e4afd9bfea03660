"""The project's create pace (`orchestrator.providers.gcp.pace.CreatePace`): a burst at once, then one create
every 60 / per_minute seconds, in the order they came, for every provider of one project; and every queued
resource created through the TPU API client takes its turn first."""

from __future__ import annotations

import threading
import time

import pytest
from google.cloud import tpu_v2

from orchestrator.emulator import running_emulator
from orchestrator.providers.gcp.api import RetryPolicy, TpuApi, queued_resource
from orchestrator.providers.gcp.pace import CreatePace

pytestmark = pytest.mark.timeout(60)


class FakeTime:
    """A clock that moves only when told to (callers that arrive together: no sleep moves it)."""

    def __init__(self) -> None:
        self.now, self.slept = 0.0, []

    def clock(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.slept.append(s)


def test_a_burst_goes_at_once_and_the_rest_wait_their_turn_in_order():
    t = FakeTime()
    pace = CreatePace(60, burst=10, clock=t.clock, sleep=t.sleep)
    waits = [pace.wait() for _ in range(25)]  # 25 creates asked for at one instant (a mass reclaim)
    assert waits[:10] == [0.0] * 10
    assert waits[10:] == pytest.approx([float(k) for k in range(1, 16)])  # one a second, each after the last
    assert t.slept == pytest.approx(waits[10:])
    assert (pace.waits, pace.waited_s) == (15, pytest.approx(sum(range(1, 16))))


def test_the_bucket_refills_at_the_rate_and_never_past_the_burst():
    t = FakeTime()
    pace = CreatePace(30, burst=3, clock=t.clock, sleep=t.sleep)
    assert [pace.wait() for _ in range(3)] == [0.0, 0.0, 0.0]
    t.now += 4.0  # 2 creates' worth at 30 a minute
    assert [pace.wait() for _ in range(3)] == pytest.approx([0.0, 0.0, 2.0])
    t.now += 3600.0  # an idle hour refills 3, not 120
    assert [pace.wait() for _ in range(4)] == pytest.approx([0.0, 0.0, 0.0, 2.0])


def test_no_limit_never_waits_and_a_bad_rate_is_refused():
    pace = CreatePace(None, sleep=lambda s: pytest.fail(f"slept {s}"))
    assert [pace.wait() for _ in range(1000)] == [0.0] * 1000
    with pytest.raises(ValueError, match="creates per minute"):
        CreatePace(0)
    with pytest.raises(ValueError, match="burst"):
        CreatePace(60, burst=0)


def test_threads_together_are_held_to_the_rate():
    """20 creates from 4 threads at 600 a minute with a burst of 2: 18 of them one turn (0.1 s) after another,
    so the last cannot start before 1.8 s (a lower bound: a loaded machine only makes it later)."""
    pace = CreatePace(600, burst=2)
    starts: list[float] = []
    lock = threading.Lock()
    t0 = time.monotonic()

    def create_five() -> None:
        for _ in range(5):
            pace.wait()
            with lock:
                starts.append(time.monotonic() - t0)

    threads = [threading.Thread(target=create_five) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    starts.sort()
    assert len(starts) == 20
    assert starts[-1] >= 1.8 - 0.02, starts
    assert pace.waits == 18


def test_every_create_through_the_api_client_takes_its_turn():
    t = FakeTime()
    pace = CreatePace(60, burst=1, clock=t.clock, sleep=t.sleep)
    zone = "us-central2-b"
    with running_emulator(time_scale=0.002) as emu:
        api = TpuApi("p", endpoint=emu.url, credentials=None, impersonate=None, retry=RetryPolicy(),
                     request_timeout_s=5, sleep=time.sleep, pace=pace)
        for i in range(3):
            name = f"paced-{i}"
            api.create_queued_resource(zone, name, queued_resource(
                api.parent(zone), name, accelerator_type="v4-16", runtime_version="tpu-ubuntu2204-base",
                labels={}, startup_script="", service_account=None, tier={"spot": tpu_v2.QueuedResource.Spot()}))
        assert sorted(q.name.rsplit("/", 1)[-1] for q in api.client.list_queued_resources(parent=api.parent(zone))) \
            == ["paced-0", "paced-1", "paced-2"]
    assert t.slept == pytest.approx([1.0, 2.0])  # the first at once, then its turns (the fake clock stood still)


def test_a_cancelled_job_stops_waiting_its_turn_and_gives_the_turn_back():
    """A driver's thread gives up on its cancel (`providers.base.give_up_on`): a create waiting in the pace ends
    with `Abandoned` (nothing created) as soon as the job is cancelled, not after the turns before it."""
    from orchestrator.providers.base import Abandoned, CapacityError, give_up_on

    pace = CreatePace(60, burst=1)
    pace.wait()  # the burst: the next caller waits a second
    cancelled, ended = threading.Event(), {}

    def driver() -> None:
        give_up_on(cancelled)
        t0 = time.monotonic()
        try:
            pace.wait()
            ended["how"] = "created"
        except Abandoned as e:
            ended["how"], ended["error"] = "abandoned", e
        ended["after_s"] = time.monotonic() - t0

    thread = threading.Thread(target=driver)
    pace._tokens -= 30  # 30 turns reserved before it: it would wait about half a minute
    thread.start()
    time.sleep(0.2)
    cancelled.set()
    thread.join(timeout=5)
    assert ended["how"] == "abandoned" and ended["after_s"] < 3
    assert isinstance(ended["error"], CapacityError) and "nothing was created" in str(ended["error"])
    assert pace._tokens == pytest.approx(-30, abs=0.5)  # its turn went back: the next caller is no later for it
