"""The cache transfer process and its block copies, on real shared memory, real processes, real storage.

The test plays launch.py + engine: it creates the instance signals and a device KV pool filled with
recognisable bytes, spawns ``run_cache_transfer`` and drives it over ZMQ, then checks the bytes that
land in the host pool, the storage directory and the device pool.
"""
from __future__ import annotations

import dataclasses
import multiprocessing
import os
import signal
import time
import uuid
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import zmq

import envs

envs.apply_compute_thread_env(2)

from cache_manager import block_copy  # noqa: E402
from cache_manager.block_state import BlockState  # noqa: E402
from cache_manager.cache_transfer_manager import run_cache_transfer  # noqa: E402
from cache_manager.kv_layout import (  # noqa: E402
    device_cache_segment,
    device_cache_shape,
    host_cache_segment,
    host_cache_shape,
    storage_key,
)
from config.engine_config import EngineArgs, EngineConfig, build_engine_config  # noqa: E402
from engine.engine_process import EngineAddresses  # noqa: E402
from inter_communicator.instance_signals import InstanceSignals  # noqa: E402
from inter_communicator.kvcache_lock import KVCacheLock  # noqa: E402
from inter_communicator.messages import (  # noqa: E402
    ClearStorage,
    TransferDone,
    TransferStarted,
    TransferTask,
    WorkerShutdown,
)
from inter_communicator.process_utils import process_alive  # noqa: E402
from inter_communicator.shm import SharedArray, sweep_stale, unlink_created  # noqa: E402

SHM_DIR = Path("/dev/shm")
START_TIMEOUT_S = 60.0  # spawn + imports on a loaded 2-core CI machine
REPLY_TIMEOUT_S = 20.0
EXIT_TIMEOUT_S = 20.0
NUM_DEVICE_BLOCKS = 6
SWAP_SPACE_GIB = 0.02  # 7 host blocks of SmolLM2 at block size 64

pytestmark = pytest.mark.integration  # spawns cache transfer processes


# ---- harness ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def base_config(tmp_path_factory: pytest.TempPathFactory) -> EngineConfig:
    storage_dir = tmp_path_factory.mktemp("kvstore")
    return build_engine_config(EngineArgs(num_gpu_blocks_override=NUM_DEVICE_BLOCKS, swap_space=SWAP_SPACE_GIB,
                                          kvcache_storage_backend="file", file_backend_storage_dir=str(storage_dir)))


class Instance:
    """What launch.py, the worker and the engine would own for one server instance."""

    def __init__(self, config: EngineConfig, ipc_dir: Path) -> None:
        self.config = config
        self.iid = config.instance_id
        self.host_name = host_cache_segment(self.iid, config.parallel.dp_rank, 0)
        addresses = EngineAddresses.in_dir(str(ipc_dir), config.parallel.dp_rank)  # the engine's own socket names
        self.task_addr, self.done_addr = addresses.transfer_tasks, addresses.transfer_done
        self.proc: multiprocessing.process.BaseProcess | None = None
        self.transfer_pid: int | None = None
        self.host_segment: SharedArray | None = None
        self._next_task_id = 0
        sweep_stale(self.iid)
        try:
            self.signals = InstanceSignals(config, create=True)
            self.device_segment = SharedArray(
                device_cache_segment(self.iid, config.parallel.dp_rank, 0),
                device_cache_shape(config.model, config.cache.num_gpu_blocks, config.cache.block_size), np.float32,
                create=True)
            self.lock = KVCacheLock.create(self.iid, config.parallel.dp_rank, role="launch")
            self.context = zmq.Context()
            self.task_socket = self.context.socket(zmq.PUSH)
            self.done_socket = self.context.socket(zmq.PULL)
            self.task_socket.bind(self.task_addr)
            self.done_socket.bind(self.done_addr)
        except BaseException:
            if getattr(self, "context", None) is not None:
                self.context.destroy(linger=0)
            unlink_created()
            sweep_stale(self.iid)
            raise
        self.device = self.device_segment.array

    def start(self, sanitizer: bool, via_parent: bool = False, env: dict[str, str] | None = None) -> None:
        """Spawn the process (or, with ``via_parent``, an intermediate parent that spawns it)."""
        overrides = {"FD_KVCACHE_SANITIZER": "1" if sanitizer else "0", "FD_USE_KVCACHE_LOCK": "1", **(env or {})}
        saved = {name: os.environ.get(name) for name in overrides}
        os.environ.update(overrides)  # a spawned child copies the environment at start
        try:
            spawn = multiprocessing.get_context("spawn")
            if via_parent:
                receiver, sender = spawn.Pipe(duplex=False)
                self.proc = spawn.Process(target=_parent_of_transfer_process,
                                          args=(self.config, self.task_addr, self.done_addr, sender))
                self.proc.start()
                sender.close()
                if not receiver.poll(START_TIMEOUT_S):
                    raise TimeoutError("the intermediate parent did not report its child's pid")
                self.transfer_pid = receiver.recv()
                receiver.close()
            else:
                self.proc = spawn.Process(target=run_cache_transfer,
                                          args=(self.config, 0, self.task_addr, self.done_addr))
                self.proc.start()
                self.transfer_pid = self.proc.pid
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        deadline = time.monotonic() + START_TIMEOUT_S
        while self.signals.cache_transfer_ready.value[0] != 1:
            if not self.proc.is_alive():
                raise RuntimeError(f"cache transfer process died at start-up (exit code {self.proc.exitcode})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"cache transfer process not ready after {START_TIMEOUT_S:.0f} s")
            time.sleep(0.05)
        if self.config.cache.num_cpu_blocks:
            self.host_segment = SharedArray(
                self.host_name, host_cache_shape(self.config.model, self.config.cache.num_cpu_blocks,
                                                 self.config.cache.block_size), np.float32, create=False)

    @property
    def host(self) -> np.ndarray:
        return self.host_segment.array

    def block(self, d: int) -> np.ndarray:
        return self.device[:, :, d].copy()

    def fill_block(self, d: int, seed: int) -> np.ndarray:
        pattern = np.random.default_rng(seed).standard_normal(self.device[:, :, d].shape).astype(np.float32)
        self.device[:, :, d] = pattern
        return pattern

    def set_states(self, state: BlockState, *blocks: int) -> None:
        for block in blocks:
            self.signals.block_states.value[block] = int(state)

    def recv(self, timeout_s: float = REPLY_TIMEOUT_S) -> object:
        if not self.done_socket.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"no message from the cache transfer process within {timeout_s} s")
        return self.done_socket.recv_pyobj()

    def send(self, kind: str, device: list[int] = (), host: list[int] = (), keys: list[str] = ()) -> int:
        self._next_task_id += 1
        self.task_socket.send_pyobj(TransferTask(task_id=self._next_task_id, kind=kind, device_block_ids=list(device),
                                                 host_block_ids=list(host), storage_keys=list(keys)))
        return self._next_task_id

    def collect(self, task_id: int) -> tuple[list[object], TransferDone]:
        """The messages received before the task's TransferDone, and the TransferDone."""
        before: list[object] = []
        while True:
            message = self.recv()
            message_task = getattr(message, "task_id", None)
            if isinstance(message_task, int) and message_task < task_id:
                continue  # left over by an earlier test that failed; keep the failure from cascading
            if message_task != task_id:
                raise AssertionError(f"unexpected message {message!r} while waiting for task {task_id}")
            if isinstance(message, TransferDone):
                return before, message
            before.append(message)

    def run(self, kind: str, device: list[int] = (), host: list[int] = (),
            keys: list[str] = ()) -> tuple[list[object], TransferDone]:
        return self.collect(self.send(kind, device, host, keys))

    def key(self, name: str) -> str:
        return storage_key(self.config.model.model_fingerprint, f"{name}-{uuid.uuid4().hex[:8]}", 0)

    def wait_exit(self) -> int:
        self.proc.join(EXIT_TIMEOUT_S)
        if self.proc.is_alive():
            raise TimeoutError(f"cache transfer process still alive {EXIT_TIMEOUT_S} s after being told to stop")
        return self.proc.exitcode

    def host_segment_exists(self) -> bool:
        return (SHM_DIR / self.host_name).exists()

    def close(self) -> None:
        if self.transfer_pid is not None and process_alive(self.transfer_pid, None):
            self.task_socket.send_pyobj(WorkerShutdown("test teardown"))
            deadline = time.monotonic() + EXIT_TIMEOUT_S
            while process_alive(self.transfer_pid, None) and time.monotonic() < deadline:
                time.sleep(0.05)
            if process_alive(self.transfer_pid, None):
                os.kill(self.transfer_pid, signal.SIGKILL)
        if self.proc is not None and self.proc.is_alive():
            self.proc.kill()  # the intermediate parent of the parent-death test, or a hung process
        if self.proc is not None:
            self.proc.join(EXIT_TIMEOUT_S)
        if self.host_segment is not None:
            self.host_segment.close()
        for sock in (self.task_socket, self.done_socket):
            sock.close(linger=0)
        self.context.term()
        self.lock.close()
        self.lock.unlink()
        self.device_segment.close()
        self.signals.close()
        unlink_created()
        sweep_stale(self.iid)


def _parent_of_transfer_process(config: EngineConfig, task_addr: str, done_addr: str, pid_sender: object) -> None:
    """Stands in for the engine: spawns the transfer process, reports its pid, then waits to be killed."""
    child = multiprocessing.get_context("spawn").Process(target=run_cache_transfer,
                                                         args=(config, 0, task_addr, done_addr))
    child.start()
    pid_sender.send(child.pid)
    child.join(START_TIMEOUT_S + EXIT_TIMEOUT_S)


def _new_instance(base_config: EngineConfig, ipc_dir: Path) -> Instance:
    config = dataclasses.replace(base_config, instance_id=f"ct-{uuid.uuid4().hex[:10]}")
    return Instance(config, ipc_dir)


@pytest.fixture(scope="module")
def served(base_config: EngineConfig, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Instance]:
    """One transfer process (sanitizer on) shared by the copy tests; every test sets its block states."""
    instance = _new_instance(base_config, tmp_path_factory.mktemp("ipc"))
    try:
        instance.start(sanitizer=True)
        yield instance
        instance.task_socket.send_pyobj(WorkerShutdown("end of module"))
        assert instance.wait_exit() == 0
        assert not instance.host_segment_exists()
    finally:
        instance.close()


@pytest.fixture
def fresh(base_config: EngineConfig, tmp_path: Path) -> Iterator[Instance]:
    """An instance of its own, for tests that stop the process."""
    instance = _new_instance(base_config, tmp_path)
    try:
        yield instance
    finally:
        instance.close()


# ---- block_copy on its own ------------------------------------------------------------------------


def _small_pools(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    device = rng.standard_normal((3, 2, 5, 4, 2, 3)).astype(np.float32)
    host = rng.standard_normal((4, 3, 2, 4, 2, 3)).astype(np.float32)
    return device, host


def test_block_copy_round_trips_between_layouts() -> None:
    rng = np.random.default_rng(0)
    device, host = _small_pools(rng)
    original = device.copy()
    block_copy.device_to_host(device, host, [4, 0], [1, 3])
    np.testing.assert_array_equal(host[1], original[:, :, 4])
    np.testing.assert_array_equal(host[3], original[:, :, 0])
    block_copy.host_to_device(host, device, [1], [2])
    np.testing.assert_array_equal(device[:, :, 2], original[:, :, 4])
    np.testing.assert_array_equal(np.delete(device, 2, axis=2), np.delete(original, 2, axis=2))

    staging = np.zeros((3, 3, 2, 4, 2, 3), dtype=np.float32)
    block_copy.device_to_staging(device, staging, [0, 1])
    np.testing.assert_array_equal(staging[1], device[:, :, 1])
    np.testing.assert_array_equal(staging[2], 0.0)  # rows past the request stay as they were
    before = device.copy()
    block_copy.staging_to_device(staging, device, [1], [3])  # only the listed row moves
    np.testing.assert_array_equal(device[:, :, 3], before[:, :, 1])
    np.testing.assert_array_equal(np.delete(device, 3, axis=2), np.delete(before, 3, axis=2))


@pytest.mark.parametrize(("device_ids", "host_ids", "message"), [
    ([5], [0], "outside the pool of 5"),
    ([0], [4], "outside the pool of 4"),
    ([0, 1], [2, 2], "repeat a destination"),
    ([0, 1], [2], "pair up"),
    ([True], [0], "not an integer"),
])
def test_block_copy_rejects_bad_ids_without_copying(device_ids: list, host_ids: list, message: str) -> None:
    device, host = _small_pools(np.random.default_rng(1))
    host_before = host.copy()
    with pytest.raises(block_copy.BlockCopyError, match=message):
        block_copy.device_to_host(device, host, device_ids, host_ids)
    np.testing.assert_array_equal(host, host_before)


def test_block_copy_rejects_mismatched_layouts() -> None:
    device, host = _small_pools(np.random.default_rng(2))
    with pytest.raises(block_copy.BlockCopyError, match="shaped"):
        block_copy.device_to_host(device, host[:, :, :, :2], [0], [0])
    with pytest.raises(block_copy.BlockCopyError, match="dtype"):
        block_copy.host_to_device(host.astype(np.float64), device, [0], [0])
    with pytest.raises(block_copy.BlockCopyError, match="do not fit"):
        block_copy.device_to_staging(device, host[:1], [0, 1])


# ---- the process --------------------------------------------------------------------------------


def test_ready_and_heartbeat(served: Instance) -> None:
    assert served.signals.cache_transfer_ready.value[0] == 1
    first = float(served.signals.cache_transfer_heartbeat.value[0])
    time.sleep(1.2)
    second = float(served.signals.cache_transfer_heartbeat.value[0])
    assert second > first
    assert time.time() - second < 1.5
    assert served.host_segment_exists()


def test_swap_out_then_swap_in_reproduces_bytes(served: Instance) -> None:
    pattern = served.fill_block(0, seed=10)
    untouched = served.block(1)
    served.set_states(BlockState.SWAP_OUT, 0)
    before, done = served.run("swap_out", device=[0], host=[2])
    assert (before, done.ok, done.error) == ([], [True], None)
    np.testing.assert_array_equal(served.host[2], pattern)

    served.set_states(BlockState.SWAP_IN, 3)
    before, done = served.run("swap_in", device=[3], host=[2])
    assert done.ok == [True] and done.error is None
    assert [type(m) for m in before] == [TransferStarted]
    np.testing.assert_array_equal(served.block(3), pattern)
    np.testing.assert_array_equal(served.block(1), untouched)


def test_write_back_then_prefetch_reproduces_bytes(served: Instance) -> None:
    pattern_a = served.fill_block(1, seed=20)
    pattern_b = served.fill_block(2, seed=21)
    keys = [served.key("a"), served.key("b")]
    served.set_states(BlockState.WRITE_BACK, 1, 2)
    before, done = served.run("write_back", device=[1, 2], keys=keys)
    assert (before, done.ok, done.error) == ([], [True, True], None)

    served.fill_block(4, seed=22)
    served.fill_block(5, seed=23)
    served.set_states(BlockState.LOAD, 4, 5)
    before, done = served.run("prefetch", device=[5, 4], keys=keys)
    assert done.ok == [True, True] and done.error is None
    assert [type(m) for m in before] == [TransferStarted]
    np.testing.assert_array_equal(served.block(5), pattern_a)
    np.testing.assert_array_equal(served.block(4), pattern_b)


def test_write_back_from_host_block(served: Instance) -> None:
    pattern = np.random.default_rng(30).standard_normal(served.host[5].shape).astype(np.float32)
    served.host[5] = pattern
    key = served.key("host")
    _, done = served.run("write_back", host=[5], keys=[key])
    assert done.ok == [True] and done.error is None

    served.set_states(BlockState.LOAD, 0)
    _, done = served.run("prefetch", device=[0], keys=[key])
    assert done.ok == [True]
    np.testing.assert_array_equal(served.block(0), pattern)


def test_prefetch_miss_leaves_the_block_untouched(served: Instance) -> None:
    stored = served.fill_block(1, seed=40)
    key = served.key("present")
    served.set_states(BlockState.WRITE_BACK, 1)
    assert served.run("write_back", device=[1], keys=[key])[1].ok == [True]

    untouched = served.fill_block(3, seed=41)
    served.fill_block(4, seed=42)
    served.set_states(BlockState.LOAD, 3, 4)
    before, done = served.run("prefetch", device=[3, 4], keys=[served.key("missing"), key])
    assert done.ok == [False, True] and done.error is None
    assert [type(m) for m in before] == [TransferStarted]
    np.testing.assert_array_equal(served.block(3), untouched)
    np.testing.assert_array_equal(served.block(4), stored)


def test_clear_storage_drops_stored_blocks(served: Instance) -> None:
    served.fill_block(2, seed=50)
    key = served.key("cleared")
    served.set_states(BlockState.WRITE_BACK, 2)
    assert served.run("write_back", device=[2], keys=[key])[1].ok == [True]
    served.task_socket.send_pyobj(ClearStorage())  # no reply; tasks after it run after it

    untouched = served.fill_block(5, seed=51)
    served.set_states(BlockState.LOAD, 5)
    _, done = served.run("prefetch", device=[5], keys=[key])
    assert done.ok == [False]
    np.testing.assert_array_equal(served.block(5), untouched)


@pytest.mark.parametrize("kind", ["swap_out", "swap_in", "write_back", "prefetch"])
def test_device_copy_waits_for_the_lock(served: Instance, kind: str) -> None:
    """Every kind that touches the device pool blocks while another process holds the lock, and
    copies once it is released; fills announce TransferStarted only from inside their hold."""
    fills = kind in ("swap_in", "prefetch")
    key = served.key("locked")
    if fills:
        source = np.random.default_rng(90).standard_normal(served.host[3].shape).astype(np.float32)
        served.host[3] = source
        if kind == "prefetch":
            assert served.run("write_back", host=[3], keys=[key])[1].ok == [True]
        untouched = served.fill_block(4, seed=91)
        served.set_states(BlockState.SWAP_IN if kind == "swap_in" else BlockState.LOAD, 4)
    else:
        source = served.fill_block(4, seed=92)
        served.set_states(BlockState.SWAP_OUT if kind == "swap_out" else BlockState.WRITE_BACK, 4)
    host_before = served.host[3].copy()
    kwargs = {"host": [3]} if kind in ("swap_in", "swap_out") else {"keys": [key]}
    contended_before = served.lock.stats()["contended"]

    served.lock.acquire()  # what the worker does around execute_model
    try:
        task_id = served.send(kind, device=[4], **kwargs)
        assert not served.done_socket.poll(800), "a message arrived while the test held the KV-cache lock"
        if fills:
            np.testing.assert_array_equal(served.block(4), untouched)
        np.testing.assert_array_equal(served.host[3], host_before)
    finally:
        served.lock.release()
    before, done = served.collect(task_id)
    assert [type(m) for m in before] == ([TransferStarted] if fills else [])
    assert done.ok == [True] and done.error is None
    # The transfer process waited in the lock's slow path, not somewhere else.
    assert served.lock.stats()["contended"] == contended_before + 1
    if fills:
        np.testing.assert_array_equal(served.block(4), source)
    elif kind == "swap_out":
        np.testing.assert_array_equal(served.host[3], source)
    else:  # the bytes reached storage: read them back into another block
        served.set_states(BlockState.LOAD, 5)
        assert served.run("prefetch", device=[5], keys=[key])[1].ok == [True]
        np.testing.assert_array_equal(served.block(5), source)


MULTI_CHUNK_BLOCKS = 20  # more than STAGING_BLOCKS (16): a prefetch of two chunks
SLOW_FILL_S = 0.3


def test_multi_chunk_prefetch_holds_the_lock_from_started_to_its_last_chunk(
        base_config: EngineConfig, tmp_path: Path) -> None:
    """Whoever takes the lock after TransferStarted must find every chunk copied: the engine's
    early-schedule fault relies on exactly that. The slow-fill fault sleeps before every chunk."""
    config = dataclasses.replace(base_config, instance_id=f"ct-{uuid.uuid4().hex[:10]}",
                                 cache=dataclasses.replace(base_config.cache, num_gpu_blocks=MULTI_CHUNK_BLOCKS))
    instance = Instance(config, tmp_path)
    try:
        instance.start(sanitizer=True, env={"FD_KVCACHE_FAULT_SLOW_FILL_S": str(SLOW_FILL_S)})
        blocks = list(range(MULTI_CHUNK_BLOCKS))
        patterns = [instance.fill_block(b, seed=100 + b) for b in blocks]
        keys = [instance.key(f"chunked{b}") for b in blocks]
        instance.set_states(BlockState.WRITE_BACK, *blocks)
        assert instance.run("write_back", device=blocks, keys=keys)[1].ok == [True] * len(blocks)
        instance.device[:] = 0.0
        instance.set_states(BlockState.LOAD, *blocks)

        task_id = instance.send("prefetch", device=blocks, keys=keys)
        started = instance.recv()
        assert isinstance(started, TransferStarted) and started.task_id == task_id
        announced = time.monotonic()
        with instance.lock.hold("execute_model", timeout=REPLY_TIMEOUT_S):
            waited = time.monotonic() - announced
            for block, pattern in zip(blocks, patterns):  # all of them, the second chunk included
                np.testing.assert_array_equal(instance.block(block), pattern, err_msg=f"block {block}")
        assert waited >= 2 * SLOW_FILL_S * 0.9, f"got the lock {waited:.2f}s after started: not one hold"
        _, done = instance.collect(task_id)
        assert done.ok == [True] * len(blocks) and done.error is None
    finally:
        instance.close()


@pytest.mark.parametrize(("kind", "state", "kwargs"), [
    ("swap_out", BlockState.IN_USE, {"host": [0]}),
    ("swap_in", BlockState.CACHED, {"host": [0]}),
    ("write_back", BlockState.FREE, {"keys": ["sanitizer-wb"]}),
    ("prefetch", BlockState.IN_USE, {"keys": ["sanitizer-pf"]}),
])
def test_sanitizer_refuses_wrong_block_state(served: Instance, kind: str, state: BlockState, kwargs: dict) -> None:
    if kind == "prefetch":  # make the key exist, so only the sanitizer can stop the copy
        served.fill_block(0, seed=60)
        served.set_states(BlockState.WRITE_BACK, 0)
        assert served.run("write_back", device=[0], keys=kwargs["keys"])[1].ok == [True]
    device_block = 2
    device_before = served.fill_block(device_block, seed=61)
    host_before = served.host.copy()
    served.set_states(BlockState.LOAD, 1)  # a neighbour in a valid-looking state must not matter
    served.set_states(state, device_block)

    before, done = served.run(kind, device=[device_block], **kwargs)
    assert done.ok == [False]
    assert done.error is not None
    assert f"device block {device_block}" in done.error and state.name in done.error and kind in done.error
    assert before == []  # refused before the copy stage: no TransferStarted
    np.testing.assert_array_equal(served.block(device_block), device_before)
    np.testing.assert_array_equal(served.host, host_before)
    if kind == "write_back":
        served.set_states(BlockState.LOAD, device_block)
        assert served.run("prefetch", device=[device_block], keys=kwargs["keys"])[1].ok == [False]


@pytest.mark.parametrize(("kind", "kwargs", "message"), [
    ("teleport", {"device": [0]}, "unknown transfer kind"),
    ("swap_out", {"device": [0, 1], "host": [0]}, "2 device blocks but 1 host_block_ids"),
    ("swap_in", {"device": [NUM_DEVICE_BLOCKS], "host": [0]}, f"outside the pool of {NUM_DEVICE_BLOCKS}"),
    ("prefetch", {"device": [0, 0], "keys": ["x", "y"]}, "repeat a destination"),
])
def test_malformed_task_fails_and_process_keeps_serving(served: Instance, kind: str, kwargs: dict,
                                                        message: str) -> None:
    served.task_socket.send_pyobj("not a message")  # logged and dropped, no reply
    served.task_socket.send(b"\x80 not a pickle")  # undecodable: logged and dropped too
    _, done = served.run(kind, **kwargs)
    assert not any(done.ok) and len(done.ok) == max(len(v) for v in kwargs.values())
    assert message in done.error

    pattern = served.fill_block(1, seed=70)
    served.set_states(BlockState.SWAP_OUT, 1)
    assert served.run("swap_out", device=[1], host=[6])[1].ok == [True]
    np.testing.assert_array_equal(served.host[6], pattern)


def test_exits_on_worker_shutdown_and_unlinks_host_pool(fresh: Instance) -> None:
    fresh.start(sanitizer=False)
    assert fresh.host_segment_exists()
    fresh.task_socket.send_pyobj(WorkerShutdown("test"))
    assert fresh.wait_exit() == 0
    assert not fresh.host_segment_exists()
    assert fresh.signals.cache_transfer_ready.value[0] == 0


def test_exits_on_sigterm_and_unlinks_host_pool(fresh: Instance) -> None:
    fresh.start(sanitizer=False)
    # Sanitizer off: a block in the wrong state is copied (correctness rests on the engine).
    pattern = fresh.fill_block(0, seed=80)
    fresh.set_states(BlockState.IN_USE, 0)
    assert fresh.run("swap_out", device=[0], host=[1])[1].ok == [True]
    np.testing.assert_array_equal(fresh.host[1], pattern)

    os.kill(fresh.proc.pid, signal.SIGTERM)
    assert fresh.wait_exit() == 0
    assert not fresh.host_segment_exists()
    assert fresh.signals.cache_transfer_ready.value[0] == 0


def test_exits_when_its_parent_dies_and_unlinks_host_pool(fresh: Instance) -> None:
    fresh.start(sanitizer=False, via_parent=True)
    assert fresh.host_segment_exists()
    fresh.proc.kill()  # SIGKILL: the parent runs no clean-up of its own
    fresh.proc.join(EXIT_TIMEOUT_S)
    deadline = time.monotonic() + EXIT_TIMEOUT_S
    while process_alive(fresh.transfer_pid, None) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not process_alive(fresh.transfer_pid, None)
    assert not fresh.host_segment_exists()
    assert fresh.signals.cache_transfer_ready.value[0] == 0
