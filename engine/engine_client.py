"""The API server's handle on the engine process (asyncio + ZMQ).

Requests go out on one PUSH socket; one background task reads every
``RequestOutput`` batch the engine sends and hands each output to the queue of
its request. ``generate`` is an async iterator per request; leaving it early
(client gone, stop string hit) aborts the request in the engine so its blocks
are freed.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import AsyncIterator, Callable

import zmq
import zmq.asyncio

import envs
from engine.request import AbortRequest, ControlReply, ControlRequest, EngineRequest, RequestOutput
from engine.tokenizer import Tokenizer
from inter_communicator.instance_signals import InstanceSignals

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    pass


class EngineClient:
    def __init__(self, tokenizer: Tokenizer, requests_addr: str, outputs_addr: str, signals: InstanceSignals,
                 engine_alive: Callable[[], bool]) -> None:
        self.tokenizer = tokenizer
        self._requests_addr = requests_addr
        self._outputs_addr = outputs_addr
        self._signals = signals
        self._engine_alive = engine_alive
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
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

    @property
    def num_active_requests(self) -> int:
        return len(self._queues)

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
        if not self._engine_alive():
            raise EngineDeadError("the engine process is not running")
        if request.request_id in self._queues:
            raise ValueError(f"duplicate request id {request.request_id}")
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[request.request_id] = queue
        request.arrival_time = request.arrival_time or time.time()
        finished = False
        try:
            await self._push.send_pyobj(request)
            while not finished:
                output = await self._next_output(queue, request.request_id)
                finished = output.finished
                yield output
        finally:
            self._queues.pop(request.request_id, None)
            if not finished:
                await self.abort(request.request_id)

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
        if not self._engine_alive():
            raise EngineDeadError("the engine process is not running")
        request_id = f"control-{uuid.uuid4().hex}"
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        try:
            await self._push.send_pyobj(ControlRequest(request_id, command))
            reply: ControlReply = await asyncio.wait_for(queue.get(), timeout)
        finally:
            self._queues.pop(request_id, None)
        if reply.error:
            raise ValueError(reply.error)
        return reply.result

    async def abort(self, request_id: str) -> None:
        if self._push is not None and self._engine_alive():
            await self._push.send_pyobj(AbortRequest(request_id))

    def is_healthy(self) -> bool:
        return self.health()["status"] == "ok"

    def health(self) -> dict:
        now = time.time()
        engine_beat_age = now - float(self._signals.engine_heartbeat.value[0])
        worker_beat_ages = [now - float(t) for t in self._signals.worker_heartbeat.value]
        timeout = envs.FD_HEARTBEAT_TIMEOUT
        healthy = (
            self._engine_alive()
            and bool(self._signals.engine_ready.value[0])
            and all(bool(r) for r in self._signals.worker_ready.value)
            and engine_beat_age < timeout
            and all(age < timeout for age in worker_beat_ages)
        )
        return {
            "status": "ok" if healthy else "unhealthy",
            "engine": {"alive": self._engine_alive(), "ready": bool(self._signals.engine_ready.value[0]),
                       "heartbeat_age_s": round(engine_beat_age, 3)},
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
