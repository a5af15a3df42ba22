"""The HTTP server process part: uvicorn running the API server's ASGI app.

Owns: ``ApiServer`` (uvicorn's server, stoppable from a signal handler with ``request_stop``)
and ``create_server`` (its configuration: log level from ``envs.FD_LOG_LEVEL``, no access log).
"""
from __future__ import annotations

import contextlib
from typing import Any

import uvicorn
from fastapi import FastAPI

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
