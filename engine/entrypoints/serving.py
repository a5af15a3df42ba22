"""The OpenAI serving classes: what happens to one completion / chat request.

Owns: ``OpenAIServing`` (the per-request flow: read body -> validate -> tokenize -> check lengths
-> one ``EngineRequest`` per prompt -> ``EngineClient.generate`` -> per-choice detokenize, stop
strings and logprobs -> JSON or SSE, and the shutdown drain: new requests get 503, requests in
flight may finish until a deadline, the rest end with an error), ``_Generation`` (outputs of one
engine request, n choices, -> choice deltas), ``_ChoiceFormatter`` (choice deltas -> response
JSON), the places structured output and tools plug in (``_structured_output_spec``,
``_tool_call_spec``), and the rule that a request whose consumer goes away (client disconnect,
every choice cut at a stop string) is aborted in the engine.

Choices and prompts: a batched ``/v1/completions`` request sends one engine request per prompt,
each with ``SamplingParams.n`` choices; choice i of prompt p is response index ``p * n + i``
(vLLM's numbering), non-streamed choices come in index order, streamed chunks of different
choices interleave (one choice per chunk, each with its finish), one ``[DONE]``. Usage counts
each prompt once and every choice's generated tokens. Stop strings are applied per choice; a
choice cut at one is finished for the client while the engine may still run it until all the
request's choices are finished or cut (then the request is aborted).

Budgets: ``/v1/completions`` without ``max_tokens`` gets 16 (OpenAI), a chat completion what
the context leaves (vLLM), capped by the server's ``max_tokens_default``. ``echo`` with
``max_tokens: 0`` answers the prompt alone: the engine generates one token, dropped here.

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
from typing import TYPE_CHECKING, Any, AsyncIterator, Iterable

import anyio
from fastapi import Request
from fastapi.responses import Response
from starlette.requests import ClientDisconnect

from config.sampling_params import SamplingParams
from config.structured_output import StructuredOutputSpec
from engine.entrypoints.choices import ChoiceDelta, ChoiceState, PromptEcho
from engine.entrypoints.engine_client import EngineDeadError
from engine.entrypoints.errors import OpenAIJSONResponse, unavailable_error
from engine.entrypoints.http_server import run_until_disconnect
from engine.entrypoints.logprobs_format import (TokenEntry, TokenTexts, chat_logprobs, completion_logprobs,
                                                vllm_prompt_logprobs)
from engine.entrypoints.metrics import RequestRecorder, ServerMetrics
from engine.entrypoints.protocol import (COMPLETIONS_DEFAULT_MAX_TOKENS, SERVER_ERROR, SSE_DONE,
                                         APIError, ChatCompletionRequest, CompletionRequest,
                                         GenerationRequest, chat_choice, chat_completion_chunk,
                                         chat_completion_response, chat_delta_choice, completion_choice,
                                         completion_chunk, completion_response, error_body, sse_event, usage,
                                         usage_chunk)
from engine.entrypoints.sse import SSEResponse
from engine.entrypoints import structured_request, tool_calls
from engine.entrypoints.structured_request import StructuredRequestError
from engine.entrypoints.tool_calls import ToolCallStream, ToolRequest
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
# One generation: engine outputs of one engine request (one prompt, n choices) -> choice deltas


class _Generation:
    """Consumes ``engine.generate`` for one engine request and turns its outputs into ``ChoiceDelta``s.

    Outputs carry their choice ``index``; each choice has its ``ChoiceState`` (detokenizer, stop
    strings, logprobs). When the request shows its prompt (``echo``, ``prompt_logprobs``), a
    choice's first delta waits for the prompt's logprobs, which the engine sends once, in the
    output that ends the prefill. The engine request is aborted whenever consumption ends before
    the engine finished it (every choice cut at a stop string, client gone, exception, cancellation).
    """

    def __init__(self, engine: EngineClient, engine_request: EngineRequest, choices: list[ChoiceState], *,
                 show_prompt: bool, echo: bool, recorder: RequestRecorder | None = None) -> None:
        self._engine = engine
        self._request = engine_request
        self._choices = choices
        self._show_prompt = show_prompt
        self._echo = echo
        self._prompt_logprobs_expected = engine_request.sampling_params.prompt_logprobs is not None
        self._recorder = recorder
        self.prompt: PromptEcho | None = None
        self._held: dict[int, ChoiceDelta] = {}  # choice index -> deltas waiting for the prompt
        self._prompt_shown: set[int] = set()
        self._engine_finished: set[int] = set()  # choice indexes the engine reported finished
        self.cached_tokens = 0
        self.error: str | None = None
        self.kv_transfer_params: dict[str, Any] | None = None  # P/D prefill instance: the offer

    @property
    def completion_tokens(self) -> int:
        return sum(choice.completion_tokens for choice in self._choices)

    @property
    def finished(self) -> bool:
        return all(choice.finished for choice in self._choices)

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        """The choices' deltas in the order the engine produced them; ends when every choice finished
        (or with ``error`` set)."""
        outputs = self._engine.generate(self._request)
        if inspect.isawaitable(outputs):
            outputs = await outputs
        engine_failed = False
        try:
            async for output in outputs:
                if output.finish_reason == "error":
                    engine_failed = True
                    self.error = output.error or "the engine failed to run the request"
                    return
                for delta in self._consume(output):
                    yield delta
                if self.finished:
                    break
            if not self.finished:
                self.error = "the engine stopped sending outputs before the request finished"
                return
            for delta in self._flush_held():
                yield delta
        finally:
            # Choices cut at a stop string are still running in the engine: abort unless all ended there.
            engine_done = engine_failed or len(self._engine_finished) >= len(self._choices)
            await self._release(outputs, engine_done)

    def _consume(self, output: RequestOutput) -> list[ChoiceDelta]:
        self.cached_tokens = max(self.cached_tokens, output.num_cached_tokens)
        if output.kv_transfer_params is not None:
            self.kv_transfer_params = output.kv_transfer_params
        if output.finished:
            self._engine_finished.add(output.index)
        if self._show_prompt and self.prompt is None and (output.prompt_logprobs is not None
                                                          or not self._prompt_logprobs_expected):
            self.prompt = PromptEcho.build(self._engine.tokenizer, self._request.prompt_token_ids,
                                           output.prompt_logprobs)
        if not 0 <= output.index < len(self._choices):
            logger.error("request %s: output for choice %d of %d dropped", self._request.request_id, output.index,
                         len(self._choices))
            return []
        choice = self._choices[output.index]
        if output.new_token_ids and self._recorder is not None and not choice.finished:
            self._recorder.on_tokens(len(output.new_token_ids))
        delta = choice.add(output.new_token_ids, output.logprobs, output.finished, output.finish_reason)
        if not self._show_prompt or output.index in self._prompt_shown:
            return [] if delta.empty else [self._shifted(delta)]
        # A choice's first deltas wait until the prompt (with its logprobs) is known.
        held = self._held.get(output.index)
        if held is None:
            self._held[output.index] = delta
        else:
            held.merge(delta)
        return [] if self.prompt is None else self._flush_held()

    def _flush_held(self) -> list[ChoiceDelta]:
        if self._show_prompt and self.prompt is None:
            logger.warning("request %s: the engine sent no prompt logprobs; the prompt is shown without them",
                           self._request.request_id)
            self.prompt = PromptEcho.build(self._engine.tokenizer, self._request.prompt_token_ids, None)
        held, self._held = self._held, {}
        ready: list[ChoiceDelta] = []
        for index in sorted(held):
            self._prompt_shown.add(index)
            held[index].prompt = self.prompt
            ready.append(self._shifted(held[index]))
        return ready

    def _shifted(self, delta: ChoiceDelta) -> ChoiceDelta:
        # With echo the choice's text starts with the prompt: completion offsets move past it.
        if self._echo and self.prompt is not None and self.prompt.text:
            base = len(self.prompt.text)
            delta.entries = [TokenEntry(e.token_id, e.logprobs, e.offset + base) for e in delta.entries]
        return delta

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


_END = object()


async def _merged(streams: list[AsyncIterator[ChoiceDelta]]) -> AsyncIterator[ChoiceDelta]:
    """The items of several delta streams (one per prompt of a batched request) as they come.

    Closing this generator cancels the pumps, whose streams then abort their engine requests.
    """
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as only:
            async for item in only:
                yield item
        return
    queue: asyncio.Queue[Any] = asyncio.Queue()

    async def pump(stream: AsyncIterator[ChoiceDelta]) -> None:
        try:
            async with contextlib.aclosing(stream) as items:
                async for item in items:
                    queue.put_nowait(item)
        except Exception as exc:  # handed to the consumer, which re-raises it
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(_END)

    tasks = [asyncio.ensure_future(pump(stream)) for stream in streams]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is _END:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# ---------------------------------------------------------------------------------------------
# Request preparation


@dataclass
class _Prepared:
    """A validated request, ready for the engine: one engine request per prompt."""

    request_id: str
    created: int
    parsed: GenerationRequest
    engine_requests: list[EngineRequest]
    echo_only: bool  # echo with max_tokens=0: the generated token is dropped
    tools: ToolRequest | None = None  # chat tools (structured-output wiring): rendered, constrained, parsed

    @property
    def prompts(self) -> list[list[int]]:
        return [request.prompt_token_ids for request in self.engine_requests]


# Grammar backends a request may name (vLLM's guided_decoding_backend): all mean our llguidance.
_GRAMMAR_BACKENDS = ("auto", "llguidance", "guidance")


def _structured_output_spec(parsed: GenerationRequest, tools: ToolRequest | None = None,
                            tokenizer: Tokenizer | None = None) -> StructuredOutputSpec | None:
    """The structured-output constraint of a request (``response_format``, ``guided_*``,
    ``structured_outputs``; see ``structured_request``), or the tool-call schema of ``required`` /
    a named ``tool_choice``; None when unconstrained. 400 naming the field for anything invalid.
    """
    for name in ("structural_tag", "guided_whitespace_pattern"):
        if getattr(parsed, name) is not None:
            raise APIError(f"{name} is not supported", param=name)
    backend = parsed.guided_decoding_backend
    if backend is not None and backend not in _GRAMMAR_BACKENDS:
        raise APIError(f"guided_decoding_backend must be one of {', '.join(_GRAMMAR_BACKENDS)} (llguidance), "
                       f"got {backend!r}", param="guided_decoding_backend")
    try:
        spec = structured_request.spec_from_request(
            {name: getattr(parsed, name, None) for name in structured_request.FIELDS}, tokenizer=tokenizer)
    except StructuredRequestError as exc:
        raise APIError(str(exc), param=exc.param) from None
    tool_spec = tool_calls.tool_call_spec(tools) if tools is not None else None
    if tool_spec is None:
        return spec
    if spec is not None:
        field = next(name for name in structured_request.FIELDS if getattr(parsed, name, None) is not None)
        raise APIError(f"{field} cannot be combined with tool_choice 'required' or a named function "
                       "(the output is then a tool call)", param=field)
    return tool_spec


def _tool_call_spec(parsed: ChatCompletionRequest) -> ToolRequest | None:
    """The validated tools of a chat request (``tools``, ``tool_choice``, ``parallel_tool_calls``), or None.

    The deprecated ``functions`` / ``function_call`` are a 400 naming them.
    """
    if parsed.functions:
        raise APIError("functions are not supported: use tools", param="functions")
    if parsed.function_call not in (None, "none", "auto"):
        raise APIError("function_call is not supported: use tool_choice", param="function_call")
    try:
        return tool_calls.parse_tool_request({name: getattr(parsed, name) for name in tool_calls.FIELDS})
    except StructuredRequestError as exc:
        raise APIError(str(exc), param=exc.param) from None


class OpenAIServing:
    """State and handlers behind the routes of ``build_app``."""

    def __init__(self, engine: EngineClient, served_model_name: str, max_model_len: int,
                 max_request_bytes: int, metrics: ServerMetrics | None = None,
                 max_tokens_default: int | None = None, max_num_seqs: int | None = None) -> None:
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {max_model_len}")
        if max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be positive, got {max_request_bytes}")
        self.engine = engine
        self.served_model_name = served_model_name
        self.max_model_len = max_model_len
        self.max_request_bytes = max_request_bytes
        self.metrics = metrics
        # Caps a chat completion's default budget (--max-tokens-default); None: the rest of the context.
        self.max_tokens_default = max_tokens_default
        # The engine runs every choice of a request as its own sequence: n above this can never be scheduled.
        self.max_num_seqs = max_num_seqs
        self.created = int(time.time())
        self.draining = False
        # Set by cut_drain (a second Ctrl-C): the drain ends the requests in flight now.
        self._drain_cut = asyncio.Event()

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
        idle = asyncio.ensure_future(self.engine.wait_idle(deadline_s))
        cut = asyncio.ensure_future(self._drain_cut.wait())
        try:
            await asyncio.wait({idle, cut}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            cut.cancel()
            idle.cancel()
        if idle.done() and not idle.cancelled() and idle.result():
            logger.info("shutdown: every request finished during the drain")
            return
        failed = self.engine.fail_all(_SHUTDOWN_MESSAGE)
        why = "cut short" if self._drain_cut.is_set() else f"deadline of {deadline_s:.1f} s passed"
        logger.info("shutdown: drain %s; ended %d request(s) with an error", why, failed)
        # Give the ended requests a moment to send their last event through the event loop.
        await self.engine.wait_idle(1.0)

    def cut_drain(self) -> None:
        """End the drain now: the requests still in flight end with an error (a second Ctrl-C)."""
        self._drain_cut.set()

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

    async def completion_prompts(self, parsed: CompletionRequest) -> list[list[int]]:
        """Token ids of each prompt of a (maybe batched) completions request."""
        # add_special_tokens defaults to true on /v1/completions (vLLM): BOS if the model wants one.
        add_special = parsed.add_special_tokens is not False
        prompts: list[list[int]] = []
        for prompt in parsed.prompts:
            if isinstance(prompt, str):
                prompts.append(await self._encode(prompt, add_special))
            else:
                self._check_token_ids(prompt, "prompt")
                prompts.append(list(prompt))
        return prompts

    async def chat_prompt(self, parsed: ChatCompletionRequest, tools: ToolRequest | None = None) -> list[int]:
        try:
            # Tools and earlier tool calls/results: rendered by the template or the documented fallback.
            text = tool_calls.render_chat(self.tokenizer, parsed.message_dicts(), tools,
                                          add_generation_prompt=bool(parsed.add_generation_prompt))
        except ValueError as exc:  # InvalidRequestError included: malformed messages
            raise APIError(str(exc), param="messages") from None
        # The template writes every special token itself; add_special_tokens adds the tokenizer's on top.
        return await self._encode(text, bool(parsed.add_special_tokens))

    def _check_token_ids(self, token_ids: list[int], param: str) -> None:
        vocab_size = self.tokenizer.vocab_size
        if token_ids and (min(token_ids) < 0 or max(token_ids) >= vocab_size):
            bad = next(t for t in token_ids if not 0 <= t < vocab_size)
            raise APIError(f"token id {bad} in {param} is out of range: ids must be in [0, {vocab_size})",
                           param=param)

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """vLLM's tokenization of ``bad_words``: each word as written and with a leading space (the
        form it takes after another word), each form once."""
        forms: list[list[int]] = []
        for word in words:
            for text in (word, " " + word.lstrip(" ")):
                ids = self.tokenizer.encode(text, False)
                if ids and ids not in forms:
                    forms.append(ids)
        return forms

    # -- request -> engine requests

    def prepare(self, parsed: GenerationRequest, prompts: list[list[int]], id_prefix: str,
                prompt_param: str, tools: ToolRequest | None = None) -> _Prepared:
        """One engine request per prompt, with validated sampling parameters (400 on any problem)."""
        if parsed.stop_token_ids:
            self._check_token_ids(parsed.stop_token_ids, "stop_token_ids")
        structured_output = _structured_output_spec(parsed, tools, self.tokenizer)
        bad_words = self.bad_words_token_ids(parsed.bad_words) if parsed.bad_words else []
        request_id = f"{id_prefix}-{uuid.uuid4().hex}"
        if parsed.kv_transfer_params and len(prompts) > 1:
            raise APIError("kv_transfer_params applies to a request with one prompt, not a batch of "
                           f"{len(prompts)}", param="kv_transfer_params")
        engine_requests: list[EngineRequest] = []
        for position, prompt in enumerate(prompts):
            if parsed.truncate_prompt_tokens is not None:
                prompt = prompt[-parsed.truncate_prompt_tokens:]
            if not prompt:
                raise APIError("The prompt is empty: it must contain at least one token", param=prompt_param)
            sampling_params = self._sampling_params(parsed, len(prompt), prompt_param)
            sampling_params.bad_words_token_ids = [list(ids) for ids in bad_words]
            sampling_params.structured_output = structured_output
            engine_id = request_id if len(prompts) == 1 else f"{request_id}-{position}"
            engine_requests.append(EngineRequest(request_id=engine_id, prompt_token_ids=prompt,
                                                 sampling_params=sampling_params,
                                                 eos_token_ids=tuple(self.tokenizer.eos_token_ids),
                                                 arrival_time=time.time(),
                                                 kv_transfer_params=parsed.kv_transfer_params or None))
        echo_only = parsed.echo_prompt and parsed.requested_max_tokens == 0
        return _Prepared(request_id, int(time.time()), parsed, engine_requests, echo_only, tools)

    def _default_max_tokens(self, parsed: GenerationRequest, room: int) -> int:
        if isinstance(parsed, CompletionRequest):
            return min(COMPLETIONS_DEFAULT_MAX_TOKENS, room)  # OpenAI's default
        # Chat: what the context leaves (vLLM), capped by the server's --max-tokens-default.
        return room if self.max_tokens_default is None else min(room, self.max_tokens_default)

    def _sampling_params(self, parsed: GenerationRequest, num_prompt: int, prompt_param: str) -> SamplingParams:
        """Validated sampling parameters whose max_tokens fits the context."""
        requested = parsed.requested_max_tokens
        if requested is None:
            # A prompt that fills the context would leave a budget of 0: its length is the problem to report.
            self._check_prompt_fits(num_prompt, prompt_param)
            return parsed.to_sampling_params(self._default_max_tokens(parsed, self.max_model_len - num_prompt),
                                             self.tokenizer.vocab_size)
        # Value checks before length checks: max_tokens=-1 is reported as such, not as a length problem.
        sampling_params = parsed.to_sampling_params(requested, self.tokenizer.vocab_size)
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

    def check(self, parsed: GenerationRequest) -> ToolRequest | None:
        """Field checks; returns the chat request's validated tools (None without tools)."""
        parsed.check_supported()
        parsed.check_model(self.served_model_name)
        if self.max_num_seqs is not None and parsed.num_choices > self.max_num_seqs:
            raise APIError(f"n={parsed.num_choices} is more choices than this server runs at once "
                           f"(--max-num-seqs {self.max_num_seqs})", param="n")
        if isinstance(parsed, ChatCompletionRequest):
            return _tool_call_spec(parsed)
        return None

    # -- handlers

    async def completions(self, request: Request) -> Response:
        started = time.perf_counter()
        self.check_accepting()
        parsed = CompletionRequest.parse(await self.read_body(request))
        self.check(parsed)
        prepared = self.prepare(parsed, await self.completion_prompts(parsed), "cmpl", "prompt")
        return await self._respond(request, prepared, chat=False, started=started)

    async def chat_completions(self, request: Request) -> Response:
        started = time.perf_counter()
        self.check_accepting()
        parsed = ChatCompletionRequest.parse(await self.read_body(request))
        tools = self.check(parsed)
        prepared = self.prepare(parsed, [await self.chat_prompt(parsed, tools)], "chatcmpl", "messages", tools)
        return await self._respond(request, prepared, chat=True, started=started)

    def _generations(self, prepared: _Prepared, recorder: RequestRecorder | None) -> list[_Generation]:
        parsed = prepared.parsed
        n = parsed.num_choices
        generations = []
        for position, engine_request in enumerate(prepared.engine_requests):
            choices = [ChoiceState(position * n + i, self.tokenizer, parsed.stop_strings,
                                   skip_special_tokens=bool(parsed.skip_special_tokens),
                                   include_stop_str=bool(parsed.include_stop_str_in_output),
                                   drop_generated=prepared.echo_only,
                                   stop_token_ids=(*engine_request.eos_token_ids,
                                                   *engine_request.sampling_params.stop_token_ids))
                       for i in range(n)]
            generations.append(_Generation(self.engine, engine_request, choices,
                                           show_prompt=parsed.echo_prompt or parsed.prompt_logprobs is not None,
                                           echo=parsed.echo_prompt, recorder=recorder))
        return generations

    async def _respond(self, request: Request, prepared: _Prepared, chat: bool, started: float) -> Response:
        recorder = None
        if self.metrics is not None:
            endpoint = "/v1/chat/completions" if chat else "/v1/completions"
            recorder = self.metrics.start_request(endpoint, sum(len(p) for p in prepared.prompts), started)
        generations = self._generations(prepared, recorder)
        formatter = _ChoiceFormatter(self.tokenizer, prepared, chat)
        if prepared.parsed.stream:
            events = self._stream_events(prepared, generations, formatter, recorder)
            return SSEResponse(events, media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self._complete(request, prepared, generations, formatter, recorder)

    async def _complete(self, request: Request, prepared: _Prepared, generations: list[_Generation],
                        formatter: "_ChoiceFormatter", recorder: RequestRecorder | None) -> Response:
        results: dict[int, ChoiceDelta] = {}

        async def collect() -> None:
            async with contextlib.aclosing(_merged([g.deltas() for g in generations])) as deltas:
                async for delta in deltas:
                    if delta.index in results:
                        results[delta.index].merge(delta)
                    else:
                        results[delta.index] = delta
                    if _first_error(generations) is not None:
                        break

        try:
            # Cancelling runs _Generation's cleanup, which aborts the engine request.
            finished, _ = await run_until_disconnect(request, collect)
        finally:
            if recorder is not None:
                recorder.finish(_overall_finish(generations, results.values()))
        if not finished:
            logger.info("client of %s went away; request aborted", prepared.request_id)
            return Response(status_code=499)
        error = _first_error(generations)
        if error is not None:
            logger.error("request %s failed in the engine: %s", prepared.request_id, error)
            if self.draining and error == _SHUTDOWN_MESSAGE:
                raise unavailable_error(error)
            raise APIError(error, status_code=500, error_type=SERVER_ERROR, code="engine_error")
        choices = [formatter.final_choice(results[index]) for index in sorted(results)]
        usage_ = _usage(prepared, generations)
        if formatter.chat:
            body = chat_completion_response(prepared.request_id, prepared.created, self.served_model_name, choices,
                                            usage_, prompt_logprobs=formatter.chat_prompt_logprobs(results.values()))
        else:
            body = completion_response(prepared.request_id, prepared.created, self.served_model_name, choices,
                                       usage_)
        if prepared.parsed.kv_transfer_params:
            # P/D (vLLM's placement): a prefill instance's offer for the decode instance, null if it made none.
            body["kv_transfer_params"] = next(
                (g.kv_transfer_params for g in generations if g.kv_transfer_params is not None), None)
        return OpenAIJSONResponse(body)

    async def _stream_events(self, prepared: _Prepared, generations: list[_Generation],
                             formatter: "_ChoiceFormatter", recorder: RequestRecorder | None) -> AsyncIterator[bytes]:
        parsed = prepared.parsed
        include_usage = parsed.include_usage
        request_id, created, model = prepared.request_id, prepared.created, self.served_model_name
        first_finish: str | None = None  # the finish reason the metrics count the request under
        error: str | None = None
        try:
            if formatter.chat:
                # The role goes out at once: clients see the stream open before the first token.
                for index in range(len(prepared.engine_requests) * parsed.num_choices):
                    yield sse_event(chat_completion_chunk(request_id, created, model, formatter.role_choice(index),
                                                          with_usage_field=include_usage))
            # aclosing: when this generator is closed (client gone) the engine requests are aborted now.
            async with contextlib.aclosing(_merged([g.deltas() for g in generations])) as deltas:
                async for delta in deltas:
                    if _first_error(generations) is not None:
                        break
                    if not formatter.worth_sending(delta):
                        continue  # only part of a character so far
                    first_finish = first_finish or delta.finish_reason
                    # Tools: a delta may be held back (it may be a tool call) or end in tool-call chunks.
                    for choice in formatter.chunk_choices(delta):
                        if formatter.chat:
                            chunk = chat_completion_chunk(request_id, created, model, choice,
                                                          with_usage_field=include_usage,
                                                          prompt_logprobs=formatter.chat_prompt_logprobs([delta]))
                        else:
                            chunk = completion_chunk(request_id, created, model, choice,
                                                     with_usage_field=include_usage)
                        if parsed.continuous_usage:
                            chunk["usage"] = _usage(prepared, generations)
                        yield sse_event(chunk)
            error = _first_error(generations)
        except EngineDeadError as exc:  # the rank went away between the check and the send
            error = str(exc)
        except Exception as exc:
            logger.exception("stream of request %s failed", request_id)
            error = f"internal error while streaming: {exc}"
        finally:
            if recorder is not None:
                recorder.finish("error" if error is not None or _first_error(generations) is not None
                                else first_finish)
        if error is not None:
            logger.error("request %s failed in the engine: %s", request_id, error)
            yield sse_event(error_body(error, error_type=SERVER_ERROR, code="engine_error"))
        elif include_usage:
            object_type = "chat.completion.chunk" if formatter.chat else "text_completion"
            yield sse_event(usage_chunk(object_type, request_id, created, model, _usage(prepared, generations)))
        yield SSE_DONE

    async def health(self) -> Response:
        try:
            status = self.engine.health()
        except Exception as exc:
            logger.exception("health check failed")
            return OpenAIJSONResponse({"status": "unhealthy", "error": str(exc)}, status_code=503)
        return OpenAIJSONResponse(status, status_code=200 if status.get("status") == "ok" else 503)


# ---------------------------------------------------------------------------------------------
# Choice deltas -> response JSON


class _ChoiceFormatter:
    """Turns choice deltas into the JSON choices of one response (completions or chat, stream or not)."""

    def __init__(self, tokenizer: Tokenizer, prepared: _Prepared, chat: bool) -> None:
        parsed = prepared.parsed
        self.chat = chat
        self._parsed = parsed
        self._prompts = prepared.prompts
        self._n = parsed.num_choices
        self._texts = TokenTexts(tokenizer, as_token_ids=bool(parsed.return_tokens_as_token_ids))
        self._k = parsed.logprobs_count
        self._echo = parsed.echo_prompt
        self._with_ids = bool(parsed.return_token_ids)
        self._prompt_ids_sent: set[int] = set()
        self._chat_prompt_logprobs_sent = False
        # Tool calls (structured-output wiring): parsed from each chat choice's output when tools are active.
        self._tools = prepared.tools if chat and prepared.tools is not None and prepared.tools.active else None
        self._tool_streams: dict[int, ToolCallStream] = {}

    def _prompt_ids(self, index: int) -> list[int] | None:
        if not self._with_ids or index in self._prompt_ids_sent:
            return None
        self._prompt_ids_sent.add(index)
        return self._prompts[index // self._n]

    def _text_and_entries(self, delta: ChoiceDelta) -> tuple[str, list[TokenEntry]]:
        if self._echo and delta.prompt is not None:
            return delta.prompt.text + delta.text, delta.prompt.entries + delta.entries
        return delta.text, delta.entries

    def _completion_prompt_logprobs(self, delta: ChoiceDelta) -> list[Any] | None:
        if self._parsed.prompt_logprobs is None or delta.prompt is None:
            return None
        return vllm_prompt_logprobs(delta.prompt.token_ids, delta.prompt.logprobs, self._texts,
                                    self._parsed.prompt_logprobs)

    def chat_prompt_logprobs(self, deltas: Iterable[ChoiceDelta]) -> list[Any] | None:
        """vLLM's top-level ``prompt_logprobs`` of a chat response (once per response or stream)."""
        if self._chat_prompt_logprobs_sent:
            return None
        for delta in deltas:
            shown = self._completion_prompt_logprobs(delta)
            if shown is not None:
                self._chat_prompt_logprobs_sent = True
                return shown
        return None

    def _logprobs(self, entries: list[TokenEntry]) -> dict[str, Any] | None:
        if self._k is None:
            return None
        if self.chat:
            return chat_logprobs(entries, self._texts, self._k)
        return completion_logprobs(entries, self._texts, self._k)

    def worth_sending(self, delta: ChoiceDelta) -> bool:
        """False for a stream delta that would be an empty chunk (e.g. part of a UTF-8 character)."""
        return bool(delta.text or delta.finish_reason or delta.prompt is not None
                    or (delta.entries and (self._k is not None or self._with_ids)))

    def final_choice(self, delta: ChoiceDelta) -> dict[str, Any]:
        """A choice of a non-streamed response (``delta``: everything the choice produced)."""
        text, entries = self._text_and_entries(delta)
        completion_ids = delta.token_ids if self._with_ids else None
        if self.chat:
            choice = chat_choice(delta.index, text, delta.finish_reason, logprobs=self._logprobs(entries),
                                 prompt_token_ids=self._prompt_ids(delta.index), completion_token_ids=completion_ids)
            calls = tool_calls.parse_tool_calls(text, self._tools) if self._tools is not None else None
            if calls:
                choice["message"] = tool_calls.tool_calls_message(calls)
                choice["finish_reason"] = tool_calls.TOOL_CALLS_FINISH_REASON
            return choice
        return completion_choice(delta.index, text, delta.finish_reason, logprobs=self._logprobs(entries),
                                 prompt_token_ids=self._prompt_ids(delta.index), completion_token_ids=completion_ids,
                                 prompt_logprobs=self._completion_prompt_logprobs(delta))

    def role_choice(self, index: int) -> dict[str, Any]:
        """The first chunk of a chat choice: the role, and the prompt ids when asked for."""
        return chat_delta_choice(index, "", role="assistant", prompt_token_ids=self._prompt_ids(index),
                                 completion_token_ids=[] if self._with_ids else None)

    def chunk_choices(self, delta: ChoiceDelta) -> list[dict[str, Any]]:
        """The choices of the stream chunks ``delta`` becomes: one, or with tools none (text held back
        while it may be a tool call) or the tool-call chunks (OpenAI's shape) when the output ends."""
        if self._tools is None:
            return [self.chunk_choice(delta)]
        stream = self._tool_streams.setdefault(delta.index, ToolCallStream(self._tools))
        text = stream.feed(delta.text)
        if delta.finish_reason is None:
            if not text:
                return []
            delta.text = text
            return [self.chunk_choice(delta)]
        calls = stream.finish()
        if not calls:
            delta.text = stream.finish_content() + text
            return [self.chunk_choice(delta)]
        choices = [chat_delta_choice(delta.index, None, logprobs=None) for _ in tool_calls.tool_call_deltas(calls)]
        for choice, call_delta in zip(choices, tool_calls.tool_call_deltas(calls)):
            choice["delta"] = call_delta
        choices.append(chat_delta_choice(delta.index, None, tool_calls.TOOL_CALLS_FINISH_REASON,
                                         completion_token_ids=delta.token_ids if self._with_ids else None))
        return choices

    def chunk_choice(self, delta: ChoiceDelta) -> dict[str, Any]:
        """The choice of one stream chunk."""
        text, entries = self._text_and_entries(delta)
        completion_ids = delta.token_ids if self._with_ids else None
        if self.chat:
            # The finishing chunk of a chat stream has an empty delta when no text came with it.
            content = text if text or delta.finish_reason is None else None
            return chat_delta_choice(delta.index, content, delta.finish_reason, logprobs=self._logprobs(entries),
                                     prompt_token_ids=self._prompt_ids(delta.index),
                                     completion_token_ids=completion_ids)
        return completion_choice(delta.index, text, delta.finish_reason, logprobs=self._logprobs(entries),
                                 prompt_token_ids=self._prompt_ids(delta.index), completion_token_ids=completion_ids,
                                 prompt_logprobs=self._completion_prompt_logprobs(delta))


def _first_error(generations: list[_Generation]) -> str | None:
    return next((g.error for g in generations if g.error is not None), None)


def _overall_finish(generations: list[_Generation], deltas: Iterable[ChoiceDelta]) -> str | None:
    """The finish reason a request is counted under in the metrics (its first choice's)."""
    if _first_error(generations) is not None:
        return "error"
    return next((d.finish_reason for d in deltas if d.finish_reason is not None), None)


def _usage(prepared: _Prepared, generations: list[_Generation]) -> dict[str, Any]:
    # Each prompt is counted once however many choices it has; completions of every choice add up.
    return usage(sum(len(p) for p in prepared.prompts), sum(g.completion_tokens for g in generations),
                 sum(g.cached_tokens for g in generations))
