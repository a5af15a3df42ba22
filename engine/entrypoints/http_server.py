"""The HTTP server process part: uvicorn running the API server's ASGI app.

Owns: ``ApiServer`` (uvicorn's server, stoppable from a signal handler with ``request_stop``)
and ``create_server`` (its configuration: log level from ``envs.FD_LOG_LEVEL``, no access log);
``run_until_disconnect``, which cancels a request's work when its client goes away (the API server
and the router both use it).
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Awaitable, Callable, TypeVar

import uvicorn
from fastapi import FastAPI, Request

import envs


class ApiServer(uvicorn.Server):
    """uvicorn's server, stoppable with ``request_stop()`` (safe from a signal handler).

    With ``handle_signals=False`` uvicorn leaves SIGINT/SIGTERM alone, so the caller's own
    handlers decide when to call ``request_stop``.
    """

    def __init__(self, config: uvicorn.Config, handle_signals: bool = True) -> None:
        super().__init__(config)
        self._handle_signals = handle_signals

    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        if self._handle_signals:
            with super().capture_signals():
                yield
        else:
            yield

    def request_stop(self) -> None:
        """Begin a graceful shutdown; ``run``/``serve`` return once it is done."""
        self.should_exit = True


def create_server(app: FastAPI, host: str, port: int, *, access_log: bool = False, handle_signals: bool = True,
                  timeout_graceful_shutdown: float = 5.0) -> ApiServer:
    """An ``ApiServer`` for ``app``; logs at ``envs.FD_LOG_LEVEL``, no access log by default.

    The ASGI lifespan protocol is off: the app has no startup or shutdown handlers (the processes are started
    and stopped by launch.py), and on a forced exit (a second Ctrl-C) uvicorn left the lifespan task to be
    cancelled at loop teardown, which it logged as an error with a CancelledError traceback.
    """
    config = uvicorn.Config(app, host=host, port=port, log_level=envs.FD_LOG_LEVEL.lower(), access_log=access_log,
                            timeout_graceful_shutdown=int(timeout_graceful_shutdown), lifespan="off")
    return ApiServer(config, handle_signals=handle_signals)


T = TypeVar("T")


async def run_until_disconnect(request: Request, work: Callable[[], Awaitable[T]]) -> tuple[bool, T | None]:
    """Run ``work()``; cancel it if the HTTP client disconnects first.

    Returns ``(True, its result)`` when it completed (what it raised is re-raised), ``(False, None)`` when
    the client went away first and ``work`` was cancelled (its cleanup ran: engine aborts, backend closes).
    Call it after the request body is read.
    """
    work_task = asyncio.ensure_future(work())
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work_task.done():
            work_task.cancel()
            await asyncio.wait({work_task})
    if work_task.cancelled():
        return False, None
    return True, work_task.result()


async def _wait_for_disconnect(request: Request) -> None:
    # After the body is read, receive() blocks until the client disconnects: no polling needed.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
