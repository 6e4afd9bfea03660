"""A world for `JobDriver` without Ray: a real store and admission queue, a provider that hands out
slices at once, and worker groups that train a step per poll and checkpoint as orbax would.

What the driver decides runs as in production (its loop, `watch`, the recovery rules, limits, the
reports it records); only what needs hosts is scripted: a slice's hosts and its workers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from orchestrator import catalog
from orchestrator.cluster.home import Home
from orchestrator.control.autoscaler import Choice, Key
from orchestrator.control.job import loop
from orchestrator.control.job.driver import JobDriver
from orchestrator.control.queue import AdmissionQueue
from orchestrator.control.store_faults import HeldWrites, StoreHealth
from orchestrator.domain.spec import JobSpec
from orchestrator.providers.base import CapacityError, Host, Slice, SliceEvent, SliceEventKind, SliceRequest
from orchestrator.state.events import SliceChanged
from orchestrator.state.states import SliceState
from orchestrator.state.store import Store
from policies.cost.moves import Move
from policies.cost.slice_options import Option
from policies.cost.snapshot import Decision
from workers.protocol import Ending, Ready, Saved, StepDone, Timings, WorkerResult


class FakeProvider:
    """Slices that are READY as soon as asked for; events the test sends (`lose_host`, `notice`, ...)."""

    name = "local"
    max_hosts = 8

    def __init__(self, store: Store):
        self.store = store
        self.refuse: list[str] = []  # accelerators refused at once, one request each, in order
        self.waits = 0  # looks a new slice stays WAITING for capacity, then READY at the next one
        self.spot_slots: int | None = None  # spot slices that can be up at once; those asked for beyond wait
        self.slices: dict[str, Slice] = {}
        self.events: list[SliceEvent] = []
        self.lock = threading.Lock()

    def _put(self, s: Slice) -> Slice:
        self.slices[s.name] = s
        self.store.put_slice(s.name, s.job_id, s.provider, s.tpu_type.name, s.tier.value, s.state.value,
                             {"hosts": [h.resource for h in s.hosts]},
                             event=SliceChanged(s.name, s.tpu_type.name, s.tpu_type.chips, s.tier.value,
                                                s.state.value, s.tpu_type.usd_per_hour(s.tier)))
        return s

    def request(self, req: SliceRequest) -> Slice:
        if self.refuse and self.refuse[0] == req.tpu_type.name:
            self.refuse.pop(0)
            raise CapacityError(f"no {req.tpu_type.name} {req.tier.value} capacity now", slice_name=req.name)
        hosts = tuple(Host(i, f"{req.name}-w{i}") for i in range(req.tpu_type.hosts))
        self._put(Slice(req.name, req.job_id, req.tpu_type, req.tier, req.zone, SliceState.REQUESTED, provider="local"))
        if self.spot_slots is not None and req.tier.value == "spot" and self._spot_up() >= self.spot_slots:
            return self._put(Slice(req.name, req.job_id, req.tpu_type, req.tier, req.zone, SliceState.WAITING,
                                   provider="local"))
        if self.waits:
            self.looks_left = self.waits
            return self._put(Slice(req.name, req.job_id, req.tpu_type, req.tier, req.zone, SliceState.WAITING,
                                   provider="local"))
        return self._put(Slice(req.name, req.job_id, req.tpu_type, req.tier, req.zone, SliceState.READY, hosts,
                               "local"))

    def _spot_up(self) -> int:
        return sum(1 for s in self.slices.values() if s.tier.value == "spot" and s.state is SliceState.READY)

    def check(self, name: str) -> Slice:
        s = self.slices[name]
        if s.state is SliceState.WAITING and self.spot_slots is not None:
            if self._spot_up() < self.spot_slots:  # capacity came
                hosts = tuple(Host(i, f"{name}-w{i}") for i in range(s.tpu_type.hosts))
                return self._put(Slice(s.name, s.job_id, s.tpu_type, s.tier, s.zone, SliceState.READY, hosts, "local"))
            return s
        if s.state is SliceState.WAITING:
            self.looks_left -= 1
            if self.looks_left < 0:  # capacity came and the hosts joined between two looks
                hosts = tuple(Host(i, f"{name}-w{i}") for i in range(s.tpu_type.hosts))
                self._put(Slice(s.name, s.job_id, s.tpu_type, s.tier, s.zone, SliceState.PROVISIONING, (), "local"))
                return self._put(Slice(s.name, s.job_id, s.tpu_type, s.tier, s.zone, SliceState.READY, hosts, "local"))
        return s

    def wait_ready(self, name: str, *, timeout_s: float) -> Slice:
        return self.slices[name]

    def get(self, name: str) -> Slice:
        return self.slices[name]

    def release(self, name: str) -> None:
        s = self.slices.get(name)
        if s is not None and not s.state.terminal:
            self._put(Slice(s.name, s.job_id, s.tpu_type, s.tier, s.zone, SliceState.RELEASED, s.hosts, s.provider))

    def list(self, *, job_id: str | None = None) -> list[Slice]:
        return [s for s in self.slices.values() if job_id is None or s.job_id == job_id]

    def poll_events(self, *, slices=None) -> list[SliceEvent]:
        with self.lock:
            mine = [e for e in self.events if slices is None or e.slice_name in slices]
            self.events = [e for e in self.events if e not in mine]
        return mine

    def hosts_in_use(self) -> int:
        return sum(s.tpu_type.hosts for s in self.slices.values() if s.state is SliceState.READY)

    def send(self, slice_name: str, kind: SliceEventKind, reason: str) -> None:
        with self.lock:
            self.events.append(SliceEvent(slice_name, kind, reason))


class World:
    """What the driver's controller holds, with the fakes in place of hosts; `run` drives one job."""

    def __init__(self, root: Path):
        self.home = Home(root).ensure()
        self.store = Store(self.home.db)
        self.store_health = StoreHealth()
        self.held = HeldWrites(self.store_health, self.store.batch)
        self.provider = FakeProvider(self.store)
        self.queue = AdmissionQueue(self.store, self.provider)
        self.groups: list[ScriptedGroup] = []
        self.committed: int | None = None  # the newest checkpoint the job's workers committed (orbax's latest step)
        self.lost_memory: set[str] = set()  # slices whose hosts' memory is gone
        self.on_step: Callable[[ScriptedGroup, int], None] = lambda group, step: None  # the test's hand in the run

    def provider_for(self, spec: JobSpec) -> FakeProvider:
        return self.provider

    def submit(self, spec: dict, job_id: str = "job", *, policy: ScriptedPolicy | None = None) -> JobDriver:
        """The job's driver; `policy`: a scripted cost policy in place of the real one."""
        parsed = JobSpec.from_dict(spec).with_checkpoint_directory(str(self.home.root / "ckpt"))
        self.store.create_job(job_id, parsed.name, parsed.model_dump(mode="json"))
        return JobDriver(self, job_id, groups=self.group_for, policy=policy)

    def group_for(self, driver: JobDriver, spec: JobSpec) -> ScriptedGroup:
        group = ScriptedGroup(self, driver, spec)
        self.groups.append(group)
        return group

    def run(self, driver: JobDriver, timeout_s: float = 30.0) -> None:
        """Drive the job to its end (the driver's own thread), or fail the test after `timeout_s`."""
        done = threading.Event()
        loop.start(driver, lambda job_id: done.set())
        if not done.wait(timeout_s):
            driver.cancel()
            raise AssertionError(f"the driver did not end within {timeout_s} s")


class ScriptedGroup:
    """A slice's workers: restore the newest committed step, then one step a poll, saving every interval;
    asked to stop, they stop after the next step with its checkpoint committed, as the real loop does."""

    def __init__(self, world: World, driver: JobDriver, spec: JobSpec):
        self.world, self.driver, self.spec = world, driver, spec
        launch = driver.launched
        assert launch is not None, "a group is made for a launch"
        self.generation = launch.generation
        self.slices = [s.name for s in launch.slices]
        self.hosts = launch.hosts
        self.slice_name = launch.first.name
        self.memory_step = launch.memory_step  # restore from the survivors' memory, not storage
        self.step = -1  # the last step done
        self.stop_reason: str | None = None
        self.stopped = False
        self.ended: list[WorkerResult] | None = None

    def report(self, report) -> None:
        self.driver.report(self.generation, 0, report, [])

    def launch(self):
        restored, source = self.world.committed, "storage"
        if self.memory_step is not None:
            restored, source = self.memory_step, "memory"
        self.step = restored - 1 if restored is not None else -1
        self.report(Ready(init_s=0.1))
        self.report(Timings(restore_s=0.1, compile_s=0.0, restored_step=restored, source=source))
        return None

    def results(self, timeout_s: float):
        if self.ended is not None:
            return self.ended
        total = self.spec.workload.steps
        self.step += 1
        self.report(StepDone(self.step, loss=1.0 / (self.step + 1), step_time_s=0.01))
        done = self.step + 1
        if done % self.spec.checkpoint.interval_steps == 0 or done == total or self.stop_reason:
            self.world.committed = done
            self.report(Saved(done))
        self.world.on_step(self, self.step)
        if self.stop_reason:
            self.ended = [WorkerResult(Ending.STOPPED, r, steps=done, notice=self.stop_reason)
                          for r in range(self.hosts)]
        elif done == total:
            self.ended = [WorkerResult(Ending.SUCCEEDED, r, steps=done) for r in range(self.hosts)]
        return None

    def request_stop(self, reason: str) -> None:
        self.stop_reason = reason

    def ping(self):
        return None, []

    def silent_host(self):
        return None  # no host goes silently in these tests

    def died(self, error):
        raise AssertionError("no worker dies alone in these tests")

    def history(self):
        return []

    def held_step(self, slices, expect=None):
        """Every host keeps every step in memory; a lost slice's memory went with it."""
        gone = [s.name for s in slices if s.name in self.world.lost_memory]
        return (None, f"{gone[0]} holds no copy") if gone else (self.step + 1, "")

    def request_profile(self, request) -> None:
        raise AssertionError("no profile is asked for in these tests")

    def stop(self) -> None:
        self.stopped = True


class ScriptedPolicy:
    """A cost policy that answers what the test's `decide(spec, current, waiting=..., ready=...)` says
    (set once the test has the driver its script reads)."""

    def __init__(self) -> None:
        self.decide: Callable[..., Choice] | None = None

    def choose(self, spec: JobSpec, current: Key | None, *, waiting: Key | None, ready: bool) -> Choice:
        assert self.decide is not None, "the test sets its script before the driver runs"
        return self.decide(spec, current, waiting=waiting, ready=ready)


def spec(**extra) -> dict:
    return {"name": "job", "accelerator": "v4-16", "tier": "spot",
            "workload": {"type": "lm", "steps": 20, "model": {"d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64},
                         "seq_len": 16, "global_batch_size": 16},
            "checkpoint": {"interval_steps": 5}, **extra}


def choice(move: Move | None, accelerator: str | None, count: int = 1) -> Choice:
    """A scripted policy's answer: run `count` x `accelerator` spot (None: none) by way of `move`."""
    decision = Decision(option=None, reason="scripted", expected_cost_usd=1.0, expected_finish_s=0.0)
    return Choice(accelerator, "spot" if accelerator else None, decision, None, move, count)


def option(name: str, count: int = 1) -> Option:
    """`count` spot slices of `name`, as the policy names them in a move."""
    t = catalog.lookup(name)
    return Option(name, count * t.chips, count * t.hosts, "spot", count * t.usd_per_hour(catalog.Tier.SPOT),
                  count * 1000.0, count=count)


def lose_the_second_slice_after_step_7(world: World) -> None:
    """Generation 1 of a two-slice job loses a host of its second slice after steps 0-7."""
    def lose_a_slice(group, step):
        if group.generation == 1 and step == 7:
            world.provider.send(group.slices[1], SliceEventKind.HOST_LOST, "host 1 of the second slice vanished")

    world.on_step = lose_a_slice
