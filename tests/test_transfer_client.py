"""The engine's transfer client against a real CacheTransferManager over real ZMQ ipc sockets.

The manager serves in a thread of the test process (the same code ``run_cache_transfer`` runs), on
real shared-memory device and host pools; the test checks the bytes that moved, the order and
content of the messages the client dispatched, and the heartbeat the engine judges hangs by.
"""
from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import zmq

from cache_manager.cache_transfer_manager import CacheTransferManager
from cache_manager.kv_layout import device_cache_segment, device_cache_shape
from cache_manager.transfer_client import CacheTransferClient
from config.engine_config import EngineArgs, EngineConfig, build_engine_config
from inter_communicator.instance_signals import InstanceSignals
from inter_communicator.messages import TransferDone, TransferTask
from inter_communicator.shm import SharedArray, sweep_stale

TIMEOUT_S = 20.0
NUM_DEVICE_BLOCKS = 4
SWAP_SPACE_GIB = 0.02


class Rig:
    """Instance signals, a device pool, a client and a manager serving in a thread."""

    def __init__(self, tmp_path: Path, base: EngineConfig) -> None:
        self.config = dataclasses.replace(base, instance_id=f"tc-{uuid.uuid4().hex[:10]}")
        self.task_addr, self.done_addr = f"ipc://{tmp_path}/tasks", f"ipc://{tmp_path}/done"
        self.context = zmq.Context()
        self.events: list[object] = []
        self.manager: CacheTransferManager | None = None
        self.thread: threading.Thread | None = None
        self.signals = InstanceSignals(self.config, create=True)
        self.device_segment: SharedArray | None = None
        try:
            self.device_segment = SharedArray(
                device_cache_segment(self.config.instance_id, 0, 0),
                device_cache_shape(self.config.model, NUM_DEVICE_BLOCKS, self.config.cache.block_size), np.float32,
                create=True)
            self.client = CacheTransferClient(self.context, self.task_addr, self.done_addr,
                                              on_done=self.events.append,
                                              on_started=lambda task_id: self.events.append(("started", task_id)))
        except BaseException:
            self.close()
            raise

    def start_manager(self) -> CacheTransferManager:
        self.manager = CacheTransferManager(self.config, 0, self.task_addr, self.done_addr)
        self.thread = threading.Thread(target=self.manager.serve, daemon=True)
        self.thread.start()
        return self.manager

    @property
    def device(self) -> np.ndarray:
        return self.device_segment.array

    def wait_done(self, task_ids: set[int]) -> dict[int, TransferDone]:
        deadline = time.monotonic() + TIMEOUT_S
        while not task_ids <= {e.task_id for e in self.events if isinstance(e, TransferDone)}:
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"no completion of {task_ids} within {TIMEOUT_S} s: {self.events}"
            self.client.poll(int(min(remaining, 1.0) * 1000))
        return {e.task_id: e for e in self.events if isinstance(e, TransferDone)}

    def close(self) -> None:
        if self.manager is not None:
            self.manager.stop_event.set()
            self.thread.join(10)
            self.manager.close()
        if getattr(self, "client", None) is not None:
            self.client.close()
        self.context.term()
        if self.device_segment is not None:
            self.device_segment.close()
            self.device_segment.unlink()
        self.signals.close()
        self.signals.unlink()
        sweep_stale(self.config.instance_id)


@pytest.fixture(scope="module")
def base_config() -> EngineConfig:
    return build_engine_config(EngineArgs(num_gpu_blocks_override=NUM_DEVICE_BLOCKS, swap_space=SWAP_SPACE_GIB))


@pytest.fixture
def rig(tmp_path: Path, base_config: EngineConfig) -> Iterator[Rig]:
    made = Rig(tmp_path, base_config)
    try:
        yield made
    finally:
        made.close()


def test_swap_out_and_in_round_trip_through_the_client(rig):
    rig.start_manager()
    rng = np.random.default_rng(0)
    original = rng.standard_normal(rig.device[:, :, 0:2].shape).astype(np.float32)
    rig.device[:, :, 0:2] = original
    rig.client.submit(TransferTask(1, "swap_out", device_block_ids=[0, 1], host_block_ids=[3, 4]))
    assert rig.wait_done({1})[1].ok == [True, True]
    rig.device[:, :, 0:2] = 0.0
    rig.client.submit(TransferTask(2, "swap_in", device_block_ids=[1, 0], host_block_ids=[3, 4]))
    done = rig.wait_done({2})[2]
    assert done.ok == [True, True] and done.error is None
    np.testing.assert_array_equal(rig.device[:, :, 1], original[:, :, 0])
    np.testing.assert_array_equal(rig.device[:, :, 0], original[:, :, 1])
    # A fill is announced before it completes (the early-schedule fault mode relies on it).
    assert rig.events.index(("started", 2)) < rig.events.index(done)


def test_a_failing_task_is_a_distinct_failed_result(rig):
    rig.start_manager()
    rig.client.submit(TransferTask(7, "write_back", device_block_ids=[0], storage_keys=["k"]))  # no storage tier
    done = rig.wait_done({7})[7]
    assert done.ok == [False] and "storage backend" in done.error


def test_a_raising_handler_does_not_strand_the_other_completions(rig):
    rig.start_manager()
    handled: list[int] = []

    def on_done(done: TransferDone) -> None:
        if done.task_id == 1:
            raise KeyError("bookkeeping bug")
        handled.append(done.task_id)
        rig.events.append(done)

    rig.client.on_done = on_done
    rig.client.submit(TransferTask(1, "swap_out", device_block_ids=[0], host_block_ids=[0]))
    rig.client.submit(TransferTask(2, "swap_out", device_block_ids=[1], host_block_ids=[1]))
    rig.wait_done({2})
    assert handled == [2] and rig.client.dispatch_errors == 1


def test_a_task_submitted_before_the_process_connects_waits_and_is_delivered(rig):
    started = time.monotonic()
    rig.client.submit(TransferTask(1, "swap_out", device_block_ids=[0], host_block_ids=[0]))
    assert time.monotonic() - started < 1.0  # never blocks the engine loop
    assert rig.client.backlog == 1
    rig.start_manager()
    assert rig.wait_done({1})[1].ok == [True]
    assert rig.client.backlog == 0


def test_a_discarded_backlog_is_never_run(rig):
    rig.client.submit(TransferTask(1, "swap_out", device_block_ids=[0], host_block_ids=[0]))
    assert [t.task_id for t in rig.client.discard_backlog()] == [1]
    rig.start_manager()
    rig.client.submit(TransferTask(2, "swap_out", device_block_ids=[1], host_block_ids=[1]))
    rig.wait_done({2})
    assert [e.task_id for e in rig.events if isinstance(e, TransferDone)] == [2]


def test_heartbeat_stands_still_while_a_task_runs(rig, monkeypatch):
    monkeypatch.setenv("FD_KVCACHE_FAULT_SLOW_FILL_S", "2.0")  # the swap-in sleeps 2 s after announcing itself
    rig.start_manager()
    beat = rig.signals.cache_transfer_heartbeat.value
    time.sleep(1.2)
    idle_age = time.time() - float(beat[0])
    assert idle_age < 1.0  # idle: the thread stamps every 0.5 s
    rig.client.submit(TransferTask(1, "swap_in", device_block_ids=[0], host_block_ids=[0]))
    deadline = time.monotonic() + TIMEOUT_S
    while ("started", 1) not in rig.events:
        assert time.monotonic() < deadline
        rig.client.poll(500)
    time.sleep(1.5)
    assert time.time() - float(beat[0]) > 1.4  # busy for 1.5 s+: the stamp kept the task's start time
    rig.wait_done({1})
    time.sleep(0.2)
    assert time.time() - float(beat[0]) < 1.0  # progressing again
