"""Engine-side end of the cache transfer channel: send copy tasks, dispatch what comes back.

Decision (issue 10): the engine never blocks on a KV transfer. The KV cache's ``TransferPlanner``
issues every task asynchronously through ``submit``; the engine loop calls ``poll`` and the
client hands each ``TransferStarted`` / ``TransferDone`` to the cache manager's handlers. A
task's blocks stay quarantined in the cache manager until its ``TransferDone`` arrives or the
engine declares the transfer process dead or hung (it kills and restarts it, then
``fail_all_transfers`` releases every quarantined block), so a late completion always finds
its task and nothing is parked here. A task the socket cannot take yet (the process is still
connecting, or stopped reading) waits in a local backlog, flushed on every ``poll``;
``discard_backlog`` drops it when the process is replaced, since its transfers are failed then.

The upstream-named synchronous API (``issue_swap_task`` / ``sync_swap_task``,
``issue_write_back_storage_task``, ``issue_prefetch_storage_task``) had no caller in the
engine, reported a timeout as success and parked completions it was not waiting for, so it was
removed: no advertised API without a caller and a test.
"""
from __future__ import annotations

import logging
from collections import deque
from typing import Callable

import zmq

from inter_communicator.messages import TransferDone, TransferStarted, TransferTask

logger = logging.getLogger(__name__)

DoneHandler = Callable[[TransferDone], None]
StartedHandler = Callable[[int], None]


class CacheTransferClient:
    """Binds the task (PUSH) and completion (PULL) sockets the cache transfer process connects to."""

    def __init__(self, context: zmq.Context, task_addr: str, done_addr: str,
                 on_done: DoneHandler | None = None, on_started: StartedHandler | None = None) -> None:
        self.task_socket = context.socket(zmq.PUSH)
        self.task_socket.bind(task_addr)
        self.done_socket = context.socket(zmq.PULL)
        self.done_socket.bind(done_addr)
        self.on_done = on_done
        self.on_started = on_started
        self.dispatch_errors = 0
        self._backlog: deque[TransferTask] = deque()

    def submit(self, task: TransferTask) -> None:
        """Send ``task``, or keep it in the backlog if the socket cannot take it now; never blocks."""
        self._backlog.append(task)
        self._flush()

    def _flush(self) -> None:
        while self._backlog:
            try:
                self.task_socket.send_pyobj(self._backlog[0], flags=zmq.NOBLOCK)
            except zmq.Again:
                return  # no process connected, or its queue is full: retried on the next poll
            self._backlog.popleft()

    @property
    def backlog(self) -> int:
        """Tasks submitted but not yet handed to ZMQ."""
        return len(self._backlog)

    def discard_backlog(self) -> list[TransferTask]:
        """Forget unsent tasks (their process is being replaced and their transfers failed); returns them."""
        dropped = list(self._backlog)
        self._backlog.clear()
        return dropped

    def poll(self, timeout_ms: int = 0) -> int:
        """Dispatch every message that is ready (waiting up to ``timeout_ms`` for the first); returns the count.

        A handler that raises is logged with its traceback and the remaining messages are still
        dispatched: one bad completion must not strand the others. The task's sequences are then
        covered by the fill deadline (recomputed) and its blocks by the engine's transfer deadline.
        """
        self._flush()
        if timeout_ms and not self.done_socket.poll(timeout_ms):
            return 0
        handled = 0
        while True:
            try:
                message = self.done_socket.recv_pyobj(flags=zmq.NOBLOCK)
            except zmq.Again:
                return handled
            handled += 1
            try:
                self._dispatch(message)
            except Exception:  # contained: see the docstring
                self.dispatch_errors += 1
                logger.exception("handling %r from the cache transfer process failed", message)

    def _dispatch(self, message: object) -> None:
        if isinstance(message, TransferStarted):
            if self.on_started is not None:
                self.on_started(message.task_id)
        elif isinstance(message, TransferDone):
            if self.on_done is None:
                raise RuntimeError(f"completion of transfer {message.task_id} arrived but no handler is set")
            self.on_done(message)
        else:
            logger.error("unexpected message %s from the cache transfer process", type(message).__name__)

    def close(self) -> None:
        self.task_socket.close(linger=0)
        self.done_socket.close(linger=0)
