"""The OpenAI-compatible HTTP app (FastAPI): ``build_app`` and its routes.

Owns: the routes (``/health``, ``/metrics``, ``/v1/models``, ``/v1/completions``,
``/v1/chat/completions``, ``/v1/cache/reset``, ``/v1/cache/stats``, and vLLM's ``/tokenize``,
``/detokenize``, ``/tokenizer_info``) and how the app is put
together. What a route does lives elsewhere in this package: the request flow in ``serving``,
error bodies in ``errors``, the API key in ``auth``, metric definitions in ``metrics``, uvicorn
in ``http_server``. ``/health`` and ``/metrics`` are reachable without the API key.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import Response

import envs
from engine.entrypoints.auth import add_api_key_auth
from engine.entrypoints.errors import OpenAIJSONResponse, add_error_handlers
from engine.entrypoints.metrics import METRICS_CONTENT_TYPE, HTTPMetricsMiddleware, ServerMetrics
from engine.entrypoints.protocol import APIError, model_card, model_list
from engine.entrypoints.serving import OpenAIServing
from engine.entrypoints.tokenizer_routes import detokenize, tokenize, tokenizer_info

if TYPE_CHECKING:
    from engine.entrypoints.dp_router import DPRouter
    from engine.entrypoints.engine_client import EngineClient

logger = logging.getLogger(__name__)


def build_app(engine: EngineClient | DPRouter, served_model_name: str, max_model_len: int,
              api_key: str | None = None, max_request_bytes: int | None = None,
              max_tokens_default: int | None = None, max_num_seqs: int | None = None) -> FastAPI:
    """The OpenAI-compatible ASGI app in front of ``engine``.

    ``api_key``: when set, every ``/v1/*`` route needs ``Authorization: Bearer <api_key>``;
    ``/health`` and ``/metrics`` (Prometheus text format) stay reachable without it.
    ``max_request_bytes``: largest accepted body (413 beyond); default ``envs.FD_MAX_REQUEST_BYTES``.
    ``max_tokens_default``: cap of a chat completion's default max_tokens (None: the rest of the context).
    ``max_num_seqs``: the engine's sequence limit; a request for more choices (``n``) is a 400.
    Engine state (``/metrics``, ``/v1/cache/stats``) is read through ``engine``, which knows the
    instance id and DP rank(s) it serves.
    """
    limit = envs.FD_MAX_REQUEST_BYTES if max_request_bytes is None else max_request_bytes
    metrics = ServerMetrics(served_model_name, engine)
    serving = OpenAIServing(engine, served_model_name, max_model_len, limit, metrics=metrics,
                            max_tokens_default=max_tokens_default, max_num_seqs=max_num_seqs)
    app = FastAPI(title="fdserve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serving = serving
    app.state.metrics = metrics
    add_error_handlers(app)
    add_api_key_auth(app, api_key)
    # Added last, so outermost: it also counts the API-key check's 401s.
    app.add_middleware(HTTPMetricsMiddleware, metrics=metrics)

    @app.get("/health")
    async def health() -> Response:
        return await serving.health()

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        """Prometheus scrape target (not behind the API key: counters only, no request content)."""
        return Response(await metrics.render(), media_type=METRICS_CONTENT_TYPE)

    @app.post("/v1/cache/reset")
    async def reset_prefix_cache() -> Response:
        """Drop the device and host tiers' cached prefixes (the storage tier is kept)."""
        return OpenAIJSONResponse(await engine.reset_prefix_cache())

    @app.get("/v1/cache/stats")
    async def cache_stats() -> Response:
        """The prefix cache's counters, and the KV-cache lock's, per DP rank (``ranks`` with DP > 1)."""
        return OpenAIJSONResponse(await engine.cache_stats())

    @app.get("/v1/models")
    async def list_models() -> Response:
        return OpenAIJSONResponse(model_list(served_model_name, max_model_len, serving.created))

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> Response:
        if model_id != served_model_name:
            raise APIError(f"The model '{model_id}' does not exist", status_code=404, param="model",
                           code="model_not_found")
        return OpenAIJSONResponse(model_card(served_model_name, max_model_len, serving.created))

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> Response:
        """vLLM's tokenizer endpoint (harnesses use it instead of downloading the tokenizer)."""
        body = await serving.read_body(request)
        return OpenAIJSONResponse(tokenize(serving.tokenizer, body, served_model_name, max_model_len))

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> Response:
        return OpenAIJSONResponse(detokenize(serving.tokenizer, await serving.read_body(request), served_model_name))

    @app.get("/tokenizer_info")
    async def tokenizer_info_route() -> Response:
        return OpenAIJSONResponse(tokenizer_info(serving.tokenizer, max_model_len))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serving.completions(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serving.chat_completions(request)

    return app
