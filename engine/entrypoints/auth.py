"""API-key authentication of the API server's ``/v1/*`` routes.

Owns: ``ApiKeyMiddleware`` (``Authorization: Bearer <key>``, compared in constant time) and
``add_api_key_auth``. ``/health`` and ``/metrics`` stay reachable without the key.
"""
from __future__ import annotations

import hmac
from typing import Any

from fastapi import FastAPI
from starlette.types import Receive, Scope, Send

from engine.entrypoints.errors import error_response
from engine.entrypoints.protocol import APIError


def add_api_key_auth(app: FastAPI, api_key: str | None) -> None:
    """Require ``api_key`` on ``/v1/*`` when it is set (no-op otherwise)."""
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)


class ApiKeyMiddleware:
    """Requires ``Authorization: Bearer <key>`` on ``/v1/*`` (plain ASGI: streams pass through untouched)."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
            # Constant-time comparison: the key must not leak through response timing.
            if not hmac.compare_digest(given, self._expected):
                response = error_response(APIError("Incorrect or missing API key: send "
                                                    "'Authorization: Bearer <key>'", status_code=401,
                                                    code="invalid_api_key"))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
