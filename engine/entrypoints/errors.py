"""Error answers of the API server: the OpenAI error body for every failure, and the handlers.

Owns: ``OpenAIJSONResponse`` (JSON rendered with the protocol's encoder), ``error_response``
(an ``APIError`` as its OpenAI error body and status), ``unavailable_error`` (the 503 of a
server with no engine taking requests now), and ``add_error_handlers``: every client mistake is
a 4xx with the OpenAI error body (FastAPI's 422 becomes a 400), a 5xx means the engine or this
server failed.
"""
from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from config.sampling_params import InvalidRequestError
from engine.entrypoints.engine_client import EngineUnavailableError
from engine.entrypoints.protocol import SERVER_ERROR, APIError, error_body, to_json

logger = logging.getLogger(__name__)


class OpenAIJSONResponse(JSONResponse):
    """A JSON response rendered by ``protocol.to_json``."""

    def render(self, content: Any) -> bytes:
        return to_json(content)


def error_response(error: APIError) -> JSONResponse:
    """``error`` as its OpenAI error body with its status code."""
    return OpenAIJSONResponse(error.body(), status_code=error.status_code)


def unavailable_error(message: str) -> APIError:
    """The 503 of a server whose engine takes no request now (restarting, down, shutting down)."""
    return APIError(message, status_code=503, error_type=SERVER_ERROR, code="engine_unavailable")


def add_error_handlers(app: FastAPI) -> None:
    """Answer every exception a route raises with the OpenAI error body."""

    async def on_api_error(_request: Request, exc: Exception) -> Response:
        if not isinstance(exc, APIError):
            raise TypeError(f"on_api_error got {type(exc).__name__}")
        if exc.status_code < 500:
            logger.debug("client error %d: %s", exc.status_code, exc.message)
        return error_response(exc)

    async def on_engine_unavailable(_request: Request, exc: Exception) -> Response:
        return error_response(unavailable_error(str(exc)))

    async def on_invalid_request(_request: Request, exc: Exception) -> Response:
        return error_response(APIError(str(exc)))

    async def on_validation_error(_request: Request, exc: Exception) -> Response:
        # FastAPI's default is a 422 with its own body; OpenAI clients expect a 400 error body.
        errors = exc.errors() if isinstance(exc, RequestValidationError) else []
        parts = [f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg', '')}" for e in errors]
        return error_response(APIError("; ".join(parts) or "invalid request"))

    async def on_http_error(_request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, StarletteHTTPException) else 500
        detail = exc.detail if isinstance(exc, StarletteHTTPException) else str(exc)
        code = {404: "not_found", 405: "method_not_allowed"}.get(status)
        error_type = SERVER_ERROR if status >= 500 else "invalid_request_error"
        response = OpenAIJSONResponse(error_body(str(detail), error_type=error_type, code=code), status_code=status)
        if isinstance(exc, StarletteHTTPException) and exc.headers:
            response.headers.update(exc.headers)
        return response

    async def on_unexpected(_request: Request, exc: Exception) -> Response:
        logger.error("unhandled error in the API server", exc_info=exc)
        return error_response(APIError(f"internal server error: {type(exc).__name__}: {exc}", status_code=500,
                                        error_type=SERVER_ERROR))

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(InvalidRequestError, on_invalid_request)
    app.add_exception_handler(EngineUnavailableError, on_engine_unavailable)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected)
