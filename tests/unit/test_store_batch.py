"""Many writes in one transaction: `Store.batch`, and the controller's writer thread (`HeldWrites`) that uses it.

A batch commits every write made in it or none; a write refused by its own checks (a transition its state does
not allow) fails alone and the rest are kept; the step rows of a batch are read back inside it. The writer keeps
the order writes were asked in, answers each waiting caller with its own result or error, and writes a queue
that built up while it was busy in one transaction."""

from __future__ import annotations

import sqlite3
import threading

import pytest

from orchestrator.control.store_faults import HeldWrites, HoldingStore, StoreHealth
from orchestrator.errors import IllegalTransitionError
from orchestrator.state.batch import BatchSpoiled
from orchestrator.state.states import JobState
from orchestrator.state.store import Store


@pytest.fixture
def store(tmp_path) -> Store:
    s = Store(tmp_path / "state.db")
    s.create_job("j1", "j", {})
    return s


def test_a_batch_is_one_transaction_and_its_step_rows_are_read_back_inside_it(store, tmp_path):
    other = Store(tmp_path / "state.db")  # another connection: sees only what is committed
    with store.batch():
        store.transition("j1", JobState.PROVISIONING, "asking")
        store.record_steps("j1", 1, [(0, 2.5, None, None), (1, 2.0, None, None)])
        store.record_steps("j1", 2, [(1, 1.9, None, None)])  # step 1 again: the newest generation's stays
        assert [m.loss for m in store.steps("j1")] == [2.5, 1.9]
        assert store.last_step("j1").step == 1
        assert other.job("j1").state is JobState.PENDING and other.steps("j1") == []
    assert other.job("j1").state is JobState.PROVISIONING
    assert [(m.step, m.generation, m.loss) for m in other.steps("j1")] == [(0, 1, 2.5), (1, 2, 1.9)]
    rows, after = other.steps_written_after("j1")
    assert len(rows) == 2 and after > 0


def test_a_write_refused_by_its_own_checks_fails_alone_and_one_that_failed_after_writing_spoils_the_batch(store):
    with store.batch():
        with pytest.raises(IllegalTransitionError):
            store.transition("j1", JobState.RUNNING, "not from PENDING")
        store.update_job("j1", reason="kept")
    assert store.job("j1").reason == "kept"

    with pytest.raises(BatchSpoiled):
        with store.batch():
            store.update_job("j1", reason="lost with the batch")
            try:
                store.transition("j1", JobState.PROVISIONING, "asking", no_such_field=1)  # a bug of ours, caught
            except ValueError:
                pass
    assert store.job("j1").reason == "kept" and store.job("j1").state is JobState.PENDING


def test_the_writer_keeps_the_order_answers_each_caller_and_writes_a_queue_in_one_transaction(store):
    batches = []
    opened = store.batch

    def counted():
        batches.append(threading.current_thread().name)
        return opened()

    held = HeldWrites(StoreHealth(), counted)
    writer_busy, go_on = threading.Event(), threading.Event()

    def slow() -> None:  # holds the writer while a queue builds up behind it
        writer_busy.set()
        go_on.wait(10)
        store.record_steps("j1", 1, [(0, 3.0, None, None)])

    held.add(slow)
    assert writer_busy.wait(10)
    for step in range(1, 50):
        held.add(lambda step=step: store.record_steps("j1", 1, [(step, 3.0 - step / 100, None, None)]))
    driver = HoldingStore(store, StoreHealth(), held)
    answers: list[object] = []
    refused: list[Exception] = []

    def drive() -> None:
        answers.append(driver.transition("j1", JobState.PROVISIONING, "asking").state)
        try:
            driver.transition("j1", JobState.SUCCEEDED, "not allowed from PROVISIONING")
        except IllegalTransitionError as e:
            refused.append(e)
        answers.append(driver.bump_generation("j1"))

    thread = threading.Thread(target=drive)
    thread.start()
    go_on.set()
    thread.join(20)
    assert not thread.is_alive()
    held.flush()

    assert answers == [JobState.PROVISIONING, 1] and len(refused) == 1
    assert [m.step for m in store.steps("j1")] == list(range(50))  # every report, none lost or twice
    # The first write alone, then the 49 queued reports and the driver's first write together, and so on:
    # far fewer transactions than writes.
    assert 2 <= len(batches) <= 6, batches
    assert set(batches) == {"store-writer"}


def test_the_writer_thread_ends_when_idle_and_starts_again(store):
    held = HeldWrites(StoreHealth(), store.batch, idle_s=0.05)
    writers = []
    held.add(lambda: (writers.append(threading.current_thread()), store.update_job("j1", reason="first")))
    held.flush()
    writers[0].join(5)
    assert not writers[0].is_alive()  # no thread is left behind by a controller that stopped writing
    held.add(lambda: (writers.append(threading.current_thread()), store.update_job("j1", reason="second")))
    held.flush()
    assert store.job("j1").reason == "second" and writers[1] is not writers[0]


def test_a_transaction_that_fails_for_another_reason_than_the_disk_fails_its_write_and_the_writer_goes_on(store):
    # SQLite's own errors (its lock held past its timeout, say) are not the file system's: the write fails with
    # the error, as it did in its own transaction before, and the writes after it are written.
    failures = iter([sqlite3.OperationalError("database is locked")])

    def flaky():
        if (e := next(failures, None)) is not None:
            raise e
        return store.batch()

    held = HeldWrites(StoreHealth(), flaky)
    with pytest.raises(sqlite3.OperationalError, match="locked"):
        held.write(lambda: store.update_job("j1", reason="lost"))
    held.write(lambda: store.update_job("j1", reason="written"))
    assert store.job("j1").reason == "written"
