"""Every request field of OpenAI's completions and chat schemas and of vLLM's extensions, walked one by one.

For each field a request sets it to a non-default value, and exactly one of these holds (no third outcome):

- it is honoured: the ``SamplingParams`` / prompt the engine receives, or the response, changes as the field says;
- it is refused: HTTP 400 whose ``param`` names the field;
- it does not change output by definition (``user``, ``metadata``, ``store``, ...): 200 and the engine gets
  exactly what it gets without the field.

The field lists below are written from the references (OpenAI's API reference for
``POST /v1/completions`` and ``POST /v1/chat/completions``; vLLM's ``CompletionRequest`` and
``ChatCompletionRequest``), not from our code: ``test_every_declared_field_is_walked`` fails when the
server declares a field this walk does not cover, or misses one of the references' fields.

The app is the real one (``build_app`` + ``OpenAIServing``, real tokenizer); only the engine process
behind its ZMQ boundary is replaced by ``ScriptedEngine``, which records each ``EngineRequest`` and answers
with scripted tokens (one output per token and choice, choices interleaved, logprobs when asked for).
Also here, on the same scripted engine: n x batched prompts numbering, echo and max_tokens=0, stop
strings cutting tokens and logprobs, streamed logprobs, defaults, 404 for an unknown model.
"""
from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, AsyncIterator, Callable

import httpx
import pytest

from config.model_config import default_model_path
from engine.entrypoints.api_server import build_app
from engine.entrypoints.protocol import ChatCompletionRequest, CompletionRequest
from engine.request import EngineRequest, RequestOutput
from engine.tokenizer import Tokenizer, load_tokenizer
from inter_communicator.messages import TokenLogprobs

logger = logging.getLogger(__name__)

MODEL = "scripted-model"
MAX_MODEL_LEN = 256
# A special token inside the text: shown only with skip_special_tokens=false.
SCRIPT = " one two three four five six seven eight nine ten<|im_start|> eleven"
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
HELLO = [{"role": "user", "content": "Say hello."}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


class ScriptedEngine:
    """Stands in for the engine process behind ``EngineClient``: records requests, answers from a script.

    Choice ``i`` generates the tokens of ``SCRIPT`` (choice 1 and up prefixed by `` choice<i>``), at most
    max_tokens of them, then eos (finish "stop") or nothing more (finish "length"). Logprob values are
    made up but consistent: the sampled token is the top-1 (rank 1) at -0.25, alternatives below it.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: list[EngineRequest] = []
        self.aborted: list[str] = []
        self.accepting = True
        self.num_active_requests = 0

    def unavailable_reason(self) -> str:
        return "scripted engine"

    def engine_stats(self) -> dict[str, int]:
        return {}

    def kvcache_lock_stats(self) -> dict[int, Any]:
        return {0: None}

    async def cache_stats(self, timeout: float = 1.0) -> dict[str, Any]:
        return {}

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def script(self, index: int) -> list[int]:
        prefix = f" choice{index}" if index else ""
        return self.tokenizer.encode(prefix + SCRIPT)

    def _token_logprobs(self, token_id: int, k: int) -> TokenLogprobs:
        alternatives = [token_id] + [t for t in (11, 12, 13, 14, 15) if t != token_id]
        return TokenLogprobs(token_id, -0.25, 1, alternatives[:k], [-0.25 - i for i in range(k)])

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        self.requests.append(request)
        params = request.sampling_params
        eos = request.eos_token_ids[0]
        plans = []
        for index in range(params.n):
            tokens = self.script(index)
            if len(tokens) >= params.max_tokens:
                plans.append((tokens[:params.max_tokens], "length"))
            else:
                plans.append((tokens + [eos], "stop"))
        prompt_logprobs = None
        if params.prompt_logprobs is not None:
            prompt_logprobs = [None] + [self._token_logprobs(t, params.prompt_logprobs)
                                        for t in request.prompt_token_ids[1:]]
        step = 0
        while any(step < len(tokens) for tokens, _ in plans):
            for index, (tokens, reason) in enumerate(plans):
                if step >= len(tokens):
                    continue
                last = step == len(tokens) - 1
                await asyncio.sleep(0)
                yield RequestOutput(request.request_id, [tokens[step]], finished=last,
                                    finish_reason=reason if last else None,
                                    num_prompt_tokens=len(request.prompt_token_ids), index=index,
                                    logprobs=None if params.logprobs is None
                                    else [self._token_logprobs(tokens[step], params.logprobs)],
                                    prompt_logprobs=prompt_logprobs if step == 0 and index == 0 else None)
            step += 1


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer(default_model_path())


@pytest.fixture
def engine(tokenizer: Tokenizer) -> ScriptedEngine:
    return ScriptedEngine(tokenizer)


@pytest.fixture
def call(engine: ScriptedEngine) -> Callable[[str, dict[str, Any]], httpx.Response]:
    app = build_app(engine, MODEL, MAX_MODEL_LEN, max_tokens_default=64)

    def post(path: str, body: dict[str, Any]) -> httpx.Response:
        async def run() -> httpx.Response:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://scripted") as client:
                return await client.post(path, json=body)
        return asyncio.run(run())

    return post


def events(response: httpx.Response) -> list[Any]:
    """The data of each server-sent event; the final ``[DONE]`` stays a string."""
    out = []
    for line in response.text.split("\n"):
        if line.startswith("data: "):
            payload = line[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def assert_400(response: httpx.Response, field: str) -> None:
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field, response.json()


# --- the walk ------------------------------------------------------------------------------------

BASE = {COMPLETIONS: {"prompt": "Hello there", "max_tokens": 4, "temperature": 0},
        CHAT: {"messages": HELLO, "max_tokens": 4, "temperature": 0}}


def params_equal(**expected: Any) -> Callable:
    def check(response: httpx.Response, engine: ScriptedEngine, baseline: EngineRequest) -> None:
        assert response.status_code == 200, response.text
        params = engine.requests[-1].sampling_params
        for name, value in expected.items():
            assert getattr(params, name) == value, (name, getattr(params, name))
    return check


def response_shows(predicate: Callable[[Any], bool]) -> Callable:
    def check(response: httpx.Response, engine: ScriptedEngine, baseline: EngineRequest) -> None:
        assert response.status_code == 200, response.text
        body = events(response) if response.headers["content-type"].startswith("text/event-stream") \
            else response.json()
        assert predicate(body), body
    return check


REFUSED = "refused"  # 400 naming the field
NO_EFFECT = "no effect"  # 200 and the engine request equals the baseline's


def constrained(kind: str) -> Callable:
    """Honoured structured output: the engine gets a ``StructuredOutputSpec`` of ``kind``."""
    def check(response: httpx.Response, engine: ScriptedEngine, baseline: EngineRequest) -> None:
        assert response.status_code == 200, response.text
        spec = engine.requests[-1].sampling_params.structured_output
        assert spec is not None and spec.kind == kind, spec
    return check


def _first_choice(body: Any) -> dict:
    return body["choices"][0]


def _bad_words_check(tokenizer_words: list[str]) -> Callable:
    def check(response: httpx.Response, engine: ScriptedEngine, baseline: EngineRequest) -> None:
        assert response.status_code == 200, response.text
        forms = engine.requests[-1].sampling_params.bad_words_token_ids
        for word in tokenizer_words:
            assert engine.tokenizer.encode(word) in forms and engine.tokenizer.encode(" " + word) in forms
    return check


def _prompt_changed(response: httpx.Response, engine: ScriptedEngine, baseline: EngineRequest) -> None:
    assert response.status_code == 200, response.text
    assert engine.requests[-1].prompt_token_ids != baseline.prompt_token_ids


def _truncated_to(k: int) -> Callable:
    def check(response: httpx.Response, engine: ScriptedEngine, baseline: EngineRequest) -> None:
        assert response.status_code == 200, response.text
        assert engine.requests[-1].prompt_token_ids == baseline.prompt_token_ids[-k:]
    return check


def _kv_transfer_forwarded(response: httpx.Response, engine: ScriptedEngine, baseline: EngineRequest) -> None:
    """P/D: the object reaches the engine as sent, and the response names the (here absent) offer."""
    assert response.status_code == 200, response.text
    assert engine.requests[-1].kv_transfer_params == {"do_remote_decode": True}
    assert response.json()["kv_transfer_params"] is None


def _echo_shown(body: Any) -> bool:
    return _first_choice(body)["text"].startswith("Hello there")


# field -> (value, expectation) for /v1/completions: OpenAI's fields, then vLLM's.
COMPLETION_FIELDS: dict[str, tuple[Any, Any]] = {
    "model": (MODEL, NO_EFFECT),
    "prompt": (["Hello", "there"], response_shows(lambda b: [c["index"] for c in b["choices"]] == [0, 1])),
    "best_of": (2, REFUSED),
    "echo": (True, response_shows(_echo_shown)),
    "frequency_penalty": (1.5, params_equal(frequency_penalty=1.5)),
    "logit_bias": ({"42": 5.5}, params_equal(logit_bias={42: 5.5})),
    "logprobs": (2, response_shows(lambda b: len(_first_choice(b)["logprobs"]["tokens"]) == 4)),
    "max_tokens": (3, params_equal(max_tokens=3)),
    "n": (2, params_equal(n=2)),
    "presence_penalty": (-1.0, params_equal(presence_penalty=-1.0)),
    "seed": (1234, params_equal(seed=1234)),
    "stop": (["two"], response_shows(lambda b: _first_choice(b)["text"] == " one ")),
    "stream": (True, response_shows(lambda b: b[-1] == "[DONE]")),
    "stream_options": ({"include_usage": True}, REFUSED),  # without stream: a 400
    "suffix": ("the end", REFUSED),
    "temperature": (0.7, params_equal(temperature=0.7)),
    "top_p": (0.5, params_equal(top_p=0.5)),
    "user": ("user-1", NO_EFFECT),
    # vLLM sampling parameters
    "use_beam_search": (True, REFUSED),
    "top_k": (5, params_equal(top_k=5)),
    "min_p": (0.2, params_equal(min_p=0.2)),
    "repetition_penalty": (1.3, params_equal(repetition_penalty=1.3)),
    "length_penalty": (0.5, REFUSED),
    "stop_token_ids": ([42], params_equal(stop_token_ids=[42])),
    "include_stop_str_in_output": (True, None),  # checked with a stop string in its own test below
    "ignore_eos": (True, params_equal(ignore_eos=True)),
    "min_tokens": (2, params_equal(min_tokens=2)),
    "skip_special_tokens": (False, None),  # checked in its own test below
    "spaces_between_special_tokens": (False, REFUSED),
    "truncate_prompt_tokens": (1, _truncated_to(1)),
    "allowed_token_ids": ([1, 2], REFUSED),
    "prompt_logprobs": (1, response_shows(lambda b: _first_choice(b)["prompt_logprobs"][0] is None)),
    "bad_words": (["three"], _bad_words_check(["three"])),
    # vLLM extra parameters
    "add_special_tokens": (False, NO_EFFECT),  # honoured; this model's tokenizer adds no BOS anyway
    "response_format": ({"type": "json_object"}, constrained("json_object")),
    "structured_outputs": ({"regex": "[0-9]+"}, constrained("regex")),
    "guided_json": ({"type": "object"}, constrained("json_schema")),
    "guided_regex": ("[0-9]+", constrained("regex")),
    "guided_choice": (["yes", "no"], constrained("choice")),
    "guided_grammar": ('start: "a"', constrained("grammar")),
    "structural_tag": ('{"type": "structural_tag"}', REFUSED),
    "guided_decoding_backend": ("lm-format-enforcer", REFUSED),  # only llguidance (auto/llguidance/guidance)
    "guided_whitespace_pattern": (" ", REFUSED),
    "priority": (3, REFUSED),
    "request_id": ("my-id", NO_EFFECT),
    "logits_processors": (["some.module.Processor"], REFUSED),
    "return_tokens_as_token_ids": (True, None),  # with logprobs, checked below
    "return_token_ids": (True, response_shows(lambda b: "completion_token_ids" in _first_choice(b))),
    "cache_salt": ("salt", REFUSED),
    "kv_transfer_params": ({"do_remote_decode": True}, _kv_transfer_forwarded),
    "vllm_xargs": ({"x": 1}, REFUSED),
    "prompt_embeds": ("AAAA", REFUSED),
    # a chat field sent to /v1/completions
    "max_completion_tokens": (5, REFUSED),
    # accepted bookkeeping fields (OpenAI platform)
    "metadata": ({"k": "v"}, NO_EFFECT),
    "store": (True, NO_EFFECT),
    "service_tier": ("auto", NO_EFFECT),
    "prompt_cache_key": ("key", NO_EFFECT),
    "safety_identifier": ("sid", NO_EFFECT),
}

CHAT_FIELDS: dict[str, tuple[Any, Any]] = {
    "messages": ([{"role": "system", "content": "Be brief."}] + HELLO, _prompt_changed),
    "model": (MODEL, NO_EFFECT),
    "frequency_penalty": (1.5, params_equal(frequency_penalty=1.5)),
    "logit_bias": ({"42": -100}, params_equal(logit_bias={42: -100.0})),
    "logprobs": (True, response_shows(lambda b: len(_first_choice(b)["logprobs"]["content"]) == 4)),
    "top_logprobs": (2, REFUSED),  # without logprobs=true: a 400, as OpenAI answers
    "max_tokens": (3, params_equal(max_tokens=3)),
    "max_completion_tokens": (2, params_equal(max_tokens=2)),
    "n": (3, response_shows(lambda b: [c["index"] for c in b["choices"]] == [0, 1, 2])),
    "presence_penalty": (0.5, params_equal(presence_penalty=0.5)),
    "response_format": ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
                        constrained("json_schema")),
    "seed": (7, params_equal(seed=7)),
    "stop": ("two", response_shows(lambda b: _first_choice(b)["message"]["content"] == " one ")),
    "stream": (True, response_shows(lambda b: b[-1] == "[DONE]")),
    "stream_options": ({"include_usage": True}, REFUSED),  # without stream
    "temperature": (0.7, params_equal(temperature=0.7)),
    "top_p": (0.5, params_equal(top_p=0.5)),
    "tools": (TOOLS, _prompt_changed),  # rendered into the prompt (tool_choice auto)
    "tool_choice": ("required", None),  # with tools, checked below; without tools a 400 (test_tool_choice...)
    "parallel_tool_calls": (False, NO_EFFECT),  # no tools offered: nothing to parallelise
    "functions": ([{"name": "f", "parameters": {"type": "object"}}], REFUSED),  # deprecated: use tools
    "function_call": ({"name": "f"}, REFUSED),
    "reasoning_effort": ("low", REFUSED),
    "include_reasoning": (False, NO_EFFECT),  # no reasoning parser: nothing to include or leave out
    "user": ("user-1", NO_EFFECT),
    "audio": ({"voice": "alloy", "format": "wav"}, REFUSED),
    "modalities": (["text", "audio"], REFUSED),
    "prediction": ({"type": "content", "content": "x"}, REFUSED),
    "web_search_options": ({}, REFUSED),
    "verbosity": ("low", REFUSED),
    "metadata": ({"k": "v"}, NO_EFFECT),
    "store": (True, NO_EFFECT),
    "service_tier": ("auto", NO_EFFECT),
    "prompt_cache_key": ("key", NO_EFFECT),
    "safety_identifier": ("sid", NO_EFFECT),
    # vLLM sampling parameters
    "best_of": (2, REFUSED),
    "use_beam_search": (True, REFUSED),
    "top_k": (5, params_equal(top_k=5)),
    "min_p": (0.2, params_equal(min_p=0.2)),
    "repetition_penalty": (1.3, params_equal(repetition_penalty=1.3)),
    "length_penalty": (0.5, REFUSED),
    "stop_token_ids": ([42], params_equal(stop_token_ids=[42])),
    "include_stop_str_in_output": (True, None),
    "ignore_eos": (True, params_equal(ignore_eos=True)),
    "min_tokens": (2, params_equal(min_tokens=2)),
    "skip_special_tokens": (False, None),
    "spaces_between_special_tokens": (False, REFUSED),
    "truncate_prompt_tokens": (3, _truncated_to(3)),
    "prompt_logprobs": (0, response_shows(lambda b: b["prompt_logprobs"][0] is None)),
    "allowed_token_ids": ([1, 2], REFUSED),
    "bad_words": (["three"], _bad_words_check(["three"])),
    # vLLM extra parameters
    "echo": (True, REFUSED),
    "add_generation_prompt": (False, _prompt_changed),
    "continue_final_message": (True, REFUSED),
    "add_special_tokens": (True, NO_EFFECT),  # honoured; this model's tokenizer adds no BOS anyway
    "documents": ([{"title": "t", "text": "x"}], REFUSED),
    "chat_template": ("{{ messages }}", REFUSED),
    "chat_template_kwargs": ({"enable_thinking": True}, REFUSED),
    "mm_processor_kwargs": ({"x": 1}, REFUSED),
    "structured_outputs": ({"choice": ["a", "b"]}, constrained("choice")),
    "guided_json": ({"type": "object"}, constrained("json_schema")),
    "guided_regex": ("[0-9]+", constrained("regex")),
    "guided_choice": (["yes", "no"], constrained("choice")),
    "guided_grammar": ('start: "a"', constrained("grammar")),
    "structural_tag": ('{"type": "structural_tag"}', REFUSED),
    "guided_decoding_backend": ("lm-format-enforcer", REFUSED),
    "guided_whitespace_pattern": (" ", REFUSED),
    "priority": (3, REFUSED),
    "request_id": ("my-id", NO_EFFECT),
    "logits_processors": (["some.module.Processor"], REFUSED),
    "return_tokens_as_token_ids": (True, None),
    "return_token_ids": (True, response_shows(lambda b: "completion_token_ids" in _first_choice(b))),
    "cache_salt": ("salt", REFUSED),
    "kv_transfer_params": ({"do_remote_decode": True}, _kv_transfer_forwarded),
    "vllm_xargs": ({"x": 1}, REFUSED),
}

# Fields whose expectation needs a companion field: (path, field) -> (extra body, check).
COMBINED: dict[tuple[str, str], tuple[dict[str, Any], Callable]] = {
    (CHAT, "tool_choice"): ({"tools": TOOLS}, constrained("json_schema")),  # decoded under the call schema
    (COMPLETIONS, "include_stop_str_in_output"): (
        {"stop": ["two"]}, response_shows(lambda b: _first_choice(b)["text"] == " one two")),
    (CHAT, "include_stop_str_in_output"): (
        {"stop": ["two"]}, response_shows(lambda b: _first_choice(b)["message"]["content"] == " one two")),
    (COMPLETIONS, "skip_special_tokens"): (
        {"max_tokens": 30}, response_shows(lambda b: _first_choice(b)["text"].endswith("ten<|im_start|> eleven"))),
    (CHAT, "skip_special_tokens"): (
        {"max_tokens": 30},
        response_shows(lambda b: _first_choice(b)["message"]["content"].endswith("ten<|im_start|> eleven"))),
    (COMPLETIONS, "return_tokens_as_token_ids"): (
        {"logprobs": 0}, response_shows(lambda b: _first_choice(b)["logprobs"]["tokens"][0].startswith("token_id:"))),
    (CHAT, "return_tokens_as_token_ids"): (
        {"logprobs": True},
        response_shows(lambda b: _first_choice(b)["logprobs"]["content"][0]["token"].startswith("token_id:"))),
}

WALK = [(COMPLETIONS, name) for name in COMPLETION_FIELDS] + [(CHAT, name) for name in CHAT_FIELDS]


def test_every_declared_field_is_walked() -> None:
    """The walk covers exactly the fields the request models declare (so none is silently dropped)."""
    assert set(CompletionRequest.model_fields) == set(COMPLETION_FIELDS)
    assert set(ChatCompletionRequest.model_fields) == set(CHAT_FIELDS)


@pytest.mark.parametrize("path, field", WALK, ids=[f"{'chat' if p == CHAT else 'cmpl'}-{f}" for p, f in WALK])
def test_field_is_honoured_or_refused(call, engine: ScriptedEngine, path: str, field: str) -> None:
    fields = COMPLETION_FIELDS if path == COMPLETIONS else CHAT_FIELDS
    value, expectation = fields[field]
    extra: dict[str, Any] = {}
    if expectation is None:
        extra, expectation = COMBINED[(path, field)]
    baseline_response = call(path, {**BASE[path], **extra})
    assert baseline_response.status_code == 200, baseline_response.text
    baseline = engine.requests[-1]
    count = len(engine.requests)
    response = call(path, {**BASE[path], **extra, field: value})
    if expectation == REFUSED:
        assert_400(response, field)
        assert len(engine.requests) == count  # nothing reached the engine
    elif expectation == NO_EFFECT:
        assert response.status_code == 200, response.text
        sent = engine.requests[-1]
        assert (sent.prompt_token_ids, sent.sampling_params) == (baseline.prompt_token_ids, baseline.sampling_params)
    else:
        expectation(response, engine, baseline)


# --- numbering, echo, stop strings, logprobs, defaults -----------------------------------------------------


def test_batched_prompts_times_n_numbering_and_usage(call, engine: ScriptedEngine, tokenizer: Tokenizer) -> None:
    prompts = ["Hello there", "The sky is", "One"]
    body = call(COMPLETIONS, {"prompt": prompts, "n": 2, "max_tokens": 3}).json()
    assert [c["index"] for c in body["choices"]] == list(range(6))
    for choice in body["choices"]:
        expected = tokenizer.decode(engine.script(choice["index"] % 2)[:3])
        assert (choice["text"], choice["finish_reason"]) == (expected, "length")
    prompt_tokens = sum(len(tokenizer.encode(p)) for p in prompts)
    assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 18,
                             "total_tokens": prompt_tokens + 18, "prompt_tokens_details": {"cached_tokens": 0}}
    assert [r.prompt_token_ids for r in engine.requests] == [tokenizer.encode(p) for p in prompts]
    assert all(r.sampling_params.n == 2 for r in engine.requests)


def test_streamed_batch_interleaves_choices_and_ends_once(call, engine: ScriptedEngine) -> None:
    response = call(COMPLETIONS, {"prompt": [[5, 6], [7, 8]], "n": 2, "max_tokens": 3, "stream": True,
                                  "stream_options": {"include_usage": True}})
    items = events(response)
    assert items.count("[DONE]") == 1 and items[-1] == "[DONE]"
    chunks = [item for item in items[:-1] if item["choices"]]
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for chunk in chunks:
        (choice,) = chunk["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        if choice["finish_reason"]:
            assert choice["index"] not in finishes
            finishes[choice["index"]] = choice["finish_reason"]
    assert sorted(texts) == [0, 1, 2, 3] and finishes == {i: "length" for i in range(4)}
    assert [chunk["choices"][0]["index"] for chunk in chunks][:2] != [0, 0]  # choices interleave
    assert items[-2]["usage"]["completion_tokens"] == 12 and items[-2]["usage"]["prompt_tokens"] == 4


def test_chat_n_streams_a_role_chunk_per_choice(call) -> None:
    items = events(call(CHAT, {"messages": HELLO, "n": 2, "max_tokens": 2, "stream": True}))
    roles = [c["choices"][0]["index"] for c in items[:-1] if c["choices"][0]["delta"].get("role") == "assistant"]
    assert roles == [0, 1]


def test_echo_with_logprobs_shows_the_prompt_first(call, engine: ScriptedEngine, tokenizer: Tokenizer) -> None:
    prompt = "Hello there"
    body = call(COMPLETIONS, {"prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 2}).json()
    choice = body["choices"][0]
    generated = tokenizer.decode(engine.script(0)[:2])
    assert choice["text"] == prompt + generated
    logprobs = choice["logprobs"]
    prompt_ids = tokenizer.encode(prompt)
    assert len(logprobs["tokens"]) == len(prompt_ids) + 2
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["token_logprobs"][1:] == [-0.25] * (len(prompt_ids) + 1)
    assert "".join(logprobs["tokens"]) == choice["text"]
    assert logprobs["text_offset"] == [len("".join(logprobs["tokens"][:i])) for i in range(len(logprobs["tokens"]))]
    assert engine.requests[-1].sampling_params.prompt_logprobs == 1


def test_echo_with_max_tokens_zero_is_the_prompt_alone(call, engine: ScriptedEngine, tokenizer: Tokenizer) -> None:
    body = call(COMPLETIONS, {"prompt": "Hello there", "echo": True, "logprobs": 0, "max_tokens": 0}).json()
    choice = body["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == ("Hello there", "length")
    assert len(choice["logprobs"]["tokens"]) == len(tokenizer.encode("Hello there"))
    assert body["usage"]["completion_tokens"] == 0
    assert engine.requests[-1].sampling_params.max_tokens == 1  # the engine's one token is dropped


def test_echo_streams_the_prompt_in_the_first_chunk(call) -> None:
    items = events(call(COMPLETIONS, {"prompt": "Hello there", "echo": True, "logprobs": 0, "max_tokens": 2,
                                      "stream": True}))
    first = items[0]["choices"][0]
    assert first["text"].startswith("Hello there")
    assert first["logprobs"]["token_logprobs"][0] is None
    offsets = [o for item in items[:-1] for o in item["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == sorted(offsets)


def test_stop_string_cuts_tokens_and_logprobs_with_the_text(call, tokenizer: Tokenizer) -> None:
    body = call(COMPLETIONS, {"prompt": "Hi", "stop": [" three"], "logprobs": 0, "max_tokens": 8}).json()
    choice = body["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (" one two", "stop")
    # " three" contributed no text before the cut: the lists end at " two".
    assert choice["logprobs"]["tokens"] == [" one", " two"]
    assert choice["logprobs"]["text_offset"] == [0, 4]
    # Cut inside a token: " three" gave the text its last space, so it stays (the last token with text).
    body = call(COMPLETIONS, {"prompt": "Hi", "stop": ["thr"], "logprobs": 0, "max_tokens": 8}).json()
    assert body["choices"][0]["text"] == " one two "
    assert body["choices"][0]["logprobs"]["tokens"] == [" one", " two", " three"]


def test_stop_string_per_choice(call, engine: ScriptedEngine) -> None:
    # Choice 1's text is " choice1 one two ...": the stop string " choice1" ends it at once, choice 0 runs on.
    body = call(COMPLETIONS, {"prompt": "Hi", "n": 2, "stop": [" choice1"], "max_tokens": 3}).json()
    texts = {c["index"]: (c["text"], c["finish_reason"]) for c in body["choices"]}
    assert texts == {0: (" one two three", "length"), 1: ("", "stop")}


def test_all_choices_stopped_aborts_the_request(call, engine: ScriptedEngine) -> None:
    body = call(COMPLETIONS, {"prompt": "Hi", "stop": [" one"], "max_tokens": 8}).json()
    assert body["choices"][0]["finish_reason"] == "stop"
    assert engine.aborted == [engine.requests[-1].request_id]


def test_the_eos_that_ends_a_choice_is_listed_without_text(call, tokenizer: Tokenizer) -> None:
    # vLLM: the token that stopped generation (eos or a stop token id) is in the tokens and logprobs, and in
    # completion_tokens, but its text is not (even with skip_special_tokens=false), unless
    # include_stop_str_in_output.
    body = call(COMPLETIONS, {"prompt": "Hi", "max_tokens": 30, "logprobs": 0, "skip_special_tokens": False,
                              "return_token_ids": True}).json()
    choice = body["choices"][0]
    assert (choice["finish_reason"], choice["text"]) == ("stop", tokenizer.decode(tokenizer.encode(SCRIPT), False))
    assert choice["logprobs"]["tokens"][-1] == "<|im_end|>" and choice["logprobs"]["token_logprobs"][-1] == -0.25
    assert choice["completion_token_ids"][-1] == tokenizer.eos_token_ids[0]
    assert body["usage"]["completion_tokens"] == len(tokenizer.encode(SCRIPT)) + 1
    shown = call(COMPLETIONS, {"prompt": "Hi", "max_tokens": 30, "skip_special_tokens": False,
                               "include_stop_str_in_output": True}).json()
    assert shown["choices"][0]["text"].endswith(" eleven<|im_end|>")


def test_chat_logprobs_shape(call) -> None:
    body = call(CHAT, {"messages": HELLO, "logprobs": True, "top_logprobs": 3, "max_tokens": 2}).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert [item["token"] for item in content] == [" one", " two"]
    assert content[0]["bytes"] == list(b" one")
    assert len(content[0]["top_logprobs"]) == 3
    assert content[0]["top_logprobs"][0]["logprob"] == content[0]["logprob"]


def test_chat_streamed_logprobs_per_chunk(call) -> None:
    items = events(call(CHAT, {"messages": HELLO, "logprobs": True, "max_tokens": 3, "stream": True}))
    tokens = [entry["token"] for item in items[:-1] if item["choices"][0]["logprobs"]
              for entry in item["choices"][0]["logprobs"]["content"]]
    assert tokens == [" one", " two", " three"]


def test_completion_top_logprobs_include_the_chosen_token(call) -> None:
    body = call(COMPLETIONS, {"prompt": "Hi", "logprobs": 3, "max_tokens": 1}).json()
    top = body["choices"][0]["logprobs"]["top_logprobs"][0]
    assert len(top) == 3 and top[" one"] == -0.25


def test_default_max_tokens(call, engine: ScriptedEngine, tokenizer: Tokenizer) -> None:
    call(COMPLETIONS, {"prompt": "Hi"})
    assert engine.requests[-1].sampling_params.max_tokens == 16  # OpenAI's completions default
    call(CHAT, {"messages": HELLO})
    # Chat: the rest of the context, capped by the server's max_tokens_default (64 here).
    assert engine.requests[-1].sampling_params.max_tokens == 64
    long = [{"role": "user", "content": "word " * 200}]
    call(CHAT, {"messages": long})
    request = engine.requests[-1]
    assert request.sampling_params.max_tokens == MAX_MODEL_LEN - len(request.prompt_token_ids) < 64


def test_unknown_model_is_404(call) -> None:
    for path, base in BASE.items():
        response = call(path, {**base, "model": "gpt-4"})
        assert response.status_code == 404
        assert (response.json()["error"]["code"], response.json()["error"]["param"]) == ("model_not_found", "model")


@pytest.mark.parametrize("path, body, field", [
    (COMPLETIONS, {"prompt": "Hi", "logit_bias": {"99999999": 1}}, "logit_bias"),
    (COMPLETIONS, {"prompt": "Hi", "min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    (COMPLETIONS, {"prompt": [[1, 2], []]}, "prompt"),
    (COMPLETIONS, {"prompt": ""}, "prompt"),
    (COMPLETIONS, {"prompt": "Hi", "max_tokens": 0}, "max_tokens"),
    (CHAT, {"messages": [{"role": "user"}]}, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    (CHAT, {"messages": HELLO, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
])
def test_bad_values_are_400_naming_the_field(call, path: str, body: dict, field: str) -> None:
    assert_400(call(path, body), field)


def test_tool_choice_required_without_tools_is_400(call) -> None:
    assert_400(call(CHAT, {**BASE[CHAT], "tool_choice": "required"}), "tool_choice")


def test_tool_messages_are_accepted(call) -> None:
    messages = HELLO + [
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    assert call(CHAT, {"messages": messages, "max_tokens": 1}).status_code == 200


# --- vLLM's tokenizer endpoints -------------------------------------------------------------------------------


def get(engine: ScriptedEngine, path: str) -> httpx.Response:
    app = build_app(engine, MODEL, MAX_MODEL_LEN)

    async def run() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://scripted") as client:
            return await client.get(path)
    return asyncio.run(run())


def test_tokenize_and_detokenize(call, tokenizer: Tokenizer) -> None:
    body = call("/tokenize", {"prompt": "Hello there", "return_token_strs": True}).json()
    assert body == {"count": 2, "max_model_len": MAX_MODEL_LEN, "tokens": tokenizer.encode("Hello there"),
                    "token_strs": ["Hello", "Ġthere"]}
    chat = call("/tokenize", {"messages": HELLO}).json()
    assert chat["tokens"] == tokenizer.encode(tokenizer.apply_chat_template(HELLO))
    assert call("/detokenize", {"tokens": body["tokens"]}).json() == {"prompt": "Hello there"}
    assert_400(call("/detokenize", {"tokens": [10**9]}), "tokens")
    assert call("/tokenize", {"prompt": "x", "messages": HELLO}).status_code == 400
    assert call("/tokenize", {"prompt": "x", "model": "other"}).status_code == 404


def test_tokenizer_info(engine: ScriptedEngine, tokenizer: Tokenizer) -> None:
    info = get(engine, "/tokenizer_info").json()
    assert (info["eos_token"], info["bos_token"]) == (tokenizer.eos_token, tokenizer.bos_token)
    assert info["chat_template"] == tokenizer.chat_template and info["model_max_length"] == MAX_MODEL_LEN


def test_continuous_usage_stats_put_usage_on_every_chunk(call) -> None:
    items = events(call(COMPLETIONS, {"prompt": "Hi", "n": 2, "max_tokens": 3, "stream": True,
                                      "stream_options": {"include_usage": True, "continuous_usage_stats": True}}))
    chunks = [item for item in items[:-1] if item["choices"]]
    counts = [chunk["usage"]["completion_tokens"] for chunk in chunks]
    assert counts == sorted(counts) and counts[0] >= 1 and counts[-1] == 6
    assert all(chunk["usage"]["prompt_tokens"] == 1 for chunk in chunks)
    assert items[-2]["choices"] == [] and items[-2]["usage"]["completion_tokens"] == 6
    # Without include_usage it would change nothing: a 400 rather than silently nothing.
    assert_400(call(COMPLETIONS, {"prompt": "Hi", "max_tokens": 2, "stream": True,
                                  "stream_options": {"continuous_usage_stats": True}}), "stream_options")


def test_more_choices_than_the_engine_runs_at_once_is_a_400(engine: ScriptedEngine) -> None:
    app = build_app(engine, MODEL, MAX_MODEL_LEN, max_num_seqs=4)

    async def run(n: int) -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://scripted") as client:
            return await client.post(COMPLETIONS, json={"prompt": "Hi", "n": n, "max_tokens": 2})
    response = asyncio.run(run(5))
    assert_400(response, "n")
    assert "--max-num-seqs 4" in response.json()["error"]["message"]
    assert len(asyncio.run(run(4)).json()["choices"]) == 4
