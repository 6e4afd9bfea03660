"""A state store that cannot be written: on a real small file system filled up, on a read-only file, and
on a file deleted or replaced under the running store. Each fault is named with its cause, nothing of the
refused write is kept, and the same write goes through once the fault is gone."""

from __future__ import annotations

import logging
import os
import subprocess
import threading
from pathlib import Path

import pytest

from orchestrator.control.store_faults import HeldWrites, HoldingStore, StoreHealth
from orchestrator.errors import StoreFaultError
from orchestrator.observe.metrics import read_store_fault, serve_metrics
from orchestrator.state.states import JobState
from orchestrator.state.store import Store
from tests.waiting import wait_for


@pytest.fixture
def small_disk(tmp_path) -> Path:
    """A 1 MiB file system of its own (tmpfs), unmounted afterwards."""
    disk = tmp_path / "disk"
    disk.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True, text=True)
    if r.returncode != 0:
        # Mounting needs root (CAP_SYS_ADMIN). CI and this project's machines run as root, so there the test
        # runs; a user without it cannot make the small disk the test is about, and the skip says why.
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=True)


def fill(disk: Path) -> Path:
    """Fill `disk` up to its last byte; returns the file to remove to free it."""
    filler = disk / "filler"
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass
    return filler


def make_read_only(path: Path, read_only: bool = True) -> None:
    """chmod, and for root (whom modes do not stop) the immutable attribute as well."""
    if read_only:
        os.chmod(path, 0o444)
    if os.geteuid() == 0:
        subprocess.run(["chattr", "+i" if read_only else "-i", str(path)], check=True)
    if not read_only:
        os.chmod(path, 0o644)


def test_a_full_disk_refuses_the_write_and_takes_it_again_once_freed(small_disk):
    store = Store(small_disk / "state.db")
    store.create_job("j1", "j", {})
    filler = fill(small_disk)
    with pytest.raises(StoreFaultError) as refused:
        store.transition("j1", JobState.PROVISIONING, "asking")
    assert refused.value.cause == "disk full"
    assert str(refused.value).startswith("state store not writable: disk full (")
    assert store.job("j1").state is JobState.PENDING  # still readable, nothing of the write kept

    filler.unlink()
    store.transition("j1", JobState.PROVISIONING, "asking")  # the same connection, not stuck in its transaction
    assert [e.to_state for e in store.events("j1")] == ["PENDING", "PROVISIONING"]


def test_a_read_only_file_refuses_writes_and_still_reads(tmp_path):
    store = Store(tmp_path / "state.db")
    store.create_job("j1", "j", {})
    make_read_only(store.path)
    try:
        with pytest.raises(StoreFaultError) as refused:
            store.update_job("j1", reason="x")
        assert refused.value.cause == "read-only"
        assert "state store not writable: read-only" in str(refused.value)
        assert Store(store.path).job("j1").state is JobState.PENDING  # `status` opens it as a reader
    finally:
        make_read_only(store.path, False)
    store.update_job("j1", reason="x")
    assert store.job("j1").reason == "x"


def test_a_deleted_or_replaced_file_is_named_so_and_the_original_put_back_works_again(tmp_path):
    store = Store(tmp_path / "state.db")
    store.create_job("j1", "j", {})
    aside = tmp_path / "aside.db"
    os.rename(store.path, aside)  # gone from its path (as `rm` would), and still open here
    with pytest.raises(StoreFaultError, match="not writable: deleted") as refused:
        store.update_job("j1", reason="lost")
    assert refused.value.cause == "deleted"
    other = Store(tmp_path / "other" / "state.db")  # another store (an old copy) moved to the path
    os.rename(other.path, store.path)
    with pytest.raises(StoreFaultError, match="not writable: replaced"):
        store.create_job("j2", "j", {})
    os.replace(aside, store.path)
    store.update_job("j1", reason="found")
    assert Store(store.path).job("j1").reason == "found"


def full_disk(store: Store):
    filler = fill(store.path.parent)
    return filler.unlink


def read_only_file(store: Store):
    make_read_only(store.path)
    return lambda: make_read_only(store.path, False)


@pytest.mark.parametrize("fault, cause", [(full_disk, "disk full"), (read_only_file, "read-only")])
def test_a_driver_write_holds_through_the_fault_which_is_exported_and_goes_on_by_itself(small_disk, caplog, fault,
                                                                                         cause):
    raw = Store(small_disk / "state.db")
    raw.create_job("j1", "j", {})
    health = StoreHealth()
    held = HeldWrites(health, raw.batch)
    store = HoldingStore(raw, health, held)
    server, port = serve_metrics(raw, store_health=health)
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        assert read_store_fault(url) is None
        undo = fault(raw)
        caplog.set_level(logging.ERROR, logger="orchestrator.control.store_faults")
        held.add(lambda: raw.record_steps("j1", 1, [(0, 2.5, None, None)]))  # a worker's report: does not wait
        seen = wait_for(lambda: read_store_fault(url), 10, "the fault in the metrics", poll_s=0.1)
        assert seen["cause"] == cause and seen["held"] == 1
        assert seen["message"].startswith(f"state store not writable: {cause}")
        refusals = []  # each refused try of the writes, the driver's with the report, is told to the health
        tell = health.failed
        health.failed = lambda e: (refusals.append(e), tell(e))
        driver = threading.Thread(target=store.transition, args=("j1", JobState.PROVISIONING, "asking"),
                                  name="driver")
        driver.start()
        wait_for(lambda: health.held == 2, 10, "the driver's write held behind the report")
        wait_for(lambda: len(refusals) >= 2, 20, "the writes refused twice more (tried again)")
        assert driver.is_alive()  # the driver holds where it is
        assert len([r for r in caplog.records if "not writable" in r.getMessage()]) == 1  # logged once, not per try

        undo()
        driver.join(timeout=15)
        assert not driver.is_alive(), "the driver did not pick up by itself"
        assert read_store_fault(url) is None
        assert raw.job("j1").state is JobState.PROVISIONING
        assert [m.loss for m in raw.steps("j1")] == [2.5]  # the held report, written first
    finally:
        server.stop()


def test_the_content_of_a_deleted_store_can_still_be_copied_out(tmp_path):
    store = Store(tmp_path / "state.db")
    store.create_job("j1", "j", {})
    store.record_steps("j1", 1, [(0, 2.5, None, None)])
    store.path.unlink()  # the WAL beside it is left, as `rm state.db` leaves it
    store.copy_to(tmp_path / "state.db.rescued")
    rescued = Store(tmp_path / "state.db.rescued")
    assert rescued.job("j1").state is JobState.PENDING and [m.loss for m in rescued.steps("j1")] == [2.5]


def test_the_controllers_log_on_a_full_disk_prints_no_traceback_per_line_and_keeps_the_lines(small_disk, capfd):
    from orchestrator.control.controller import _LogFile

    handler = _LogFile(small_disk / "controller.log")
    logger = logging.getLogger("tests.full-disk-log")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        filler = fill(small_disk)
        for i in range(50):
            logger.error("line %d", i)
        assert capfd.readouterr().err == ""  # logging's default: a traceback for each line
        filler.unlink()
        logger.error("after")
        assert (small_disk / "controller.log").read_text().splitlines() == [*(f"line {i}" for i in range(50)), "after"]
    finally:
        logger.removeHandler(handler)
        handler.close()


def test_a_fault_that_comes_and_goes_is_said_once_not_each_time(caplog):
    told = []
    health = StoreHealth(on_change=lambda line, ended: told.append(line))
    caplog.set_level(logging.INFO, logger="orchestrator.control.store_faults")
    e = StoreFaultError("/h/state.db", "disk full", "database or disk is full")
    for _ in range(100):  # a disk all but full: one write taken, the next refused
        health.failed(e)
        assert health.fault.cause == "disk full"
        health.worked()
    assert health.fault is None
    assert len(caplog.records) == 2 and len(told) == 2  # its beginning and its end, once each
    health.failed(StoreFaultError("/h/state.db", "read-only", "permission to write the file is denied"))
    assert len(told) == 3 and "read-only" in told[-1]  # another cause is news
