"""The API server's handle on the engine process of one DP rank (asyncio + ZMQ).

Requests go out on one PUSH socket; one background task reads every
``RequestOutput`` batch the engine sends and hands each output to the queue of
its request. ``generate`` is an async iterator per request; leaving it early
(client gone, stop string hit) aborts the request in the engine so its blocks
are freed. Control commands (``reset_prefix_cache``, ``cache_stats``) have their own
channel (``EngineAddresses.control_requests`` / ``control_replies``), their own reader and
their own map of pending replies: they never mix with request outputs.

Engine state, one path: everything the API server reports about an engine (``/health``,
``/metrics``, ``/v1/cache/stats``) is read through this client, which knows its instance id
and DP rank:

- ``engine_stats()``: the scheduler gauges and counters from the ``ENGINE_STATS`` shared
  memory (no message: answers even while the engine is busy in a step);
- ``cache_stats()``: the prefix cache's counters, asked from the engine on the control channel
  (answered between steps), plus this rank's KV-cache lock record;
- ``kvcache_lock_stats()``: the KV-cache lock's shared record of this rank (read without the
  lock, never blocks), when ``FD_USE_KVCACHE_LOCK`` is on. ``DPRouter`` gives the same calls
  across every rank, keyed or labelled by DP rank.

A request with ``n`` choices gets outputs tagged with their choice ``index``; its iterator ends
once every choice finished (an error output ends it at once), and leaving it early aborts
the whole request (every choice).

The engine process itself is supervised by launch.py (``EngineProcessView``): while it
restarts, is down for good, or the server is stopping, ``generate`` refuses new requests
with ``EngineUnavailableError`` (HTTP 503), and ``fail_all`` ends every request in flight
with an error output (the engine that had them is gone, or the drain deadline passed).
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any, AsyncIterator, Protocol

import zmq
import zmq.asyncio

import envs
from engine.tokenizer import Tokenizer
from engine.request import (CACHE_STATS, RESET_PREFIX_CACHE, AbortRequest, CacheStatsReply, ControlError,
                            ControlReply, ControlRequest, EngineRequest, RequestOutput, ResetPrefixCacheReply)
from inter_communicator.instance_signals import InstanceSignals
from inter_communicator.kvcache_lock import KVCacheLock

if TYPE_CHECKING:
    from engine.engine_process import EngineAddresses

logger = logging.getLogger(__name__)

# Longest wait for a control reply unless the caller gives its own.
CONTROL_TIMEOUT_S = 30.0
# Longest wait for the engine's socket before a request is refused with 503.
SEND_TIMEOUT_S = 5.0


class EngineDeadError(RuntimeError):
    pass


class EngineUnavailableError(EngineDeadError):
    """This rank takes no requests now (restarting, down, or the server is stopping): HTTP 503."""


class EngineControlError(RuntimeError):
    """A control command failed in the engine, or was ended before its reply (HTTP 500)."""


# EngineProcessView.state values.
STATE_STARTING = "starting"
STATE_RUNNING = "running"
STATE_RESTARTING = "restarting"
STATE_DOWN = "down"
STATE_STOPPING = "stopping"


class EngineProcessView(Protocol):
    """What the client needs from launch.py's supervisor of one engine process."""

    @property
    def state(self) -> str: ...

    @property
    def pid(self) -> int | None: ...

    @property
    def restarts(self) -> int: ...

    def alive(self) -> bool: ...


class EngineClient:
    """The engine of DP rank ``dp_rank`` of instance ``instance_id``, reached at ``addresses``."""

    def __init__(self, tokenizer: Tokenizer, addresses: EngineAddresses, signals: InstanceSignals,
                 engine: EngineProcessView, *, instance_id: str, dp_rank: int,
                 kvcache_lock_enabled: bool | None = None) -> None:
        self.tokenizer = tokenizer
        self.instance_id = instance_id
        self.dp_rank = dp_rank
        self._addresses = addresses
        self._signals = signals
        self._engine = engine
        self._stopping = False
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        # Set while no request is in flight (the shutdown drain waits on it).
        self._idle = asyncio.Event()
        self._idle.set()
        self._context: zmq.asyncio.Context | None = None
        self._push: zmq.asyncio.Socket | None = None
        self._pull: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task | None = None
        self._control_push: zmq.asyncio.Socket | None = None
        self._control_pull: zmq.asyncio.Socket | None = None
        self._control_reader: asyncio.Task | None = None
        self._pending_control: dict[str, asyncio.Future[ControlReply]] = {}
        self._lock_enabled = envs.FD_USE_KVCACHE_LOCK if kvcache_lock_enabled is None else kvcache_lock_enabled
        self._lock: KVCacheLock | None = None
        self._lock_attach_logged = False

    async def start(self) -> None:
        self._context = zmq.asyncio.Context()
        self._push = self._context.socket(zmq.PUSH)
        self._push.connect(self._addresses.requests)
        self._pull = self._context.socket(zmq.PULL)
        self._pull.connect(self._addresses.outputs)
        self._control_push = self._context.socket(zmq.PUSH)
        self._control_push.connect(self._addresses.control_requests)
        self._control_pull = self._context.socket(zmq.PULL)
        self._control_pull.connect(self._addresses.control_replies)
        self._reader = asyncio.create_task(self._read_outputs())
        self._control_reader = asyncio.create_task(self._read_control_replies())

    async def close(self) -> None:
        for reader in (self._reader, self._control_reader):
            if reader is not None:
                reader.cancel()
                try:
                    await reader
                except asyncio.CancelledError:
                    logger.debug("reader task stopped")
        for sock in (self._push, self._pull, self._control_push, self._control_pull):
            if sock is not None:
                sock.close(linger=0)
        if self._context is not None:
            self._context.term()
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    async def _read_outputs(self) -> None:
        while True:
            outputs: list[RequestOutput] = await self._pull.recv_pyobj()
            for output in outputs:
                queue = self._queues.get(output.request_id)
                if queue is not None:
                    queue.put_nowait(output)

    async def _read_control_replies(self) -> None:
        while True:
            reply: ControlReply = await self._control_pull.recv_pyobj()
            pending = self._pending_control.get(reply.request_id)
            if pending is None or pending.done():
                # Its caller timed out or was failed already.
                logger.info("late control reply %s dropped", reply.request_id)
                continue
            pending.set_result(reply)

    def _engine_alive(self) -> bool:
        return self._engine.alive()

    @property
    def num_active_requests(self) -> int:
        return len(self._queues)

    @property
    def accepting(self) -> bool:
        """True if a new request would be sent to a running engine."""
        return not self._stopping and self._engine.state == STATE_RUNNING and self._engine.alive()

    def unavailable_reason(self) -> str:
        """Why ``accepting`` is False (for the 503 message)."""
        state = self._engine.state
        if self._stopping or state == STATE_STOPPING:
            return "the server is shutting down"
        if state == STATE_DOWN:
            return (f"the engine of DP rank {self.dp_rank} failed too often and was not restarted; "
                    "the server needs a restart")
        if state in (STATE_RESTARTING, STATE_STARTING) or not self._engine.alive():
            return f"the engine of DP rank {self.dp_rank} is restarting after a failure; retry in a few seconds"
        return "the engine is available"

    def stop_accepting(self) -> None:
        """Refuse new requests from now on (shutdown); requests in flight go on."""
        self._stopping = True

    def engine_restarts(self) -> dict[int, int]:
        """Engine process restarts by DP rank."""
        return {self.dp_rank: self._engine.restarts}

    def fail_all(self, reason: str) -> int:
        """End every request in flight with an error output ``reason`` (and every pending control
        command with ``EngineControlError``); returns how many requests."""
        for request_id, queue in list(self._queues.items()):
            queue.put_nowait(RequestOutput(request_id, [], finished=True, finish_reason="error", error=reason))
        for pending in self._pending_control.values():
            if not pending.done():
                pending.set_exception(EngineControlError(reason))
        return len(self._queues)

    async def wait_idle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s until no request is in flight; True if none is."""
        if not self._queues:
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return not self._queues
        return True

    def _register(self, request_id: str, queue: asyncio.Queue) -> None:
        self._queues[request_id] = queue
        self._idle.clear()

    def _unregister(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        if not self._queues:
            self._idle.set()

    def engine_stats(self) -> dict[str, int]:
        """The engine's gauges from shared memory, by ``ENGINE_STATS`` name (read without a message)."""
        return self._signals.stats()

    def kvcache_lock_stats(self) -> dict[int, dict[str, Any] | None]:
        """``{dp_rank: KVCacheLock.stats()}`` of this rank; the stats are None while the lock is off
        or cannot be attached yet."""
        lock = self._attached_lock()
        return {self.dp_rank: None if lock is None else lock.stats()}

    def _attached_lock(self) -> KVCacheLock | None:
        if not self._lock_enabled:
            return None
        if self._lock is None:
            try:
                # launch.py creates the lock of each rank before its engine; this handle only reads.
                self._lock = KVCacheLock.attach(self.instance_id, self.dp_rank, role="metrics")
            except (FileNotFoundError, ValueError, OSError) as exc:
                # Retried on the next read; logged once so a scraper does not flood the log.
                if not self._lock_attach_logged:
                    logger.warning("cannot attach the kvcache lock of DP rank %d yet: %s", self.dp_rank, exc)
                    self._lock_attach_logged = True
                return None
        return self._lock

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        if not self.accepting:
            raise EngineUnavailableError(self.unavailable_reason())
        if request.request_id in self._queues:
            raise ValueError(f"duplicate request id {request.request_id}")
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._register(request.request_id, queue)
        request.arrival_time = request.arrival_time or time.time()
        # With n > 1 choices, ``finished`` is per choice: the request ends when all n finished (or on an error).
        num_choices = max(1, request.sampling_params.n)
        finished_choices: set[int] = set()
        finished = False
        try:
            await self._send(self._push, request)
            while not finished:
                output = await self._next_output(queue, request.request_id)
                if output.finished:
                    finished_choices.add(output.index)
                    finished = output.finish_reason == "error" or len(finished_choices) >= num_choices
                yield output
        finally:
            self._unregister(request.request_id)
            if not finished:
                await self.abort(request.request_id)

    async def _send(self, sock: zmq.asyncio.Socket, message: object) -> None:
        """Queue ``message`` for the engine; ``EngineUnavailableError`` if it cannot be queued in time.

        A PUSH socket with no connected engine (it died a moment ago) would block a plain send
        until the next engine binds; this waits at most ``SEND_TIMEOUT_S``.
        """
        try:
            await sock.send_pyobj(message, flags=zmq.NOBLOCK)
            return
        except zmq.Again:
            logger.debug("the engine of DP rank %d is not connected; waiting up to %.0f s", self.dp_rank,
                         SEND_TIMEOUT_S)
        if await sock.poll(int(SEND_TIMEOUT_S * 1000), zmq.POLLOUT):
            try:
                await sock.send_pyobj(message, flags=zmq.NOBLOCK)
                return
            except zmq.Again:
                logger.debug("the engine of DP rank %d went away again", self.dp_rank)
        raise EngineUnavailableError(f"the engine of DP rank {self.dp_rank} is not reachable; retry in a few seconds")

    async def _next_output(self, queue: asyncio.Queue[RequestOutput], request_id: str) -> RequestOutput:
        # Wake up now and then to notice an engine that died without answering.
        while True:
            try:
                return await asyncio.wait_for(queue.get(), timeout=1.0)
            except asyncio.TimeoutError:
                if not self._engine_alive():
                    return RequestOutput(request_id, [], finished=True, finish_reason="error",
                                         error="the engine process died")

    async def reset_prefix_cache(self, timeout: float = CONTROL_TIMEOUT_S) -> dict[str, Any]:
        """Drop the engine's device and host cached prefixes; ``{"dropped_blocks": n}``."""
        reply = await self._control(RESET_PREFIX_CACHE, ResetPrefixCacheReply, timeout)
        return reply.to_json()

    async def cache_stats(self, timeout: float = CONTROL_TIMEOUT_S) -> dict[str, Any]:
        """The engine's prefix-cache counters by name, ``dp_rank``, and ``kvcache_lock`` when the lock is on."""
        reply = await self._control(CACHE_STATS, CacheStatsReply, timeout)
        stats = reply.to_json()
        stats["dp_rank"] = self.dp_rank
        lock = self.kvcache_lock_stats().get(self.dp_rank)
        if lock is not None:
            stats["kvcache_lock"] = lock
        return stats

    async def _control(self, command: str, reply_type: type, timeout: float) -> Any:
        """Send ``command`` on the control channel; its reply, of ``reply_type``.

        ``EngineUnavailableError`` if the engine takes no commands now, ``EngineControlError`` if
        the engine reports a failure, ``asyncio.TimeoutError`` after ``timeout`` s.
        """
        if not self.accepting:
            raise EngineUnavailableError(self.unavailable_reason())
        request_id = f"control-{uuid.uuid4().hex}"
        pending: asyncio.Future[ControlReply] = asyncio.get_running_loop().create_future()
        self._pending_control[request_id] = pending
        try:
            await self._send(self._control_push, ControlRequest(request_id, command))
            reply = await asyncio.wait_for(pending, timeout)
        finally:
            self._pending_control.pop(request_id, None)
        if isinstance(reply, ControlError):
            raise EngineControlError(reply.error)
        if not isinstance(reply, reply_type):
            raise EngineControlError(f"the engine answered {command} with a {type(reply).__name__}")
        return reply

    async def abort(self, request_id: str) -> None:
        # Only a running engine knows the request; a restarting one has no peer socket yet, and
        # a blocking send there would hang the caller's (shielded) clean-up.
        if self._push is None or self._engine.state != STATE_RUNNING or not self._engine_alive():
            return
        try:
            await self._push.send_pyobj(AbortRequest(request_id), flags=zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("could not queue the abort of %s: the engine is not connected", request_id)

    def health(self) -> dict:
        now = time.time()
        engine_beat_age = now - float(self._signals.engine_heartbeat.value[0])
        worker_beat_ages = [now - float(t) for t in self._signals.worker_heartbeat.value]
        timeout = envs.FD_HEARTBEAT_TIMEOUT
        state = self._engine.state
        healthy = (
            self._engine_alive()
            and state == STATE_RUNNING
            and bool(self._signals.engine_ready.value[0])
            and all(bool(r) for r in self._signals.worker_ready.value)
            and engine_beat_age < timeout
            and all(age < timeout for age in worker_beat_ages)
        )
        return {
            "status": "ok" if healthy else "unhealthy",
            "engine": {"alive": self._engine_alive(), "ready": bool(self._signals.engine_ready.value[0]),
                       "heartbeat_age_s": round(engine_beat_age, 3), "pid": self._engine.pid, "state": state,
                       "restarts": self._engine.restarts},
            "engine_restarts": self._engine.restarts,
            "workers": [{"rank": rank, "ready": bool(ready), "heartbeat_age_s": round(age, 3), "pid": int(pid)}
                        for rank, (ready, age, pid) in enumerate(zip(self._signals.worker_ready.value,
                                                                     worker_beat_ages, self._signals.worker_pid.value))],
            "cache_transfer": [{"rank": rank, "ready": bool(ready), "pid": int(pid)}
                               for rank, (ready, pid) in enumerate(zip(self._signals.cache_transfer_ready.value,
                                                                       self._signals.cache_transfer_pid.value))
                               if pid],
            "active_requests": self.num_active_requests,
            "scheduler": self._signals.stats(),
        }
