"""Engine-side handle on the cache transfer process(es): issue copy tasks, collect completions.

Keeps the upstream method names (``issue_swap_task`` / ``sync_swap_task``,
``issue_write_back_storage_task``, ``issue_prefetch_storage_task``). ``is_sync``
means "wait until the transfer process reports completion", bounded by a
timeout; a timed-out transfer is reported as a miss for every block and its
blocks stay quarantined by the PrefixCacheManager until the late completion
arrives, so a slow copy can never land in a reused block.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import zmq

from inter_communicator.messages import TransferDone, TransferStarted, TransferTask

logger = logging.getLogger(__name__)

DoneHandler = Callable[[TransferDone], None]
StartedHandler = Callable[[int], None]


class CacheTransferClient:
    def __init__(self, context: zmq.Context, task_addr: str, done_addr: str) -> None:
        self.task_socket = context.socket(zmq.PUSH)
        self.task_socket.bind(task_addr)
        self.done_socket = context.socket(zmq.PULL)
        self.done_socket.bind(done_addr)
        self.on_done: DoneHandler | None = None
        self.on_started: StartedHandler | None = None
        self._next_id = 1_000_000_000  # ids of direct calls never collide with the cache manager's
        self._completed: dict[int, TransferDone] = {}
        self._sync_waiting: set[int] = set()

    # ---- the cache manager's submit callback ---------------------------------------

    def submit(self, task: TransferTask) -> None:
        self.task_socket.send_pyobj(task)

    # ---- upstream-named API --------------------------------------------------------

    def issue_swap_task(self, kind: str, device_block_ids: list[int], host_block_ids: list[int],
                        is_sync: bool = False, timeout: float = 30.0) -> TransferDone | int:
        if kind not in ("swap_out", "swap_in"):
            raise ValueError(f"swap task kind must be 'swap_out' or 'swap_in', got {kind!r}")
        if len(device_block_ids) != len(host_block_ids):
            raise ValueError(f"{len(device_block_ids)} device blocks but {len(host_block_ids)} host blocks")
        return self._issue(TransferTask(self._new_id(), kind, device_block_ids=device_block_ids,
                                        host_block_ids=host_block_ids), is_sync, timeout)

    def sync_swap_task(self, task_id: int, timeout: float = 30.0) -> TransferDone:
        return self.wait(task_id, timeout)

    def issue_write_back_storage_task(self, device_block_ids: list[int], storage_keys: list[str],
                                      is_sync: bool = False, timeout: float = 30.0) -> TransferDone | int:
        return self._issue(TransferTask(self._new_id(), "write_back", device_block_ids=device_block_ids,
                                        storage_keys=storage_keys), is_sync, timeout)

    def issue_prefetch_storage_task(self, storage_keys: list[str], device_block_ids: list[int],
                                    is_sync: bool = False, timeout: float = 30.0) -> TransferDone | int:
        return self._issue(TransferTask(self._new_id(), "prefetch", device_block_ids=device_block_ids,
                                        storage_keys=storage_keys), is_sync, timeout)

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _issue(self, task: TransferTask, is_sync: bool, timeout: float) -> TransferDone | int:
        self._sync_waiting.add(task.task_id)
        self.submit(task)
        if not is_sync:
            return task.task_id
        return self.wait(task.task_id, timeout)

    def wait(self, task_id: int, timeout: float) -> TransferDone:
        """Block (on the socket, not spinning) until ``task_id`` completes; a timeout is a miss."""
        deadline = time.monotonic() + timeout
        while task_id not in self._completed:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._sync_waiting.discard(task_id)
                logger.warning("transfer %d did not complete within %.1f s; treating it as a miss", task_id, timeout)
                return TransferDone(task_id, "timeout", ok=[], error=f"timed out after {timeout:.1f} s")
            self.poll(int(min(remaining, 1.0) * 1000))
        self._sync_waiting.discard(task_id)
        return self._completed.pop(task_id)

    # ---- completions -----------------------------------------------------------------

    def poll(self, timeout_ms: int = 0) -> int:
        """Handle every message that is ready (waiting up to ``timeout_ms`` for the first)."""
        handled = 0
        if timeout_ms and not self.done_socket.poll(timeout_ms):
            return 0
        while True:
            try:
                message = self.done_socket.recv_pyobj(flags=zmq.NOBLOCK)
            except zmq.Again:
                return handled
            handled += 1
            self._dispatch(message)

    def _dispatch(self, message: object) -> None:
        if isinstance(message, TransferStarted):
            if self.on_started is not None:
                self.on_started(message.task_id)
        elif isinstance(message, TransferDone):
            if message.task_id in self._sync_waiting:
                self._completed[message.task_id] = message
            elif self.on_done is not None:
                self.on_done(message)
        else:
            logger.error("unexpected message %s from the cache transfer process", type(message).__name__)

    def close(self) -> None:
        self.task_socket.close(linger=0)
        self.done_socket.close(linger=0)
