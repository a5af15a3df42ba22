"""The API server's handle on the engine process of one DP rank (asyncio + ZMQ).

Requests go out on one PUSH socket; one background task reads every
``RequestOutput`` batch the engine sends and hands each output to the queue of
its request. ``generate`` is an async iterator per request; leaving it early
(client gone, stop string hit) aborts the request in the engine so its blocks
are freed.

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
from typing import AsyncIterator, Protocol

import zmq
import zmq.asyncio

import envs
from engine.request import AbortRequest, ControlReply, ControlRequest, EngineRequest, RequestOutput
from engine.entrypoints.tokenizer import Tokenizer
from inter_communicator.instance_signals import InstanceSignals

logger = logging.getLogger(__name__)

_CONTROL_PREFIX = "control-"
# Longest wait for the engine's socket before a request is refused with 503.
SEND_TIMEOUT_S = 5.0


class EngineDeadError(RuntimeError):
    pass


class EngineUnavailableError(EngineDeadError):
    """This rank takes no requests now (restarting, down, or the server is stopping): HTTP 503."""


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
    def __init__(self, tokenizer: Tokenizer, requests_addr: str, outputs_addr: str, signals: InstanceSignals,
                 engine: EngineProcessView, dp_rank: int = 0) -> None:
        self.tokenizer = tokenizer
        self.dp_rank = dp_rank
        self._requests_addr = requests_addr
        self._outputs_addr = outputs_addr
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

    async def start(self) -> None:
        self._context = zmq.asyncio.Context()
        self._push = self._context.socket(zmq.PUSH)
        self._push.connect(self._requests_addr)
        self._pull = self._context.socket(zmq.PULL)
        self._pull.connect(self._outputs_addr)
        self._reader = asyncio.create_task(self._read_outputs())

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except asyncio.CancelledError:
                logger.debug("output reader stopped")
        for sock in (self._push, self._pull):
            if sock is not None:
                sock.close(linger=0)
        if self._context is not None:
            self._context.term()

    async def _read_outputs(self) -> None:
        while True:
            outputs: list[RequestOutput] = await self._pull.recv_pyobj()
            for output in outputs:
                queue = self._queues.get(output.request_id)
                if queue is not None:
                    queue.put_nowait(output)

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
        """End every request in flight with an error output ``reason``; returns how many."""
        for request_id, queue in list(self._queues.items()):
            if request_id.startswith(_CONTROL_PREFIX):
                queue.put_nowait(ControlReply(request_id, {}, error=reason))
            else:
                queue.put_nowait(RequestOutput(request_id, [], finished=True, finish_reason="error", error=reason))
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

    def ipc_identity(self) -> tuple[str, int]:
        """(instance id, DP rank) of the engine, for attaching its other IPC objects (the kvcache lock)."""
        # Names are fd.<instance>.<name>.<rank> and no part may contain a dot (shm.ipc_name).
        parts = self._signals.engine_stats.shm_name.split(".")
        if len(parts) != 4 or parts[0] != "fd" or not parts[3].isdigit():
            raise ValueError(f"unexpected IPC name {self._signals.engine_stats.shm_name!r}")
        return parts[1], int(parts[3])

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        if not self.accepting:
            raise EngineUnavailableError(self.unavailable_reason())
        if request.request_id in self._queues:
            raise ValueError(f"duplicate request id {request.request_id}")
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._register(request.request_id, queue)
        request.arrival_time = request.arrival_time or time.time()
        finished = False
        try:
            await self._send(request)
            while not finished:
                output = await self._next_output(queue, request.request_id)
                finished = output.finished
                yield output
        finally:
            self._unregister(request.request_id)
            if not finished:
                await self.abort(request.request_id)

    async def _send(self, message: object) -> None:
        """Queue ``message`` for the engine; ``EngineUnavailableError`` if it cannot be queued in time.

        A PUSH socket with no connected engine (it died a moment ago) would block a plain send
        until the next engine binds; this waits at most ``SEND_TIMEOUT_S``.
        """
        try:
            await self._push.send_pyobj(message, flags=zmq.NOBLOCK)
            return
        except zmq.Again:
            logger.debug("the engine of DP rank %d is not connected; waiting up to %.0f s", self.dp_rank,
                         SEND_TIMEOUT_S)
        if await self._push.poll(int(SEND_TIMEOUT_S * 1000), zmq.POLLOUT):
            try:
                await self._push.send_pyobj(message, flags=zmq.NOBLOCK)
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

    async def control(self, command: str, timeout: float = 30.0) -> dict:
        """Run an engine command (``reset_prefix_cache``, ``cache_stats``) and return its result."""
        if not self.accepting:
            raise EngineUnavailableError(self.unavailable_reason())
        request_id = f"{_CONTROL_PREFIX}{uuid.uuid4().hex}"
        queue: asyncio.Queue = asyncio.Queue()
        self._register(request_id, queue)
        try:
            await self._send(ControlRequest(request_id, command))
            reply: ControlReply = await asyncio.wait_for(queue.get(), timeout)
        finally:
            self._unregister(request_id)
        if reply.error:
            raise ValueError(reply.error)
        return reply.result

    async def abort(self, request_id: str) -> None:
        # Only a running engine knows the request; a restarting one has no peer socket yet, and
        # a blocking send there would hang the caller's (shielded) clean-up.
        if self._push is None or self._engine.state != STATE_RUNNING or not self._engine_alive():
            return
        try:
            await self._push.send_pyobj(AbortRequest(request_id), flags=zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("could not queue the abort of %s: the engine is not connected", request_id)

    def is_healthy(self) -> bool:
        return self.health()["status"] == "ok"

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
