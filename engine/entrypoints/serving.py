"""The OpenAI serving classes: what happens to one completion / chat request.

Owns: ``OpenAIServing`` (the per-request flow: read body -> validate -> tokenize -> check lengths
-> ``EngineClient.generate`` -> detokenize + stop strings -> JSON or SSE, and the shutdown drain:
new requests get 503, requests in flight may finish until a deadline, the rest end with an
error), ``_Generation`` (engine outputs -> text deltas), and the rule that a request whose
consumer goes away (client disconnect, stop string) is aborted in the engine.

Which layer checks what (decided once, here and in the scheduler):

- Prompt length: checked here (``_check_prompt_fits``), because the client must get a 400
  with the OpenAI ``context_length_exceeded`` body before a stream starts; the engine's
  rejection would only arrive as an error output after a 200. The scheduler's
  ``_admission_problem`` keeps its own length check only to protect the engine from any
  sender (it never triggers for requests that passed this one).
- Stop token ids: validated here (ids in the vocabulary: a 400 otherwise) and sent in
  ``SamplingParams.stop_token_ids``; the engine's scheduler alone decides that a sampled token
  stops the request (also under ``ignore_eos``). ``EngineRequest.eos_token_ids`` carries only
  the tokenizer's eos ids; the scheduler applies ``ignore_eos`` to them.
"""
from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable

import anyio
from fastapi import Request
from fastapi.responses import Response
from starlette.requests import ClientDisconnect

from config.sampling_params import SamplingParams
from engine.entrypoints.detokenizer import IncrementalDetokenizer, StopChecker
from engine.entrypoints.engine_client import EngineDeadError
from engine.entrypoints.errors import OpenAIJSONResponse, unavailable_error
from engine.entrypoints.metrics import RequestRecorder, ServerMetrics
from engine.entrypoints.protocol import (SERVER_ERROR, SSE_DONE, APIError, ChatCompletionRequest, CompletionRequest,
                                         GenerationRequest, chat_completion_chunk, chat_completion_response,
                                         completion_chunk, completion_response, error_body, sse_event, usage,
                                         usage_chunk)
from engine.entrypoints.sse import SSEResponse
from engine.request import EngineRequest, RequestOutput

if TYPE_CHECKING:
    from engine.entrypoints.engine_client import EngineClient
    from engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# Prompts longer than this many characters are tokenized in a thread so that one huge prompt
# does not stall every stream served by the event loop.
_THREAD_TOKENIZE_CHARS = 8192
# An oversized body is still read (and dropped) up to this multiple of the limit so the client,
# which sends the whole body before reading, gets the 413 instead of a connection reset.
_DRAIN_FACTOR = 4

_SHUTDOWN_MESSAGE = "the server is shutting down; the request was stopped before it finished"


# ---------------------------------------------------------------------------------------------
# One generation: engine outputs -> text deltas


class _Generation:
    """Consumes ``engine.generate`` for one request and turns outputs into text deltas.

    Applies the detokenizer and the stop strings, counts tokens, and guarantees the engine
    request is aborted whenever consumption ends before the engine finished it (stop string,
    client gone, exception, cancellation).
    """

    def __init__(self, engine: EngineClient, engine_request: EngineRequest, stop: list[str],
                 skip_special_tokens: bool, recorder: RequestRecorder | None = None) -> None:
        self._engine = engine
        self._request = engine_request
        self._recorder = recorder
        self._detokenizer = IncrementalDetokenizer(engine.tokenizer, skip_special_tokens=skip_special_tokens)
        self._stop_checker = StopChecker(stop) if stop else None
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.finish_reason: str | None = None
        self.error: str | None = None

    async def deltas(self) -> AsyncIterator[tuple[str, list[int], str | None]]:
        """Yields ``(text, new token ids, finish_reason)``; the last item carries the finish reason."""
        outputs = self._engine.generate(self._request)
        if inspect.isawaitable(outputs):
            outputs = await outputs
        engine_finished = False
        raised = False
        try:
            async for output in outputs:
                engine_finished = output.finished
                text, token_ids = self._consume(output)
                if text or token_ids or self.finish_reason is not None:
                    yield text, token_ids, self.finish_reason
                if self.finish_reason is not None:
                    return
            if self.finish_reason is None:
                self._fail("the engine stopped sending outputs before the request finished")
                yield "", [], self.finish_reason
        except Exception:
            raised = True
            raise
        finally:
            if self._recorder is not None:
                self._recorder.finish("error" if raised else self.finish_reason)
            await self._release(outputs, engine_finished)

    def _consume(self, output: RequestOutput) -> tuple[str, list[int]]:
        if output.finish_reason == "error":
            self._fail(output.error or "the engine failed to run the request")
            return "", []
        self.cached_tokens = max(self.cached_tokens, output.num_cached_tokens)
        token_ids = output.new_token_ids
        self.completion_tokens += len(token_ids)
        if token_ids and self._recorder is not None:
            self._recorder.on_tokens(len(token_ids))
        text = self._detokenizer.add(token_ids) if token_ids else ""
        if output.finished:
            text += self._detokenizer.flush()
        if self._stop_checker is not None:
            text, stopped = self._stop_checker.update(text)
            if stopped:
                self.finish_reason = "stop"
                return text, token_ids
            if output.finished:
                text += self._stop_checker.flush()
        if output.finished:
            # The engine reports "stop" for eos / stop token ids and "length" for max_tokens.
            self.finish_reason = output.finish_reason or "stop"
        return text, token_ids

    def _fail(self, message: str) -> None:
        self.error = message
        self.finish_reason = "error"

    async def _release(self, outputs: Any, engine_finished: bool) -> None:
        # Shielded: this also runs when the stream task is being cancelled (client gone), and
        # the abort must still reach the engine or the request keeps its KV blocks.
        with anyio.CancelScope(shield=True):
            aclose = getattr(outputs, "aclose", None)
            try:
                if aclose is not None:
                    await aclose()
                if not engine_finished:
                    await self._engine.abort(self._request.request_id)
            except Exception:
                logger.exception("could not abort request %s in the engine", self._request.request_id)


# ---------------------------------------------------------------------------------------------
# Request preparation


@dataclass
class _Prepared:
    """A validated request, ready for the engine."""

    request_id: str
    created: int
    prompt_token_ids: list[int]
    engine_request: EngineRequest
    parsed: GenerationRequest


class OpenAIServing:
    """State and handlers behind the routes of ``build_app``."""

    def __init__(self, engine: EngineClient, served_model_name: str, max_model_len: int,
                 max_request_bytes: int, metrics: ServerMetrics | None = None) -> None:
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {max_model_len}")
        if max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be positive, got {max_request_bytes}")
        self.engine = engine
        self.served_model_name = served_model_name
        self.max_model_len = max_model_len
        self.max_request_bytes = max_request_bytes
        self.metrics = metrics
        self.created = int(time.time())
        self.draining = False

    def check_accepting(self) -> None:
        """``APIError`` 503 when no engine takes a new request now (shutdown, restart, down)."""
        if self.draining:
            raise unavailable_error("the server is shutting down")
        accepting = getattr(self.engine, "accepting", True)
        if not accepting:
            raise unavailable_error(self.engine.unavailable_reason())

    async def drain(self, deadline_s: float) -> None:
        """Refuse new requests, let those in flight finish for up to ``deadline_s``, end the rest.

        The rest end like an engine failure (a final SSE error event, or a 503 body): their
        clients see why, instead of a connection cut in the middle of a stream.
        """
        self.draining = True
        stop_accepting = getattr(self.engine, "stop_accepting", None)
        if stop_accepting is not None:
            stop_accepting()
        logger.info("shutdown: draining %d request(s) in flight", self.engine.num_active_requests)
        if await self.engine.wait_idle(deadline_s):
            logger.info("shutdown: every request finished during the drain")
            return
        failed = self.engine.fail_all(_SHUTDOWN_MESSAGE)
        logger.info("shutdown: drain deadline of %.1f s passed; ended %d request(s) with an error", deadline_s,
                    failed)
        # Give the ended requests a moment to send their last event through the event loop.
        await self.engine.wait_idle(1.0)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    # -- body

    async def read_body(self, request: Request) -> bytes:
        """The request body; ``APIError`` 413 beyond ``max_request_bytes``."""
        limit = self.max_request_bytes
        declared = request.headers.get("content-length", "")
        declared_size = int(declared) if declared.isdigit() else None
        if declared_size is not None and declared_size > limit * _DRAIN_FACTOR:
            raise self._too_large()
        too_large = declared_size is not None and declared_size > limit
        chunks: list[bytes] = []
        size = 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    too_large = True
                    chunks.clear()
                    if size > limit * _DRAIN_FACTOR:
                        break
                if not too_large:
                    chunks.append(chunk)
        except ClientDisconnect:
            raise APIError("the client disconnected while sending the request body") from None
        if too_large:
            raise self._too_large()
        return b"".join(chunks)

    def _too_large(self) -> APIError:
        return APIError(f"The request body is larger than the limit of {self.max_request_bytes} bytes",
                        status_code=413, code="request_too_large")

    # -- prompt

    async def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if len(text) > _THREAD_TOKENIZE_CHARS:
            return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens)
        return self.tokenizer.encode(text, add_special_tokens)

    async def completion_prompt(self, parsed: CompletionRequest) -> list[int]:
        if isinstance(parsed.prompt, str):
            return await self._encode(parsed.prompt, bool(parsed.add_special_tokens))
        self._check_token_ids(parsed.prompt, "prompt")
        return list(parsed.prompt)

    async def chat_prompt(self, parsed: ChatCompletionRequest) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(parsed.message_dicts(),
                                                      add_generation_prompt=bool(parsed.add_generation_prompt))
        except ValueError as exc:  # InvalidRequestError included: malformed messages
            raise APIError(str(exc), param="messages") from None
        # The template writes every special token itself.
        return await self._encode(text, False)

    def _check_token_ids(self, token_ids: list[int], param: str) -> None:
        vocab_size = self.tokenizer.vocab_size
        if token_ids and (min(token_ids) < 0 or max(token_ids) >= vocab_size):
            bad = next(t for t in token_ids if not 0 <= t < vocab_size)
            raise APIError(f"token id {bad} in {param} is out of range: ids must be in [0, {vocab_size})",
                           param=param)

    # -- request -> engine request

    def prepare(self, parsed: GenerationRequest, prompt_token_ids: list[int], id_prefix: str,
                prompt_param: str) -> _Prepared:
        if not prompt_token_ids:
            raise APIError("The prompt is empty: it must contain at least one token", param=prompt_param)
        if parsed.stop_token_ids:
            self._check_token_ids(parsed.stop_token_ids, "stop_token_ids")
        sampling_params = self._sampling_params(parsed, len(prompt_token_ids), prompt_param)
        request_id = f"{id_prefix}-{uuid.uuid4().hex}"
        engine_request = EngineRequest(request_id=request_id, prompt_token_ids=prompt_token_ids,
                                       sampling_params=sampling_params,
                                       eos_token_ids=tuple(self.tokenizer.eos_token_ids),
                                       arrival_time=time.time())
        return _Prepared(request_id, int(time.time()), prompt_token_ids, engine_request, parsed)

    def _sampling_params(self, parsed: GenerationRequest, num_prompt: int, prompt_param: str) -> SamplingParams:
        """Validated sampling parameters whose max_tokens fits the context (default: all that is left)."""
        requested = parsed.requested_max_tokens
        if requested is None:
            # The default max_tokens is what the prompt leaves: a prompt that fills the context
            # would make it 0, so its length is the problem to report.
            self._check_prompt_fits(num_prompt, prompt_param)
            return parsed.to_sampling_params(self.max_model_len - num_prompt)
        # Value checks before length checks: max_tokens=-1 is reported as such, not as a length problem.
        sampling_params = parsed.to_sampling_params(requested)
        self._check_prompt_fits(num_prompt, prompt_param)
        if num_prompt + requested > self.max_model_len:
            raise APIError(f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                           f"requested {num_prompt + requested} tokens ({num_prompt} in the prompt, {requested} "
                           f"for the completion). Reduce the prompt or {parsed.max_tokens_param}.",
                           param=parsed.max_tokens_param, code="context_length_exceeded")
        return sampling_params

    def _check_prompt_fits(self, num_prompt: int, prompt_param: str) -> None:
        """The one user-facing prompt length check (a 400 before any stream starts; see the module doc)."""
        if num_prompt >= self.max_model_len:
            raise APIError(f"This model's maximum context length is {self.max_model_len} tokens, but the prompt "
                           f"has {num_prompt} tokens; it must be shorter to leave room for the completion",
                           param=prompt_param, code="context_length_exceeded")

    def check(self, parsed: GenerationRequest) -> None:
        parsed.check_supported()
        parsed.check_model(self.served_model_name)

    # -- handlers

    async def completions(self, request: Request) -> Response:
        started = time.perf_counter()
        self.check_accepting()
        parsed = CompletionRequest.parse(await self.read_body(request))
        self.check(parsed)
        prompt_token_ids = await self.completion_prompt(parsed)
        prepared = self.prepare(parsed, prompt_token_ids, "cmpl", "prompt")
        return await self._respond(request, prepared, chat=False, started=started)

    async def chat_completions(self, request: Request) -> Response:
        started = time.perf_counter()
        self.check_accepting()
        parsed = ChatCompletionRequest.parse(await self.read_body(request))
        self.check(parsed)
        prompt_token_ids = await self.chat_prompt(parsed)
        prepared = self.prepare(parsed, prompt_token_ids, "chatcmpl", "messages")
        return await self._respond(request, prepared, chat=True, started=started)

    async def _respond(self, request: Request, prepared: _Prepared, chat: bool, started: float) -> Response:
        parsed = prepared.parsed
        recorder = None
        if self.metrics is not None:
            endpoint = "/v1/chat/completions" if chat else "/v1/completions"
            recorder = self.metrics.start_request(endpoint, len(prepared.prompt_token_ids), started)
        generation = _Generation(self.engine, prepared.engine_request, parsed.stop_strings,
                                 skip_special_tokens=bool(parsed.skip_special_tokens), recorder=recorder)
        if parsed.stream:
            events = self._stream_events(prepared, generation, chat)
            return SSEResponse(events, media_type="text/event-stream",
                                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self._complete(request, prepared, generation, chat)

    async def _complete(self, request: Request, prepared: _Prepared, generation: _Generation,
                        chat: bool) -> Response:
        texts: list[str] = []
        token_ids: list[int] = []

        async def collect() -> None:
            async with contextlib.aclosing(generation.deltas()) as deltas:
                async for text, new_ids, _finish in deltas:
                    texts.append(text)
                    token_ids.extend(new_ids)

        finished = await _run_until_disconnect(request, collect)
        if not finished:
            logger.info("client of %s went away; request aborted", prepared.request_id)
            return Response(status_code=499)
        if generation.error is not None:
            logger.error("request %s failed in the engine: %s", prepared.request_id, generation.error)
            if self.draining and generation.error == _SHUTDOWN_MESSAGE:
                raise unavailable_error(generation.error)
            raise APIError(generation.error, status_code=500, error_type=SERVER_ERROR, code="engine_error")
        usage_ = usage(len(prepared.prompt_token_ids), generation.completion_tokens, generation.cached_tokens)
        ids = prepared.parsed.return_token_ids
        build = chat_completion_response if chat else completion_response
        body = build(prepared.request_id, prepared.created, self.served_model_name, "".join(texts),
                     generation.finish_reason, usage_,
                     prompt_token_ids=prepared.prompt_token_ids if ids else None,
                     completion_token_ids=token_ids if ids else None)
        return OpenAIJSONResponse(body)

    async def _stream_events(self, prepared: _Prepared, generation: _Generation, chat: bool) -> AsyncIterator[bytes]:
        parsed = prepared.parsed
        with_ids = bool(parsed.return_token_ids)
        include_usage = parsed.include_usage
        request_id, created, model = prepared.request_id, prepared.created, self.served_model_name
        prompt_ids_pending = with_ids
        try:
            if chat:
                # The role goes out at once: clients see the stream open before the first token.
                yield sse_event(chat_completion_chunk(
                    request_id, created, model, "", role="assistant",
                    prompt_token_ids=prepared.prompt_token_ids if with_ids else None,
                    completion_token_ids=[] if with_ids else None, with_usage_field=include_usage))
                prompt_ids_pending = False
            # aclosing: when this generator is closed (client gone) the engine request is aborted now.
            async with contextlib.aclosing(generation.deltas()) as deltas:
                async for text, token_ids, finish_reason in deltas:
                    if finish_reason == "error":
                        break
                    if not text and finish_reason is None and not with_ids:
                        continue  # only part of a character so far
                    yield sse_event(self._chunk(prepared, chat, text, token_ids, finish_reason, prompt_ids_pending))
                    prompt_ids_pending = False
        except EngineDeadError as exc:  # the rank went away between the check and the send
            generation.error = str(exc)
        except Exception as exc:
            logger.exception("stream of request %s failed", request_id)
            generation.error = f"internal error while streaming: {exc}"
        if generation.error is not None:
            logger.error("request %s failed in the engine: %s", request_id, generation.error)
            yield sse_event(error_body(generation.error, error_type=SERVER_ERROR, code="engine_error"))
        elif include_usage:
            object_type = "chat.completion.chunk" if chat else "text_completion"
            yield sse_event(usage_chunk(object_type, request_id, created, model,
                                        usage(len(prepared.prompt_token_ids), generation.completion_tokens,
                                              generation.cached_tokens)))
        yield SSE_DONE

    def _chunk(self, prepared: _Prepared, chat: bool, text: str, token_ids: list[int], finish_reason: str | None,
               with_prompt_ids: bool) -> dict[str, Any]:
        parsed = prepared.parsed
        completion_ids = token_ids if parsed.return_token_ids else None
        prompt_ids = prepared.prompt_token_ids if with_prompt_ids else None
        if chat:
            # The finishing chunk of a chat stream has an empty delta when no text came with it.
            content = text if text or finish_reason is None else None
            return chat_completion_chunk(prepared.request_id, prepared.created, self.served_model_name, content,
                                         finish_reason=finish_reason, prompt_token_ids=prompt_ids,
                                         completion_token_ids=completion_ids, with_usage_field=parsed.include_usage)
        return completion_chunk(prepared.request_id, prepared.created, self.served_model_name, text,
                                finish_reason=finish_reason, prompt_token_ids=prompt_ids,
                                completion_token_ids=completion_ids, with_usage_field=parsed.include_usage)

    async def health(self) -> Response:
        try:
            status = self.engine.health()
        except Exception as exc:
            logger.exception("health check failed")
            return OpenAIJSONResponse({"status": "unhealthy", "error": str(exc)}, status_code=503)
        return OpenAIJSONResponse(status, status_code=200 if status.get("status") == "ok" else 503)


async def _wait_for_disconnect(request: Request) -> None:
    # After the body is read, receive() blocks until the client disconnects: no polling needed.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _run_until_disconnect(request: Request, work: Callable[[], Awaitable[None]]) -> bool:
    """Run ``work``; cancel it if the HTTP client disconnects first. True if it completed."""
    work_task = asyncio.ensure_future(work())
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work_task.done():
            # Cancelling runs _Generation's cleanup, which aborts the engine request.
            work_task.cancel()
            await asyncio.wait({work_task})
    if work_task.cancelled():
        return False
    work_task.result()  # re-raise what the work raised
    return True
