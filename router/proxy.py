"""Forwarding one client request to the backends: plain to a mixed instance, or prefill then decode (P/D).

Owns ``Forwarder`` (the choice between P/D and mixed, the backend calls, relaying the answer) and
``ProxyError`` (a failure the router answers itself, with the OpenAI error body).

P/D follows the protocol agreed with the engine side (``engine/disaggregation.py``): call 1 sends the client's
request to a prefill instance with ``max_tokens: 1``, ``stream: false``, ``n: 1`` and
``kv_transfer_params: {"do_remote_decode": true}``; call 2 sends the client's original request plus the
``kv_transfer_params`` object of call 1's answer (opaque here, copied verbatim) to a decode instance, whose
answer goes to the client unchanged. The decode instance pulls the prompt's KV from the prefill instance and
recomputes the rest, so a failed or missing prefill (no healthy prefill instance, a refused connection, a 5xx,
an answer without ``kv_transfer_params``) only costs the decode instance a local prefill: the router then makes
call 2 without the object. So does a completions request with a batch of prompts, which the P/D protocol does
not transfer (one prompt per request). A 4xx of call 1 is the client's mistake and is answered as is.

Usage: the client gets the decode instance's ``usage`` unchanged: it counts the whole prompt and every
completion token (the decode instance answers the complete request; call 1's single token is not part of the
answer), and its ``cached_tokens`` include the blocks pulled from the prefill instance. Call 1's usage is
dropped.

Bytes: non-streamed answers are relayed byte-for-byte with their status; streamed answers byte-for-byte too,
re-chunked on event boundaries (``\\n\\n``) so that a backend dying mid-event never leaves half an event before
the router's own error event and ``[DONE]``. A request that cannot connect to a mixed or decode backend (it
never reached it) is retried on another one of the role; any other failure is answered 502 (or an error event
once streaming began).
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

import httpx
from starlette.responses import Response

from engine.entrypoints.sse import SSEResponse
from router.backends import Backend, BackendPool, NoBackendError, Role
from router.metrics import RouterMetrics

logger = logging.getLogger(__name__)

SSE_DONE = b"data: [DONE]\n\n"
EVENT_END = b"\n\n"
# Request headers a backend needs (its API key, the client's request id); hop-by-hop ones are httpx's business.
FORWARDED_HEADERS = ("authorization", "x-request-id")
# Response headers relayed to the client besides the body.
RELAYED_HEADERS = ("content-type", "x-request-id")


class ProxyError(Exception):
    """A failure the router answers itself: ``status_code`` with the OpenAI error body."""

    def __init__(self, message: str, status_code: int = 502, code: str | None = None,
                 content: bytes | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.code = code or ("backend_error" if status_code >= 500 else "invalid_request")
        self.content = content  # a backend's own error body, relayed as is

    def render(self) -> bytes:
        if self.content is not None:
            return self.content
        error_type = "server_error" if self.status_code >= 500 else "invalid_request_error"
        body = {"error": {"message": self.message, "type": error_type, "param": None, "code": self.code}}
        return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


def error_event(message: str, code: str = "backend_error") -> bytes:
    """The SSE error event the router sends when a stream breaks after it began (then ``[DONE]``)."""
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + EVENT_END


@dataclass
class ClientRequest:
    """What the router keeps of one client request."""

    path: str  # /v1/completions or /v1/chat/completions
    body: dict[str, Any]  # parsed, for P/D's rewrites
    raw: bytes  # as received, sent unchanged to a mixed backend
    headers: dict[str, str]  # the FORWARDED_HEADERS the client sent


class Forwarder:
    """Sends client requests to the backends of ``pool`` over ``client``."""

    def __init__(self, pool: BackendPool, client: httpx.AsyncClient, metrics: RouterMetrics) -> None:
        self.pool = pool
        self.client = client
        self.metrics = metrics

    def choose_mode(self) -> str:
        """"pd" or "mixed": the kind of instance the next request goes to.

        P/D needs a healthy decode instance (a missing prefill instance only costs a local prefill). With both
        kinds configured, the less busy side takes it: the decode instance with the fewest requests in flight
        against the least busy mixed instance (P/D on a tie).
        """
        decode_load = self.pool.least_in_flight(Role.DECODE)
        mixed_load = self.pool.least_in_flight(Role.MIXED)
        if decode_load is None and mixed_load is None:
            raise NoBackendError(self._nothing_healthy())
        if mixed_load is None or (decode_load is not None and decode_load <= mixed_load):
            return "pd"
        return "mixed"

    def _nothing_healthy(self) -> str:
        out = [f"{b.url} ({b.role.value}): {b.last_error or 'not checked yet'}"
               for b in self.pool.backends if b.role is not Role.PREFILL]
        return "no healthy decode or mixed backend: " + "; ".join(out)

    async def forward(self, request: ClientRequest) -> Response:
        """The response to ``request``; raises ProxyError / NoBackendError for the router's own error answers."""
        mode = self.choose_mode()
        self.metrics.requests.labels(endpoint=request.path, mode=mode).inc()
        if mode == "mixed":
            return await self._send_with_retry(Role.MIXED, request.path, request.raw, request.headers)
        # The decode instance is chosen first and counts the request from now on, so concurrent requests
        # still in call 1 spread over the decode instances (and against mixed ones) by their real load.
        decode = self.pool.pick(Role.DECODE)
        decode.in_flight += 1
        try:
            params = await self._prefill(request)
        finally:
            decode.in_flight -= 1
        decode_body = dict(request.body)
        if params is not None:
            decode_body["kv_transfer_params"] = params
        else:
            decode_body.pop("kv_transfer_params", None)
        raw = json.dumps(decode_body, ensure_ascii=False, separators=(",", ":")).encode()
        # Any decode instance can pull the offered blocks, so a refused connection moves on to the next one.
        return await self._send_with_retry(Role.DECODE, request.path, raw, request.headers,
                                           first=decode if decode.healthy else None)

    # -- P/D call 1

    async def _prefill(self, request: ClientRequest) -> dict[str, Any] | None:
        """Call 1: the prefill instance's ``kv_transfer_params`` (None: the decode instance prefills itself).

        Raises ProxyError with the prefill instance's own status and body for a 4xx (the client's mistake).
        """
        if _is_prompt_batch(request.body.get("prompt")):
            self._prefill_fallback("batch", "a batch of prompts (P/D transfers one prompt per request)")
            return None
        try:
            backend = self.pool.pick(Role.PREFILL)
        except NoBackendError as exc:
            self._prefill_fallback("no_prefill", str(exc))
            return None
        body = dict(request.body, max_tokens=1, stream=False, n=1, kv_transfer_params={"do_remote_decode": True})
        body.pop("stream_options", None)
        body.pop("min_tokens", None)  # above max_tokens=1 it would be refused
        if "max_completion_tokens" in body:
            body["max_completion_tokens"] = 1
        started = time.perf_counter()
        backend.in_flight += 1
        backend.requests_total += 1
        try:
            response = await self.client.post(backend.url + request.path, json=body, headers=request.headers)
        except httpx.HTTPError as exc:
            self._backend_failed(backend, exc)
            self._prefill_fallback("prefill_failed",
                                   f"prefill call to {backend.url} failed: {type(exc).__name__}: {exc}")
            return None
        finally:
            backend.in_flight -= 1
        self.metrics.prefill_seconds.observe(time.perf_counter() - started)
        if 400 <= response.status_code < 500:
            raise _passthrough_error(response)
        if response.status_code != 200:
            self.metrics.backend_errors.labels(backend=backend.url, role=backend.role.value, kind="status").inc()
            self._prefill_fallback("prefill_failed", f"prefill call to {backend.url} answered "
                                   f"{response.status_code}: {response.text[:300]}")
            return None
        try:
            params = response.json().get("kv_transfer_params")
        except (ValueError, AttributeError):
            params = None
        if not isinstance(params, dict):
            # The usual answer for a prompt shorter than one block (nothing to transfer), or a mixed instance.
            self._prefill_fallback("no_offer", f"prefill answer of {backend.url} has no kv_transfer_params object")
            return None
        return params

    def _prefill_fallback(self, reason: str, detail: str) -> None:
        """Count (and log) a P/D request whose decode instance will prefill itself."""
        level = logging.DEBUG if reason == "no_offer" else logging.WARNING
        logger.log(level, "P/D: the decode instance prefills locally: %s", detail)
        self.metrics.prefill_fallbacks.labels(reason=reason).inc()

    # -- sending and relaying

    async def _send_with_retry(self, role: Role, path: str, raw: bytes, headers: dict[str, str],
                               first: Backend | None = None) -> Response:
        """``_send`` to ``first`` or the best backend of ``role``; on a refused connection, to the next healthy one."""
        tried: list[str] = []
        while True:
            backend, first = first or self.pool.pick(role), None  # pick: NoBackendError once every one is out
            try:
                return await self._send(backend, path, raw, headers, connect_failure_retriable=True)
            except _ConnectFailed as exc:
                tried.append(f"{backend.url}: {exc}")
                if not self.pool.has_healthy(role):
                    raise ProxyError(f"no {role.value} backend reachable ({'; '.join(tried)})", 502,
                                     "backend_unreachable") from None

    async def _send(self, backend: Backend, path: str, raw: bytes, headers: dict[str, str],
                    connect_failure_retriable: bool = False) -> Response:
        """POST ``raw`` to ``backend`` and relay its answer (streamed if it is an event stream)."""
        backend.in_flight += 1
        backend.requests_total += 1
        self.metrics.backend_requests.labels(backend=backend.url, role=backend.role.value).inc()
        release = _once(lambda: setattr(backend, "in_flight", backend.in_flight - 1))
        request = self.client.build_request("POST", backend.url + path, content=raw,
                                            headers={**headers, "content-type": "application/json"})
        try:
            upstream = await self.client.send(request, stream=True)
        except httpx.ConnectError as exc:
            release()
            self._backend_failed(backend, exc)
            if connect_failure_retriable:
                raise _ConnectFailed(str(exc)) from None
            raise ProxyError(f"{backend.role.value} backend {backend.url} unreachable: {exc}", 502,
                             "backend_unreachable") from None
        except httpx.HTTPError as exc:
            release()
            self._backend_failed(backend, exc)
            raise ProxyError(f"{backend.role.value} backend {backend.url} failed: {type(exc).__name__}: {exc}")
        except BaseException:  # cancelled by a client disconnect before the answer began
            release()
            raise
        relayed = {k: v for k, v in upstream.headers.items() if k.lower() in RELAYED_HEADERS}
        if upstream.headers.get("content-type", "").startswith("text/event-stream"):
            return SSEResponse(self._relay_events(upstream, backend, release), status_code=upstream.status_code,
                               headers=relayed)
        try:
            content = await upstream.aread()
        except httpx.HTTPError as exc:
            self._backend_failed(backend, exc)
            raise ProxyError(f"{backend.role.value} backend {backend.url} failed while answering: "
                             f"{type(exc).__name__}: {exc}") from None
        finally:
            await upstream.aclose()
            release()
        return Response(content, status_code=upstream.status_code, headers=relayed)

    async def _relay_events(self, upstream: httpx.Response, backend: Backend,
                            release: Callable[[], None]) -> AsyncIterator[bytes]:
        """The backend's event stream, whole events at a time; an error event and [DONE] if it breaks."""
        pending = b""
        try:
            async for chunk in upstream.aiter_raw():
                pending += chunk
                cut = pending.rfind(EVENT_END)
                if cut >= 0:
                    yield pending[: cut + len(EVENT_END)]
                    pending = pending[cut + len(EVENT_END):]
            if pending:
                yield pending
        except httpx.HTTPError as exc:
            self._backend_failed(backend, exc)
            logger.warning("stream from %s broke (%d bytes of an unfinished event dropped): %s: %s",
                           backend.url, len(pending), type(exc).__name__, exc)
            yield error_event(f"{backend.role.value} backend {backend.url} failed while streaming: "
                              f"{type(exc).__name__}: {exc}")
            yield SSE_DONE
        finally:
            # On a client disconnect this closes the upstream connection, which aborts the backend's request.
            await upstream.aclose()
            release()

    def _backend_failed(self, backend: Backend, exc: Exception) -> None:
        kind = "connect" if isinstance(exc, httpx.ConnectError) else type(exc).__name__
        self.metrics.backend_errors.labels(backend=backend.url, role=backend.role.value, kind=kind).inc()
        if isinstance(exc, (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError)):
            # Refused, or the connection died under a request: the process is gone or going; the health
            # checker brings it back once it answers again.
            backend.mark_unhealthy(f"{type(exc).__name__}: {exc}")


def _is_prompt_batch(prompt: Any) -> bool:
    """A completions ``prompt`` holding several prompts (a list of strings or of token lists)."""
    return isinstance(prompt, list) and len(prompt) > 1 and not all(isinstance(p, int) for p in prompt)


class _ConnectFailed(Exception):
    """The request never reached the backend (connection refused): safe to send elsewhere."""


def _passthrough_error(response: httpx.Response) -> ProxyError:
    """A backend's 4xx as the router's answer: its status and body, byte for byte."""
    return ProxyError(response.text[:500], response.status_code, "invalid_request", content=response.content)


def _once(func: Callable[[], None]) -> Callable[[], None]:
    done = False

    def call() -> None:
        nonlocal done
        if not done:
            done = True
            func()
    return call
