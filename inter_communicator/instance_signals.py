"""Shared-memory signals of one server instance: readiness and heartbeats.

launch.py creates them (and unlinks them on every exit path); the engine and
worker processes attach. Each element has a single writer: worker_* entries are
written by the worker of that TP rank, engine_* by the engine.
"""
from __future__ import annotations

import numpy as np

from config.engine_config import EngineConfig
from inter_communicator.ipc_signal import IPCSignal

# Engine gauges published after every step (single writer: the engine), read by /health.
ENGINE_STATS = ("num_running", "num_waiting", "kv_blocks_used", "kv_blocks_total", "num_preemptions", "num_steps",
                "worker_restarts", "cache_transfer_restarts")


class InstanceSignals:
    """The signals of one DP rank, created by launch.py and attached by the engine and workers."""

    def __init__(self, config: EngineConfig, create: bool) -> None:
        tp = config.parallel.tensor_parallel_size
        kwargs = dict(instance_id=config.instance_id, dp_rank=config.parallel.dp_rank, create=create)
        self.worker_ready = IPCSignal("worker_ready", np.zeros(tp, dtype=np.int32), **kwargs)
        self.worker_heartbeat = IPCSignal("worker_heartbeat", np.zeros(tp, dtype=np.float64), **kwargs)
        self.engine_ready = IPCSignal("engine_ready", np.zeros(1, dtype=np.int32), **kwargs)
        self.engine_heartbeat = IPCSignal("engine_heartbeat", np.zeros(1, dtype=np.float64), **kwargs)
        # Block states of the device pool (engine writes; worker and transfer process check under the sanitizer).
        self.block_states = IPCSignal("block_states", np.zeros(config.cache.num_gpu_blocks, dtype=np.int8), **kwargs)
        self.cache_transfer_ready = IPCSignal("cache_transfer_ready", np.zeros(tp, dtype=np.int32), **kwargs)
        self.cache_transfer_heartbeat = IPCSignal("cache_transfer_heartbeat", np.zeros(tp, dtype=np.float64),
                                                  **kwargs)
        # Pids of the engine's children, written by the engine (health reporting, fault tests).
        self.worker_pid = IPCSignal("worker_pid", np.zeros(tp, dtype=np.int64), **kwargs)
        self.cache_transfer_pid = IPCSignal("cache_transfer_pid", np.zeros(tp, dtype=np.int64), **kwargs)
        self.engine_stats = IPCSignal("engine_stats", np.zeros(len(ENGINE_STATS), dtype=np.int64), **kwargs)
        self._all = [self.worker_ready, self.worker_heartbeat, self.engine_ready, self.engine_heartbeat,
                     self.engine_stats, self.block_states, self.cache_transfer_ready, self.cache_transfer_heartbeat,
                     self.worker_pid, self.cache_transfer_pid]

    def stats(self) -> dict[str, int]:
        return {name: int(value) for name, value in zip(ENGINE_STATS, self.engine_stats.value)}

    def close(self) -> None:
        for signal in self._all:
            signal.close()

    def unlink(self) -> None:
        for signal in self._all:
            signal.unlink()
