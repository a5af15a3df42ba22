"""The cross-process KV-cache lock: exclusion, release on error, misuse, dead-holder recovery.

Every test uses real processes (spawn), a real POSIX semaphore and real shared memory under a
fresh instance id; fixtures kill leftover children and remove every /dev/shm entry.
"""
from __future__ import annotations

import fcntl
import logging
import multiprocessing
import os
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path
from typing import Iterator

import numpy as np
import posix_ipc
import pytest

from inter_communicator.kvcache_lock import (
    FAULT_POINTS,
    KVCacheLock,
    KVCacheLockError,
    KVCacheLockTimeout,
    NullKVCacheLock,
    kvcache_lock_for,
)
from inter_communicator.process_utils import ProcUnreadableError, pid_start_time, process_alive
from inter_communicator.shm import SharedArray, ipc_name, sweep_stale, unlink_created

REPO_ROOT = Path(__file__).resolve().parent.parent
SHM_DIR = Path("/dev/shm")
SPAWN = multiprocessing.get_context("spawn")
JOIN_SECONDS = 60.0
# Generous: the CI machine has 2 cores shared with other jobs.
MARGIN_SECONDS = 4.0
CRITICAL_SECTION_SLEEP = 0.0005
LOCK_LOGGER = "inter_communicator.kvcache_lock"


@pytest.fixture
def instance_id() -> Iterator[str]:
    """A fresh instance id; whatever a test leaves under it is removed afterwards."""
    iid = f"test-{uuid.uuid4().hex[:12]}"
    try:
        yield iid
    finally:
        unlink_created()
        sweep_stale(iid)


@pytest.fixture
def procs() -> Iterator[list[multiprocessing.process.BaseProcess]]:
    """Children started by a test; any still alive at the end (failure paths) are killed."""
    started: list[multiprocessing.process.BaseProcess] = []
    try:
        yield started
    finally:
        for proc in started:
            if proc.is_alive():
                proc.kill()
            proc.join(JOIN_SECONDS)


def start(procs: list, target, *args) -> multiprocessing.process.BaseProcess:
    proc = SPAWN.Process(target=target, args=args, daemon=True)
    proc.start()
    procs.append(proc)
    return proc


def join_ok(proc: multiprocessing.process.BaseProcess) -> None:
    proc.join(JOIN_SECONDS)
    if proc.is_alive():
        raise AssertionError(f"child {proc.pid} did not finish within {JOIN_SECONDS}s")
    assert proc.exitcode == 0, f"child {proc.pid} exited with {proc.exitcode}"


def counter_name(iid: str) -> str:
    return ipc_name(iid, "test_counter")


def entries_of(iid: str) -> set[str]:
    return {p.name for p in SHM_DIR.iterdir() if p.name.startswith((f"fd.{iid}.", f"sem.fd.{iid}."))}


# --- children (module level: spawn imports them by name) ----------------------------------------


def _child_count(iid: str, iterations: int, enabled: bool, timeout: float, ready, go) -> None:
    """Read-sleep-write a shared counter ``iterations`` times, each under ``hold``.

    Signals ``ready`` once attached, then starts on ``go``, so all children run at once.
    """
    lock = kvcache_lock_for(iid, 0, "test", enabled=enabled, timeout=timeout)
    counter = SharedArray(counter_name(iid), 1, np.int64, create=False)
    ready.set()
    if not go.wait(JOIN_SECONDS):
        raise SystemExit(4)
    for _ in range(iterations):
        with lock.hold("count"):
            value = int(counter.array[0])
            time.sleep(CRITICAL_SECTION_SLEEP)  # invites the other processes in, if nothing keeps them out
            counter.array[0] = value + 1
    counter.close()
    lock.close()


def _child_hold_forever(iid: str, holding) -> None:
    lock = KVCacheLock.attach(iid, 0, "worker")
    with lock.hold("execute_model"):
        holding.set()
        time.sleep(JOIN_SECONDS)


def _child_hold_for(iid: str, seconds: float, holding) -> None:
    lock = KVCacheLock.attach(iid, 0, "cache_transfer")
    with lock.hold("swap_out"):
        holding.set()
        time.sleep(seconds)
    lock.close()


def _child_take_semaphore_and_die(name: str) -> None:
    """Die after sem_wait, before any owner record: the window a claim cannot close."""
    posix_ipc.Semaphore("/" + name).acquire()
    os._exit(0)


def _child_acquire_within(iid: str, seconds: float) -> None:
    lock = KVCacheLock.attach(iid, 0, "test")
    if not lock.acquire(timeout=seconds, what="after-error"):
        raise SystemExit(3)
    lock.release()
    lock.close()


def _child_report_stats(iid: str, queue) -> None:
    lock = kvcache_lock_for(iid, 0, "metrics", enabled=True)
    queue.put(lock.stats())
    lock.close()


def _child_release_without_holding(iid: str, queue) -> None:
    lock = KVCacheLock.attach(iid, 0, "test")
    try:
        lock.release()
    except KVCacheLockError as exc:
        queue.put(str(exc))
    else:
        queue.put(None)
    lock.close()


def _child_cycles_with_fault(iid: str, spec: str, cycles: int, timeout: float, about_to_wait=None) -> None:
    """Hold/release ``cycles`` times with FD_KVCACHE_LOCK_FAULT=``spec`` armed; exit 5 if it never fired.

    With ``about_to_wait``, signal it right before the first acquire (the test holds the lock, so
    that acquire blocks in sem_wait and the slow path is the one that passes the fault point).
    """
    os.environ["FD_KVCACHE_LOCK_FAULT"] = spec  # read when the handle is built (envs.py)
    lock = KVCacheLock.attach(iid, 0, "worker", timeout=timeout)
    if about_to_wait is not None:
        about_to_wait.set()
    for _ in range(cycles):
        with lock.hold("execute_model"):
            time.sleep(CRITICAL_SECTION_SLEEP)
    lock.close()
    if lock._fault.passes < lock._fault.nth:
        raise SystemExit(5)


# --- mutual exclusion ---------------------------------------------------------------------------


def run_counters(iid: str, procs: list, num_procs: int, iterations: int, enabled: bool) -> int:
    with SharedArray(counter_name(iid), 1, np.int64, create=True) as counter:
        go, ready = SPAWN.Event(), [SPAWN.Event() for _ in range(num_procs)]
        children = [start(procs, _child_count, iid, iterations, enabled, 5.0, event, go) for event in ready]
        assert all(event.wait(JOIN_SECONDS) for event in ready)
        go.set()
        for child in children:
            join_ok(child)
        return int(counter.array[0])


@pytest.mark.integration
def test_hold_excludes_other_processes(instance_id: str, procs: list) -> None:
    lock = KVCacheLock.create(instance_id, 0, role="test")
    num_procs, iterations = 3, 40
    assert run_counters(instance_id, procs, num_procs, iterations, enabled=True) == num_procs * iterations
    stats = lock.stats()
    assert stats["acquisitions"] == num_procs * iterations
    assert stats["contended"] > 0, "the children never overlapped, so exclusion was not exercised"
    assert stats["semaphore_value"] == 1 and not stats["held"]
    assert stats["hold_ns_total"] >= num_procs * iterations * CRITICAL_SECTION_SLEEP * 1e9
    assert stats["max_wait_ns"] > 0 and stats["recoveries"] == 0


@pytest.mark.integration
def test_same_workload_without_the_lock_loses_updates(instance_id: str, procs: list) -> None:
    """The counter test can fail: with the null lock, concurrent read-sleep-write loses increments."""
    num_procs, iterations = 2, 40
    totals = []
    for _attempt in range(3):
        totals.append(run_counters(instance_id, procs, num_procs, iterations, enabled=False))
        if totals[-1] < num_procs * iterations:
            break
    assert min(totals) < num_procs * iterations, f"no update was lost in {len(totals)} attempts: {totals}"


def test_null_lock_interface() -> None:
    null = kvcache_lock_for("unused", 0, "worker", enabled=False)
    assert isinstance(null, NullKVCacheLock) and not null.enabled
    with null.hold("execute_model"):
        with null.hold("nested is fine: nothing is held"):
            pass
    assert null.acquire(timeout=0) is True
    null.release()
    assert null.stats()["enabled"] is False and null.stats()["acquisitions"] == 0
    with pytest.raises(ValueError, match="role"):
        kvcache_lock_for("unused", 0, "no-such-role", enabled=False)


def test_kvcache_lock_for_follows_the_environment(instance_id: str, monkeypatch: pytest.MonkeyPatch) -> None:
    creator = KVCacheLock.create(instance_id, 0)
    monkeypatch.setenv("FD_USE_KVCACHE_LOCK", "1")
    monkeypatch.setenv("FD_KVCACHE_LOCK_TIMEOUT", "2.5")
    lock = kvcache_lock_for(instance_id, 0, "worker")
    assert isinstance(lock, KVCacheLock) and lock.timeout == 2.5
    with lock.hold("execute_model"):
        assert creator.stats()["owner_role"] == "worker"
    monkeypatch.setenv("FD_USE_KVCACHE_LOCK", "0")
    assert isinstance(kvcache_lock_for(instance_id, 0, "worker"), NullKVCacheLock)
    lock.close()


# --- release on every exit path -----------------------------------------------------------------


@pytest.mark.integration
def test_exception_inside_hold_releases_and_propagates(instance_id: str, procs: list) -> None:
    lock = KVCacheLock.create(instance_id, 0, role="test")
    with pytest.raises(ZeroDivisionError):
        with lock.hold("execute_model"):
            1 / 0
    assert not lock.stats()["held"]
    join_ok(start(procs, _child_acquire_within, instance_id, 10.0))
    assert lock.stats()["acquisitions"] == 2


@pytest.mark.integration
def test_hold_timeout_raises_while_another_process_holds(instance_id: str, procs: list) -> None:
    lock = KVCacheLock.create(instance_id, 0, role="test", timeout=5.0)
    holding = SPAWN.Event()
    holder = start(procs, _child_hold_for, instance_id, 1.5, holding)
    assert holding.wait(JOIN_SECONDS)
    begin = time.monotonic()
    with pytest.raises(KVCacheLockTimeout):
        with lock.hold("prefetch", timeout=0.2):
            pass
    assert 0.15 < time.monotonic() - begin < MARGIN_SECONDS
    assert lock.acquire(timeout=0) is False
    join_ok(holder)
    assert lock.acquire(timeout=0) is True
    lock.release()


# --- misuse -------------------------------------------------------------------------------------


@pytest.mark.integration
def test_misuse_raises(instance_id: str, procs: list) -> None:
    lock = KVCacheLock.create(instance_id, 0, role="test", timeout=1.0)
    with pytest.raises(KVCacheLockError, match="does not hold"):
        lock.release()
    with lock.hold("outer"):
        with pytest.raises(KVCacheLockError, match="re-entrant"):
            lock.acquire()
        second = KVCacheLock.attach(instance_id, 0, "test", timeout=1.0)
        with pytest.raises(KVCacheLockError, match="another handle"):
            with second.hold("inner through a second handle"):
                pass
        errors: list[str] = []

        def release_from_other_thread() -> None:
            try:
                lock.release()
            except KVCacheLockError as exc:
                errors.append(str(exc))

        thread = threading.Thread(target=release_from_other_thread)
        thread.start()
        thread.join()
        assert len(errors) == 1 and "must release" in errors[0]
        queue = SPAWN.Queue()
        join_ok(start(procs, _child_release_without_holding, instance_id, queue))
        assert "does not hold" in (queue.get(timeout=JOIN_SECONDS) or "")
        assert lock.stats()["held"], "a failed release must leave the lock held"
    second.close()
    with pytest.raises(KVCacheLockError, match="after close"):
        second.acquire()
    with pytest.raises(KVCacheLockError, match="after close"):
        with second.hold("closed"):
            pass
    assert lock.stats()["semaphore_value"] == 1


MISUSE_SCRIPT = textwrap.dedent(
    """
    import sys, threading
    sys.path.insert(0, sys.argv[1])
    from inter_communicator.kvcache_lock import KVCacheLock, KVCacheLockError
    if sys.flags.optimize < 1:
        sys.exit("expected to run under python -O")
    fired = []

    def expect(label, call):
        try:
            call()
        except KVCacheLockError:
            fired.append(label)

    lock = KVCacheLock.create(sys.argv[2], 0, role="test", timeout=1.0)
    try:
        expect("release-unheld", lock.release)
        lock.acquire()
        expect("reentrant", lock.acquire)
        thread = threading.Thread(target=expect, args=("release-other-thread", lock.release))
        thread.start()
        thread.join()
        lock.release()
        second = KVCacheLock.attach(sys.argv[2], 0, "test")
        second.close()
        expect("use-after-close", second.acquire)
        expect("no-proc", lambda: KVCacheLock.attach(sys.argv[2], 0, "test", proc_root="/nonexistent-proc"))
    finally:
        lock.close()
        lock.unlink()
    print(",".join(fired))
    """
)


@pytest.mark.integration
def test_misuse_raises_under_python_dash_o(instance_id: str) -> None:
    result = subprocess.run([sys.executable, "-O", "-c", MISUSE_SCRIPT, str(REPO_ROOT), instance_id],
                            capture_output=True, text=True, timeout=JOIN_SECONDS)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "release-unheld,reentrant,release-other-thread,use-after-close,no-proc"
    assert entries_of(instance_id) == set()


# --- dead holders -------------------------------------------------------------------------------


@pytest.mark.integration
def test_killed_holder_is_recovered_by_a_waiter(instance_id: str, procs: list,
                                                caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOCK_LOGGER)
    timeout = 1.0
    lock = KVCacheLock.create(instance_id, 0, role="test", timeout=timeout)
    holding = SPAWN.Event()
    holder = start(procs, _child_hold_forever, instance_id, holding)
    assert holding.wait(JOIN_SECONDS)
    assert lock.stats()["owner_pid"] == holder.pid
    os.kill(holder.pid, signal.SIGKILL)
    holder.join(JOIN_SECONDS)
    begin = time.monotonic()
    with lock.hold("swap_in"):
        elapsed = time.monotonic() - begin
        stats = lock.stats()
        assert stats["owner_pid"] == os.getpid() and stats["semaphore_value"] == 0
    assert timeout * 0.9 <= elapsed < timeout + MARGIN_SECONDS
    stats = lock.stats()
    assert stats["recoveries"] == 1 and stats["semaphore_value"] == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(f"pid {holder.pid} (worker) is dead" in message for message in warnings), warnings


@pytest.mark.integration
def test_two_waiters_and_a_dead_holder_recover_once(instance_id: str, procs: list) -> None:
    timeout, iterations = 1.5, 30
    lock = KVCacheLock.create(instance_id, 0, role="test", timeout=timeout)
    with SharedArray(counter_name(instance_id), 1, np.int64, create=True) as counter:
        holding, go = SPAWN.Event(), SPAWN.Event()
        holder = start(procs, _child_hold_forever, instance_id, holding)
        assert holding.wait(JOIN_SECONDS)
        ready = [SPAWN.Event(), SPAWN.Event()]
        waiters = [start(procs, _child_count, instance_id, iterations, True, timeout, event, go) for event in ready]
        assert all(event.wait(JOIN_SECONDS) for event in ready)
        go.set()
        time.sleep(0.2)  # both are now blocked on the semaphore, their periods ending together
        os.kill(holder.pid, signal.SIGKILL)
        for waiter in waiters:
            join_ok(waiter)
        assert int(counter.array[0]) == 2 * iterations
    stats = lock.stats()
    assert stats["recoveries"] == 1, stats
    assert stats["semaphore_value"] == 1 and not stats["held"]
    assert stats["acquisitions"] == 1 + 2 * iterations


@pytest.mark.integration
def test_holder_dying_before_recording_itself_is_recovered(instance_id: str, procs: list,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOCK_LOGGER)
    timeout = 0.5
    lock = KVCacheLock.create(instance_id, 0, role="test", timeout=timeout)
    join_ok(start(procs, _child_take_semaphore_and_die, lock.name))
    assert lock.stats()["semaphore_value"] == 0 and not lock.stats()["held"]
    begin = time.monotonic()
    assert lock.acquire(timeout=30.0, what="write_back")
    elapsed = time.monotonic() - begin
    lock.release()
    # One period to notice nobody recorded ownership, a whole further period to be sure.
    assert 2 * timeout * 0.9 <= elapsed < 2 * timeout + MARGIN_SECONDS
    stats = lock.stats()
    assert stats["recoveries"] == 1 and stats["semaphore_value"] == 1
    assert any("no owner recorded" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


@pytest.mark.integration
def test_stalled_claimer_hands_its_unit_over(instance_id: str, procs: list) -> None:
    """A live process stuck between sem_wait and its claim while a waiter recovers must not also hold.

    White-box: this process plays the stalled one by taking the semaphore directly and then
    running the claim step of the blocking path late.
    """
    timeout = 0.4
    lock = KVCacheLock.create(instance_id, 0, role="test", timeout=timeout)
    posix_ipc.Semaphore("/" + lock.name).acquire(0)
    woke_ns = time.monotonic_ns()
    with SharedArray(counter_name(instance_id), 1, np.int64, create=True) as counter:
        ready, go = SPAWN.Event(), SPAWN.Event()
        go.set()
        join_ok(start(procs, _child_count, instance_id, 3, True, timeout, ready, go))
        assert int(counter.array[0]) == 3
    assert lock.stats()["recoveries"] == 1
    assert lock._claim_woken_unit(woke_ns, woke_ns, "stalled claim") is False
    stats = lock.stats()
    assert stats["handed_over"] == 1 and stats["semaphore_value"] == 1 and not stats["held"]
    assert lock.acquire(timeout=0)
    assert lock.stats()["semaphore_value"] == 0
    lock.release()


@pytest.mark.integration
def test_live_slow_holder_is_waited_for_not_robbed(instance_id: str, procs: list,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOCK_LOGGER)
    lock = KVCacheLock.create(instance_id, 0, role="test", timeout=0.3)
    holding = SPAWN.Event()
    holder = start(procs, _child_hold_for, instance_id, 1.5, holding)
    assert holding.wait(JOIN_SECONDS)
    begin = time.monotonic()
    with lock.hold("execute_model"):
        elapsed = time.monotonic() - begin
    join_ok(holder)
    assert elapsed >= 1.0, f"got the lock after {elapsed:.2f}s while its live holder kept it for 1.5s"
    stats = lock.stats()
    assert stats["recoveries"] == 0 and stats["acquisitions"] == 2
    assert stats["max_wait_ns"] >= 0.5e9
    waits = [r.getMessage() for r in caplog.records if "has waited" in r.getMessage()]
    assert waits and all("(cache_transfer)" in message for message in waits)
    assert len(waits) <= 1.5 / 0.3 + 1, "at most one 'still waiting' warning per period"


# --- observation and cleanup --------------------------------------------------------------------


@pytest.mark.integration
def test_stats_are_readable_from_another_process(instance_id: str, procs: list) -> None:
    lock = KVCacheLock.create(instance_id, 0, role="test")
    for _ in range(5):
        with lock.hold("swap_out"):
            time.sleep(0.001)
    queue = SPAWN.Queue()
    with lock.hold("execute_model"):
        join_ok(start(procs, _child_report_stats, instance_id, queue))
        seen = queue.get(timeout=JOIN_SECONDS)
    assert seen["enabled"] is True and seen["held"] is True
    assert seen["owner_pid"] == os.getpid() and seen["owner_role"] == "test"
    assert seen["acquisitions"] == 6 and seen["hold_ns_total"] >= 5 * 1e6
    assert seen["semaphore_value"] == 0 and seen["held_for_ns"] > 0


def test_names_modes_and_unlink(instance_id: str) -> None:
    lock = KVCacheLock.create(instance_id, 0, role="engine")
    sem_entry = f"sem.fd.{instance_id}.kvcache_lock.0"
    assert entries_of(instance_id) == {sem_entry, f"fd.{instance_id}.kvcache_lock_record.0"}
    assert stat.S_IMODE((SHM_DIR / sem_entry).stat().st_mode) == 0o600
    with pytest.raises(FileExistsError):
        KVCacheLock.create(instance_id, 0)
    attached = KVCacheLock.attach(instance_id, 0, "worker")
    assert attached.unlink() is False, "only the creator unlinks"
    attached.close()
    lock.close()
    assert lock.unlink() is True and lock.unlink() is False
    assert entries_of(instance_id) == set()
    with pytest.raises(FileNotFoundError):
        KVCacheLock.attach(instance_id, 0, "worker")
    assert entries_of(instance_id) == set()


# --- fault points: a holder killed or frozen anywhere in the protocol ---------------------------

FAULT_TIMEOUT = 0.3
PRIOR_CYCLES = 3  # holds before the fault, so the record has had owners and been released


def wait_stopped(pid: int) -> None:
    """Until ``pid`` is in state T (it sent itself SIGSTOP)."""
    deadline = time.monotonic() + JOIN_SECONDS
    while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
        if time.monotonic() > deadline:
            raise AssertionError(f"pid {pid} never stopped")
        time.sleep(0.01)


def assert_guard_free(iid: str) -> None:
    """Fail (rather than hang) if a stopped child froze inside the guard, i.e. took the fast path."""
    fd = os.open(SHM_DIR / f"fd.{iid}.kvcache_lock_record.0", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
    except BlockingIOError:
        raise AssertionError("the child froze inside the guard: it did not wait in sem_wait as set up") from None
    finally:
        os.close(fd)


def only_one_unit(lock: KVCacheLock, iid: str) -> None:
    """While ``lock`` holds the lock, no other handle gets a unit: the semaphore never went to 2."""
    assert lock.stats()["semaphore_value"] == 0
    other = KVCacheLock.attach(iid, 0, "test", timeout=FAULT_TIMEOUT)
    try:
        assert other.acquire(timeout=0) is False, "a second unit exists"
    finally:
        other.close()


@pytest.mark.integration
@pytest.mark.parametrize("point", FAULT_POINTS)
def test_holder_killed_at_each_point_after_prior_holds_is_recovered(instance_id: str, procs: list,
                                                                   point: str) -> None:
    lock = KVCacheLock.create(instance_id, 0, role="test", timeout=FAULT_TIMEOUT)
    for _ in range(PRIOR_CYCLES):
        with lock.hold("before"):
            pass
    child = start(procs, _child_cycles_with_fault, instance_id, f"{point}:kill@{PRIOR_CYCLES + 1}",
                  PRIOR_CYCLES + 3, FAULT_TIMEOUT)
    child.join(JOIN_SECONDS)
    assert child.exitcode == -signal.SIGKILL, f"the fault at {point} did not kill the child ({child.exitcode})"
    left = lock.stats()
    # The fatal pass counts as an acquisition unless the child died before recording itself.
    assert left["acquisitions"] == 2 * PRIOR_CYCLES + (0 if point == "after_sem_wait" else 1)
    assert left["semaphore_value"] == (1 if point == "release_posted" else 0)
    assert left["owner_pid"] == (child.pid if point == "after_claim" else 0)

    begin = time.monotonic()
    assert lock.acquire(timeout=2 * FAULT_TIMEOUT + 10 * MARGIN_SECONDS, what="recover"), f"never recovered ({point})"
    elapsed = time.monotonic() - begin
    try:
        only_one_unit(lock, instance_id)
    finally:
        lock.release()
    stats = lock.stats()
    if point == "release_posted":  # the unit was returned before death: nothing to recover
        assert elapsed < MARGIN_SECONDS and stats["recoveries"] == 0
    elif point == "after_claim":  # a recorded dead owner: one period
        assert FAULT_TIMEOUT * 0.9 <= elapsed < FAULT_TIMEOUT + MARGIN_SECONDS
        assert stats["recoveries"] == 1
    else:  # ownerless: one period to notice, a further one to be sure
        assert 2 * FAULT_TIMEOUT * 0.9 <= elapsed < 2 * FAULT_TIMEOUT + MARGIN_SECONDS
        assert stats["recoveries"] == 1
    assert stats["semaphore_value"] == 1 and not stats["held"]
    with lock.hold("after"):  # and the lock keeps working
        only_one_unit(lock, instance_id)
    assert lock.stats()["semaphore_value"] == 1


@pytest.mark.integration
def test_frozen_live_holder_is_never_robbed(instance_id: str, procs: list,
                                            caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOCK_LOGGER)
    lock = KVCacheLock.create(instance_id, 0, role="test", timeout=FAULT_TIMEOUT)
    for _ in range(PRIOR_CYCLES):
        with lock.hold("before"):
            pass
    child = start(procs, _child_cycles_with_fault, instance_id, "after_claim:stop@2", 4, FAULT_TIMEOUT)
    wait_stopped(child.pid)
    assert lock.stats()["owner_pid"] == child.pid
    with pytest.raises(KVCacheLockTimeout):
        with lock.hold("execute_model", timeout=6 * FAULT_TIMEOUT):
            pass
    assert lock.stats()["recoveries"] == 0 and lock.stats()["owner_pid"] == child.pid
    assert any(f"held by pid {child.pid} (worker)" in r.getMessage() for r in caplog.records)
    os.kill(child.pid, signal.SIGCONT)
    join_ok(child)  # it finishes its holds: nobody took its unit
    stats = lock.stats()
    assert stats["recoveries"] == 0 and stats["semaphore_value"] == 1
    assert stats["acquisitions"] == PRIOR_CYCLES + 4


@pytest.mark.integration
def test_waiter_frozen_after_sem_wait_hands_its_unit_over(instance_id: str, procs: list) -> None:
    """A real process stopped between sem_wait and its claim: recovered after 2*T; once it runs
    again it sees the recovery, does not also hold, and gets the lock normally later."""
    lock = KVCacheLock.create(instance_id, 0, role="test", timeout=FAULT_TIMEOUT)
    for _ in range(PRIOR_CYCLES):
        with lock.hold("before"):
            pass
    about_to_wait = SPAWN.Event()
    with lock.hold("keep the child waiting"):
        child = start(procs, _child_cycles_with_fault, instance_id, "after_sem_wait:stop", 2, FAULT_TIMEOUT,
                      about_to_wait)
        assert about_to_wait.wait(JOIN_SECONDS)
        time.sleep(1.0)  # the child is now in sem_wait
    wait_stopped(child.pid)  # it took the unit we released and froze before recording itself
    assert_guard_free(instance_id)
    assert lock.stats()["semaphore_value"] == 0 and lock.stats()["owner_pid"] == 0
    begin = time.monotonic()
    assert lock.acquire(timeout=10 * MARGIN_SECONDS, what="recover")
    assert time.monotonic() - begin >= 2 * FAULT_TIMEOUT * 0.9
    try:
        assert lock.stats()["recoveries"] == 1
        os.kill(child.pid, signal.SIGCONT)
        deadline = time.monotonic() + JOIN_SECONDS
        while lock.stats()["handed_over"] == 0:  # the child resumes, sees the recovery, waits again
            assert time.monotonic() < deadline, "the resumed child never noticed the recovery"
            time.sleep(0.01)
        only_one_unit(lock, instance_id)
        assert lock.stats()["owner_pid"] == os.getpid()
    finally:
        lock.release()
    join_ok(child)
    stats = lock.stats()
    assert stats["handed_over"] == 1 and stats["recoveries"] == 1
    assert stats["semaphore_value"] == 1 and not stats["held"]


# --- an unreadable /proc ----------------------------------------------------------------------


@pytest.mark.integration
def test_process_utils_refuse_to_guess_without_proc(tmp_path: Path) -> None:
    missing = str(tmp_path / "no-proc")
    me = os.getpid()
    with pytest.raises(ProcUnreadableError):
        pid_start_time(me, missing)
    assert process_alive(me, None, missing)  # existence is still known (signal 0)
    with pytest.raises(ProcUnreadableError):
        process_alive(me, pid_start_time(me), missing)  # identity is not
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: the pid no longer exists
    assert not process_alive(child.pid, 12345, missing)


def test_lock_refuses_a_process_that_cannot_read_its_start_time(instance_id: str, tmp_path: Path) -> None:
    unreadable = tmp_path / "proc"
    unreadable.mkdir(mode=0o000)
    try:
        for root in (str(tmp_path / "no-proc"), str(unreadable)):
            with pytest.raises(KVCacheLockError, match="start time"):
                KVCacheLock.create(instance_id, 0, role="test", proc_root=root)
            assert entries_of(instance_id) == set(), "a refused create left objects behind"
        lock = KVCacheLock.create(instance_id, 0, role="test")
        with pytest.raises(KVCacheLockError, match="readable"):
            KVCacheLock.attach(instance_id, 0, "worker", proc_root=str(tmp_path / "no-proc"))
        lock.close()
    finally:
        unreadable.chmod(0o700)


@pytest.mark.integration
def test_waiter_losing_proc_never_robs_a_live_holder_but_recovers_a_gone_one(
        instance_id: str, procs: list, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger=LOCK_LOGGER)
    proc_link = tmp_path / "proc"
    proc_link.symlink_to("/proc")
    lock = KVCacheLock.create(instance_id, 0, role="test", timeout=FAULT_TIMEOUT, proc_root=str(proc_link))
    holding = SPAWN.Event()
    holder = start(procs, _child_hold_forever, instance_id, holding)
    assert holding.wait(JOIN_SECONDS)
    proc_link.unlink()
    proc_link.symlink_to(tmp_path / "gone")  # from now on this process cannot read start times
    with pytest.raises(KVCacheLockTimeout):
        with lock.hold("execute_model", timeout=4 * FAULT_TIMEOUT):
            pass
    assert lock.stats()["recoveries"] == 0
    assert any("cannot tell whether holder pid" in r.getMessage() for r in caplog.records)
    holder.kill()
    holder.join(JOIN_SECONDS)  # reaped: its pid is gone, which signal 0 can tell
    begin = time.monotonic()
    with lock.hold("execute_model", timeout=10 * MARGIN_SECONDS):
        assert time.monotonic() - begin < FAULT_TIMEOUT + MARGIN_SECONDS
    assert lock.stats()["recoveries"] == 1 and lock.stats()["semaphore_value"] == 1
