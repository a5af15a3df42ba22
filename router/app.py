"""The router's HTTP app (FastAPI): the OpenAI routes, its health and metrics, and its error answers.

Owns ``build_app``. ``/v1/completions`` and ``/v1/chat/completions`` go through ``proxy.Forwarder``;
``/v1/models`` and the tokenizer routes are relayed to any healthy backend (every backend serves the same
model); ``/health`` answers 200 while a request can be served (a healthy decode or mixed backend) and lists
every backend's state; ``/metrics`` is the router's own. The router validates only what it must read itself
(a JSON object body, ``stream`` a boolean, the size); everything else is the backend's to check, and its 4xx
comes back unchanged. A client that disconnects before the answer begins cancels the backend calls (their
connections close, so the backend aborts the request); once streaming, ``SSEResponse`` does the same.
"""
from __future__ import annotations

import json
import logging
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from engine.entrypoints.http_server import run_until_disconnect
from router.backends import BackendPool, NoBackendError, Role
from router.metrics import METRICS_CONTENT_TYPE, RouterMetrics
from router.proxy import FORWARDED_HEADERS, RELAYED_HEADERS, ClientRequest, Forwarder, ProxyError

logger = logging.getLogger(__name__)

COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")


def json_error(message: str, status_code: int, code: str | None = None) -> Response:
    return Response(ProxyError(message, status_code, code).render(), status_code=status_code,
                    media_type="application/json")


def build_app(pool: BackendPool, client: httpx.AsyncClient, metrics: RouterMetrics,
              max_request_bytes: int) -> FastAPI:
    """The router's ASGI app over ``pool``; backend calls go through ``client``."""
    forwarder = Forwarder(pool, client, metrics)
    app = FastAPI(title="fdserve-router", docs_url=None, redoc_url=None, openapi_url=None)
    _add_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        serving = pool.has_healthy(Role.DECODE) or pool.has_healthy(Role.MIXED)
        body = {"status": "ok" if serving else "unhealthy", "backends": [b.status() for b in pool.backends]}
        return Response(json.dumps(body), status_code=200 if serving else 503, media_type="application/json")

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=METRICS_CONTENT_TYPE)

    @app.get("/v1/models")
    async def list_models(request: Request) -> Response:
        return await _relay_to_any(pool, client, request, "GET", "/v1/models")

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, request: Request) -> Response:
        return await _relay_to_any(pool, client, request, "GET", f"/v1/models/{model_id}")

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request) -> Response:
        return await _relay_to_any(pool, client, request, "GET", "/tokenizer_info")

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await _relay_to_any(pool, client, request, "POST", "/tokenize",
                                   await _read_body(request, max_request_bytes))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await _relay_to_any(pool, client, request, "POST", "/detokenize",
                                   await _read_body(request, max_request_bytes))

    async def complete(request: Request) -> Response:
        raw = await _read_body(request, max_request_bytes)
        client_request = ClientRequest(path=request.url.path, body=_parse_body(raw), raw=raw,
                                       headers=_forwarded_headers(request))
        status = "500"
        try:
            finished, response = await run_until_disconnect(request, lambda: forwarder.forward(client_request))
            if not finished:
                logger.info("client disconnected before the answer of %s began; backend call cancelled",
                            request.url.path)
                response = Response(status_code=499)  # nobody reads it
            status = str(response.status_code)
            return response
        except ProxyError as exc:
            status = str(exc.status_code)
            raise
        except NoBackendError:
            status = "503"
            raise
        finally:
            metrics.responses.labels(endpoint=request.url.path, status=status).inc()

    for path in COMPLETION_PATHS:
        app.add_api_route(path, complete, methods=["POST"])
    return app


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ProxyError(f"The request body is larger than the limit of {limit} bytes", 413, "request_too_large")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ProxyError(f"The request body is larger than the limit of {limit} bytes", 413,
                                 "request_too_large")
            chunks.append(chunk)
    except ClientDisconnect:
        raise ProxyError("the client disconnected while sending the request body", 400) from None
    return b"".join(chunks)


def _parse_body(raw: bytes) -> dict[str, Any]:
    """The request's JSON object; ProxyError 400 naming what is wrong."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProxyError(f"the request body is not valid JSON: {exc}", 400) from None
    if not isinstance(body, dict):
        raise ProxyError(f"the request body must be a JSON object, not {type(body).__name__}", 400)
    if "stream" in body and not isinstance(body["stream"], bool) and body["stream"] is not None:
        raise ProxyError(f"'stream' must be a boolean, got {body['stream']!r}", 400)
    return body


def _forwarded_headers(request: Request) -> dict[str, str]:
    return {name: request.headers[name] for name in FORWARDED_HEADERS if name in request.headers}


async def _relay_to_any(pool: BackendPool, client: httpx.AsyncClient, request: Request, method: str, path: str,
                        content: bytes | None = None) -> Response:
    """``method path`` on a healthy backend (decode or mixed first: they hold the serving model)."""
    for role in (Role.MIXED, Role.DECODE, Role.PREFILL):
        if pool.has_healthy(role):
            backend = pool.pick(role)
            break
    else:
        raise NoBackendError("no healthy backend")
    headers = _forwarded_headers(request)
    if content is not None:
        headers["content-type"] = request.headers.get("content-type", "application/json")
    try:
        upstream = await client.request(method, backend.url + path, content=content, headers=headers,
                                        params=request.query_params)
    except httpx.HTTPError as exc:
        raise ProxyError(f"backend {backend.url} failed: {type(exc).__name__}: {exc}") from None
    relayed = {k: v for k, v in upstream.headers.items() if k.lower() in RELAYED_HEADERS}
    return Response(upstream.content, status_code=upstream.status_code, headers=relayed)


def _add_error_handlers(app: FastAPI) -> None:
    async def on_proxy_error(_request: Request, exc: Exception) -> Response:
        if not isinstance(exc, ProxyError):
            raise TypeError(f"on_proxy_error got {type(exc).__name__}")
        if exc.status_code >= 500:
            logger.warning("answering %d: %s", exc.status_code, exc.message)
        return Response(exc.render(), status_code=exc.status_code, media_type="application/json")

    async def on_no_backend(_request: Request, exc: Exception) -> Response:
        logger.warning("answering 503: %s", exc)
        return json_error(str(exc), 503, "no_healthy_backend")

    async def on_validation_error(_request: Request, exc: Exception) -> Response:
        return json_error(f"invalid request: {exc}", 400)

    async def on_http_error(_request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, StarletteHTTPException) else 500
        detail = exc.detail if isinstance(exc, StarletteHTTPException) else str(exc)
        return json_error(str(detail), status, {404: "not_found", 405: "method_not_allowed"}.get(status))

    async def on_unexpected(_request: Request, exc: Exception) -> Response:
        logger.error("unhandled error in the router", exc_info=exc)
        return json_error(f"internal router error: {type(exc).__name__}: {exc}", 500, "router_error")

    app.add_exception_handler(ProxyError, on_proxy_error)
    app.add_exception_handler(NoBackendError, on_no_backend)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected)
