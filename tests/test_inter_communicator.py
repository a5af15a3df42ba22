"""Shared memory, IPC signals and process-lifetime helpers across real processes."""
from __future__ import annotations

import multiprocessing
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path
from typing import Iterator

import numpy as np
import posix_ipc
import pytest

from inter_communicator.ipc_signal import IPCSignal
from inter_communicator.process_utils import pid_start_time, process_alive
from inter_communicator.shm import SharedArray, ipc_name, register_created_semaphore, sweep_stale, unlink_created

REPO_ROOT = Path(__file__).resolve().parent.parent
SHM_DIR = Path("/dev/shm")
WAIT_SECONDS = 15.0


@pytest.fixture
def instance_id() -> Iterator[str]:
    """A fresh instance id; whatever a test leaves under it is removed afterwards."""
    iid = f"test-{uuid.uuid4().hex[:12]}"
    try:
        yield iid
    finally:
        unlink_created()
        sweep_stale(iid)


def entries_of(iid: str) -> set[str]:
    return {p.name for p in SHM_DIR.iterdir() if p.name.startswith((f"fd.{iid}.", f"sem.fd.{iid}."))}


def wait_until(predicate, timeout: float = WAIT_SECONDS, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


# --- names -------------------------------------------------------------------------------------


def test_ipc_name_format() -> None:
    assert ipc_name("srv-1", "worker_ready", 3) == "fd.srv-1.worker_ready.3"
    assert ipc_name("a", "b") == "fd.a.b.0"


@pytest.mark.parametrize(
    ("instance", "name", "rank"),
    [("", "x", 0), ("a.b", "x", 0), ("a", "x/y", 0), ("a", "x y", 0), ("a", "", 0), ("a", "x", -1), ("a", "x", "0"),
     ("a" * 300, "x", 0)],
)
def test_ipc_name_rejects_bad_parts(instance: str, name: str, rank: int) -> None:
    with pytest.raises(ValueError):
        ipc_name(instance, name, rank)


# --- SharedArray -------------------------------------------------------------------------------


def _child_attach_and_write(name: str, shape: tuple[int, ...]) -> None:
    shared = SharedArray(name, shape, np.float32, create=False)
    if not np.array_equal(shared.array, np.arange(np.prod(shape), dtype=np.float32).reshape(shape)):
        raise SystemExit(3)
    shared.array[...] *= -1.0
    shared.close()


@pytest.mark.integration
def test_shared_array_round_trip_across_processes(instance_id: str) -> None:
    name = ipc_name(instance_id, "roundtrip")
    shape = (4, 1000)
    with SharedArray(name, shape, np.float32, create=True) as shared:
        assert not shared.array.any(), "a new segment must read as zeros"
        shared.array[...] = np.arange(4000, dtype=np.float32).reshape(shape)
        child = multiprocessing.get_context("spawn").Process(target=_child_attach_and_write, args=(name, shape))
        child.start()
        child.join(WAIT_SECONDS)
        assert child.exitcode == 0
        np.testing.assert_array_equal(shared.array, -np.arange(4000, dtype=np.float32).reshape(shape))
        # The attacher's exit must not remove the creator's segment.
        assert name in entries_of(instance_id)
    assert entries_of(instance_id) == set()


def test_segment_mode_is_owner_only(instance_id: str) -> None:
    shared = SharedArray(ipc_name(instance_id, "mode"), (8,), np.int64, create=True)
    try:
        assert stat.S_IMODE((SHM_DIR / shared.name).stat().st_mode) == 0o600
    finally:
        shared.close()
        shared.unlink()


def test_attach_with_wrong_size_or_missing_name_raises(instance_id: str) -> None:
    name = ipc_name(instance_id, "sized")
    shared = SharedArray(name, (10,), np.float32, create=True)
    try:
        with pytest.raises(ValueError, match="40 bytes, expected 80"):
            SharedArray(name, (10,), np.float64, create=False)
        with pytest.raises(FileExistsError):
            SharedArray(name, (10,), np.float32, create=True)
        with pytest.raises(FileNotFoundError):
            SharedArray(ipc_name(instance_id, "missing"), (10,), np.float32, create=False)
    finally:
        shared.close()
        shared.unlink()


def test_segment_larger_than_dev_shm_is_refused(instance_id: str) -> None:
    fs = os.statvfs(SHM_DIR)
    free = fs.f_bavail * fs.f_frsize
    with pytest.raises(OSError, match="MiB free"):
        SharedArray(ipc_name(instance_id, "huge"), (free // 4 + 1024,), np.float32, create=True)
    assert entries_of(instance_id) == set()


def test_unlink_is_idempotent_and_creator_only(instance_id: str) -> None:
    name = ipc_name(instance_id, "unlink")
    creator = SharedArray(name, (3,), np.int32, create=True)
    attached = SharedArray(name, (3,), np.int32, create=False)
    view = attached.array  # a live view must survive close() of its owner object
    attached.close()
    assert attached.unlink() is False
    assert name in entries_of(instance_id)
    assert creator.unlink() is True
    assert creator.unlink() is False
    assert entries_of(instance_id) == set()
    # The mapping outlives the name until closed.
    creator.array[1] = 7
    assert view[1] == 7
    creator.close()
    with pytest.raises(ValueError, match="closed"):
        _ = creator.array


def test_large_segment_maps_without_copy(instance_id: str) -> None:
    nbytes = 256 * 1024 * 1024
    shared = SharedArray(ipc_name(instance_id, "big"), (nbytes // 4,), np.float32, create=True)
    try:
        other = SharedArray(shared.name, (nbytes // 4,), np.float32, create=False)
        other.array[-1] = 1.5  # visible through the creator's mapping: one memory, no copy
        assert shared.array[-1] == 1.5
        assert not shared.array.flags.owndata
        other.close()
    finally:
        shared.close()
        shared.unlink()


def test_unlink_created_removes_only_what_this_process_created(instance_id: str) -> None:
    mine = SharedArray(ipc_name(instance_id, "mine"), (2,), np.int8, create=True)
    sem_name = "/" + ipc_name(instance_id, "lock")
    sem = posix_ipc.Semaphore(sem_name, flags=posix_ipc.O_CREX, mode=0o600, initial_value=1)
    register_created_semaphore(sem_name)
    try:
        removed = unlink_created()
        assert mine.name in removed and sem_name[1:] in removed
        assert entries_of(instance_id) == set()
        assert unlink_created() == []
    finally:
        sem.close()
        mine.close()


def test_sweep_stale_only_touches_its_instance(instance_id: str) -> None:
    other_id = f"test-{uuid.uuid4().hex[:12]}"
    created = []
    try:
        for iid in (instance_id, other_id):
            created.append(SharedArray(ipc_name(iid, "seg", 1), (4,), np.int32, create=True))
            created.append(posix_ipc.Semaphore("/" + ipc_name(iid, "lock", 1), flags=posix_ipc.O_CREX, initial_value=1))
        removed = sweep_stale(instance_id)
        assert sorted(removed) == sorted([f"fd.{instance_id}.seg.1", f"sem.fd.{instance_id}.lock.1"])
        assert entries_of(instance_id) == set()
        assert entries_of(other_id) == {f"fd.{other_id}.seg.1", f"sem.fd.{other_id}.lock.1"}
    finally:
        for obj in created:
            obj.close()
        sweep_stale(other_id)
    assert entries_of(other_id) == set()


# --- IPCSignal ---------------------------------------------------------------------------------


def _child_bump_signal(instance_id: str) -> None:
    sig = IPCSignal("step", np.zeros(3, dtype=np.int64), instance_id, dp_rank=2, create=False)
    if sig.value.tolist() != [5, 6, 7]:
        raise SystemExit(3)
    sig.value[1] += 100
    sig.close()


@pytest.mark.integration
def test_ipc_signal_round_trip_across_processes(instance_id: str) -> None:
    sig = IPCSignal("step", np.array([5, 6, 7], dtype=np.int64), instance_id, dp_rank=2, create=True)
    try:
        assert sig.shm_name == f"fd.{instance_id}.step.2"
        child = multiprocessing.get_context("spawn").Process(target=_child_bump_signal, args=(instance_id,))
        child.start()
        child.join(WAIT_SECONDS)
        assert child.exitcode == 0
        assert sig.value.tolist() == [5, 106, 7]
    finally:
        sig.close()
        sig.unlink()
    assert entries_of(instance_id) == set()


def test_ipc_signal_attach_with_other_dtype_fails(instance_id: str) -> None:
    sig = IPCSignal("flag", np.zeros(2, dtype=np.int32), instance_id, create=True)
    try:
        with pytest.raises(ValueError, match="bytes, expected"):
            IPCSignal("flag", np.zeros(2, dtype=np.int64), instance_id, create=False)
    finally:
        sig.close()
        sig.unlink()


# --- process lifetime --------------------------------------------------------------------------


@pytest.mark.integration
def test_process_alive_tracks_pid_and_start_time() -> None:
    me = os.getpid()
    start = pid_start_time(me)
    assert start is not None
    assert process_alive(me, start)
    assert process_alive(me, None)
    assert not process_alive(me, start + 1)  # same pid, different process
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child_start = pid_start_time(child.pid)
    child.wait(WAIT_SECONDS)
    assert not process_alive(child.pid, child_start)
    assert pid_start_time(child.pid) is None
    assert not process_alive(-1, None)


@pytest.mark.integration
def test_process_alive_false_for_zombie() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        # Not reaped yet: the child stays a zombie until wait().
        assert wait_until(lambda: not process_alive(child.pid, None))
        assert Path(f"/proc/{child.pid}").exists()
    finally:
        child.wait(WAIT_SECONDS)


GRANDCHILD = """
import os, sys, time
from inter_communicator.process_utils import ParentWatcher, set_parent_death_signal
mode = sys.argv[1]
if mode == "pdeathsig":
    set_parent_death_signal(parent_pid=int(sys.argv[2]))
else:
    ParentWatcher(interval=0.1, parent_pid=int(sys.argv[2])).start()
print(os.getpid(), flush=True)
time.sleep(60)
"""

MIDDLE = """
import os, subprocess, sys, time
subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2], str(os.getpid())])
time.sleep(60)
"""


@pytest.mark.integration
@pytest.mark.parametrize("mode", ["pdeathsig", "watcher"])
def test_grandchild_exits_when_its_parent_is_killed(mode: str) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    middle = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(MIDDLE), textwrap.dedent(GRANDCHILD), mode],
        stdout=subprocess.PIPE, env=env, text=True,
    )
    grandchild_pid = None
    try:
        # The grandchild prints its pid once its death mechanism is armed.
        grandchild_pid = int(middle.stdout.readline())
        start = pid_start_time(grandchild_pid)
        assert process_alive(grandchild_pid, start)
        middle.kill()
        middle.wait(WAIT_SECONDS)
        assert wait_until(lambda: not process_alive(grandchild_pid, start)), f"{mode}: grandchild outlived its parent"
    finally:
        if middle.poll() is None:
            middle.kill()
            middle.wait(WAIT_SECONDS)
        if grandchild_pid is not None and process_alive(grandchild_pid, start):
            os.kill(grandchild_pid, signal.SIGKILL)
        middle.stdout.close()


SHUTDOWN_CHILD = """
import time
from inter_communicator.process_utils import install_shutdown_handlers
install_shutdown_handlers(lambda: print("callback", flush=True))
print("ready", flush=True)
time.sleep(60)
"""


@pytest.mark.integration
def test_first_signal_runs_callback_second_kills() -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    child = subprocess.Popen([sys.executable, "-c", SHUTDOWN_CHILD], stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        child.send_signal(signal.SIGINT)
        assert child.stdout.readline().strip() == "callback"
        assert child.poll() is None, "the first signal must only run the callback"
        child.send_signal(signal.SIGINT)
        assert child.wait(WAIT_SECONDS) == -signal.SIGINT
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(WAIT_SECONDS)
        child.stdout.close()


STUCK_SHUTDOWN = """
    import sys, threading
    import numpy as np
    from inter_communicator.process_utils import ShutdownDeadline
    from inter_communicator.shm import SharedArray
    segment = SharedArray(sys.argv[1], (4,), np.float32, create=True)
    stop = threading.Event()
    ShutdownDeadline(stop, grace_s=0.5).start()
    stop.set()
    print("stopping", flush=True)
    threading.Event().wait()  # a clean-up step that never returns
"""


@pytest.mark.integration
def test_shutdown_deadline_ends_a_stuck_process_and_unlinks_its_segments(instance_id: str) -> None:
    name = ipc_name(instance_id, "stuck")
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(STUCK_SHUTDOWN), name],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    try:
        assert proc.stdout.readline().strip() == "stopping"
        assert proc.wait(WAIT_SECONDS) == 1
        assert "shutdown did not finish" in proc.stderr.read()
        assert entries_of(instance_id) == set()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(WAIT_SECONDS)
        proc.stdout.close()
        proc.stderr.close()
