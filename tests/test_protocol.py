"""The OpenAI protocol layer (engine/entrypoints/protocol.py) on its own: no server, no engine.

Request bodies go through the same entry point the server uses (``parse`` on raw JSON bytes);
response builders are checked against the ``openai`` package's own response models, so a
missing or misnamed field fails here before a client sees it.
"""
from __future__ import annotations

import json
import logging

import pytest
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from engine.entrypoints.protocol import (SSE_DONE, APIError, ChatCompletionRequest, CompletionRequest, chat_completion_chunk,
                             chat_completion_response, completion_chunk, completion_response, error_body, model_list,
                             sse_event, usage, usage_chunk)

logger = logging.getLogger(__name__)


def parse_completion(**fields: object) -> CompletionRequest:
    return CompletionRequest.parse(json.dumps(fields).encode())


def parse_chat(**fields: object) -> ChatCompletionRequest:
    fields.setdefault("messages", [{"role": "user", "content": "hi"}])
    return ChatCompletionRequest.parse(json.dumps(fields).encode())


def rejected(parse, **fields: object) -> APIError:
    with pytest.raises(APIError) as info:
        request = parse(**fields)
        request.check_supported()
    return info.value


# --- parsing -----------------------------------------------------------------------------------

@pytest.mark.parametrize("prompt, expected", [
    ("Once upon a time", "Once upon a time"),
    (["Once upon a time"], "Once upon a time"),
    ([1, 2, 3], [1, 2, 3]),
    ([[4, 5]], [4, 5]),
    ([7], [7]),
])
def test_prompt_shapes_are_normalised(prompt: object, expected: object) -> None:
    assert parse_completion(prompt=prompt).prompt == expected


@pytest.mark.parametrize("prompt", [
    {"text": "hi"}, [], [[]], ["a", "b"], [[1], [2]], [1, "a"], [True, 2], [1.5], 5, None,
])
def test_bad_prompt_shapes_are_400_naming_prompt(prompt: object) -> None:
    error = rejected(parse_completion, prompt=prompt)
    assert error.status_code == 400
    assert error.param == "prompt"
    assert error.message.startswith("prompt: ")
    assert "Value error" not in error.message


def test_missing_prompt_is_400() -> None:
    with pytest.raises(APIError) as info:
        CompletionRequest.parse(b'{"max_tokens": 5}')
    error = info.value
    assert (error.status_code, error.param) == (400, "prompt")
    assert "required" in error.message.lower()


@pytest.mark.parametrize("field, value", [
    ("max_tokens", "5"), ("max_tokens", 5.5), ("temperature", "hot"), ("temperature", True),
    ("top_p", [0.5]), ("top_k", 1.0), ("seed", "42"), ("stream", "yes"), ("stream", 1),
    ("stop", 5), ("stop", ["ok", 3]), ("n", "1"), ("ignore_eos", "true"), ("return_token_ids", 1),
    ("user", 7), ("stream_options", {"include_usage": "yes"}), ("stream_options", True), ("model", 3),
])
def test_wrong_types_are_400_not_coerced(field: str, value: object) -> None:
    error = rejected(parse_completion, prompt="hi", **{field: value})
    assert error.status_code == 400
    assert error.param == field
    assert field in error.message


@pytest.mark.parametrize("body", [b'{"prompt": "x", "temperature": NaN}', b'{"prompt": "x", "top_p": Infinity}',
                                  b'{"prompt": "x", "temperature": 1e400}'])
def test_non_finite_numbers_are_400(body: bytes) -> None:
    with pytest.raises(APIError) as info:
        CompletionRequest.parse(body)
    assert info.value.status_code == 400


def test_invalid_json_and_non_object_bodies() -> None:
    with pytest.raises(APIError) as info:
        CompletionRequest.parse(b'{"prompt": "x",')
    assert info.value.code == "invalid_json"
    assert "not valid JSON" in info.value.message
    for body in (b"[1, 2]", b'"hello"', b"null"):
        with pytest.raises(APIError) as info:
            ChatCompletionRequest.parse(body)
        assert info.value.status_code == 400
        assert "JSON object" in info.value.message


def test_unknown_fields_are_ignored() -> None:
    request = parse_completion(prompt="hi", metadata={"a": 1}, service_tier="auto", something_new=[1, 2])
    request.check_supported()
    assert request.prompt == "hi"


def test_chat_messages_validation() -> None:
    assert rejected(parse_chat, messages="hi").param == "messages"
    assert rejected(parse_chat, messages=[{"content": "no role"}]).param == "messages"
    assert rejected(parse_chat, messages=[]).param == "messages"
    request = parse_chat(messages=[{"role": "user", "content": "hi", "name": "bob"},
                                   {"role": "assistant", "content": None, "tool_calls": []}])
    # Extra keys reach the chat template untouched.
    assert request.message_dicts() == [{"role": "user", "content": "hi", "name": "bob"},
                                       {"role": "assistant", "content": None, "tool_calls": []}]


# --- unsupported features ----------------------------------------------------------------------

@pytest.mark.parametrize("parse, field, value", [
    (parse_completion, "n", 2), (parse_completion, "n", 0), (parse_chat, "n", 3),
    (parse_completion, "logprobs", 1), (parse_chat, "logprobs", True), (parse_chat, "top_logprobs", 2),
    (parse_completion, "echo", True), (parse_completion, "suffix", "end"), (parse_completion, "best_of", 2),
    (parse_completion, "presence_penalty", 0.5), (parse_chat, "frequency_penalty", -1.0),
    (parse_completion, "logit_bias", {"50256": -100}), (parse_completion, "stop", ""),
    (parse_chat, "stop", ["ok", ""]),
])
def test_unsupported_features_are_400(parse, field: str, value: object) -> None:
    fields = {field: value}
    if parse is parse_completion:
        fields["prompt"] = "hi"
    error = rejected(parse, **fields)
    assert (error.status_code, error.param) == (400, field)


def test_supported_neutral_values_pass() -> None:
    parse_completion(prompt="hi", n=1, logprobs=0, echo=False, presence_penalty=0, frequency_penalty=0.0,
                     best_of=1, logit_bias={}, stop=[]).check_supported()
    parse_chat(n=1, logprobs=False, top_logprobs=0).check_supported()


def test_model_name_check() -> None:
    for name in (None, "", "smollm"):
        parse_completion(prompt="hi", model=name).check_model("smollm")
    with pytest.raises(APIError) as info:
        parse_completion(prompt="hi", model="gpt-4").check_model("smollm")
    assert (info.value.status_code, info.value.code, info.value.param) == (400, "model_not_found", "model")


# --- sampling parameters -----------------------------------------------------------------------

def test_sampling_params_defaults() -> None:
    params = parse_completion(prompt="hi").to_sampling_params(max_tokens=100)
    assert (params.temperature, params.top_p, params.top_k, params.seed) == (1.0, 1.0, 0, None)
    assert (params.max_tokens, params.stop, params.stop_token_ids, params.ignore_eos) == (100, [], [], False)


def test_sampling_params_carry_request_values() -> None:
    request = parse_chat(temperature=0, top_p=0.9, top_k=20, seed=7, stop="###", stop_token_ids=[5],
                         ignore_eos=True)
    params = request.to_sampling_params(max_tokens=12)
    assert (params.temperature, params.top_p, params.top_k, params.seed) == (0.0, 0.9, 20, 7)
    assert (params.max_tokens, params.stop, params.stop_token_ids, params.ignore_eos) == (12, ["###"], [5], True)
    assert params.greedy


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("seed", -1),
])
def test_out_of_range_sampling_values_are_400(field: str, value: object) -> None:
    with pytest.raises(APIError) as info:
        parse_completion(prompt="hi", **{field: value}).to_sampling_params(max_tokens=10)
    assert (info.value.status_code, info.value.param) == (400, field)


def test_negative_max_tokens_names_the_field_the_client_sent() -> None:
    completion = parse_completion(prompt="hi", max_tokens=-5)
    with pytest.raises(APIError) as info:
        completion.to_sampling_params(completion.requested_max_tokens)
    assert (info.value.param, "-5" in info.value.message) == ("max_tokens", True)
    chat = parse_chat(max_completion_tokens=0)
    with pytest.raises(APIError) as info:
        chat.to_sampling_params(chat.requested_max_tokens)
    assert info.value.param == "max_completion_tokens"


def test_chat_max_completion_tokens_wins_over_max_tokens() -> None:
    assert parse_chat(max_tokens=10, max_completion_tokens=20).requested_max_tokens == 20
    assert parse_chat(max_tokens=10).requested_max_tokens == 10
    assert parse_chat().requested_max_tokens is None


def test_stream_options() -> None:
    assert parse_chat(stream=True, stream_options={"include_usage": True}).include_usage
    assert not parse_chat(stream=True, stream_options={"include_usage": False}).include_usage
    assert not parse_chat(stream=True).include_usage


# --- responses ---------------------------------------------------------------------------------

def test_usage_shape() -> None:
    assert usage(10, 4, cached_tokens=8) == {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14,
                                             "prompt_tokens_details": {"cached_tokens": 8}}


def test_completion_response_matches_openai_schema() -> None:
    body = completion_response("cmpl-1", 1700000000, "smollm", "Hello", "length", usage(3, 2, 0))
    parsed = Completion.model_validate(body)
    assert (parsed.object, parsed.choices[0].text, parsed.choices[0].finish_reason) == \
        ("text_completion", "Hello", "length")
    assert parsed.usage.total_tokens == 5
    assert "prompt_token_ids" not in body["choices"][0]


def test_token_ids_extension_in_responses() -> None:
    body = completion_response("cmpl-1", 1, "m", "Hi", "stop", usage(2, 1), prompt_token_ids=[1, 2],
                               completion_token_ids=[3])
    assert body["choices"][0]["prompt_token_ids"] == [1, 2]
    assert body["choices"][0]["completion_token_ids"] == [3]
    chat = chat_completion_response("chatcmpl-1", 1, "m", "Hi", "stop", usage(2, 1), prompt_token_ids=[1, 2],
                                    completion_token_ids=[3])
    assert (chat["choices"][0]["prompt_token_ids"], chat["choices"][0]["completion_token_ids"]) == ([1, 2], [3])


def test_chat_completion_response_matches_openai_schema() -> None:
    body = chat_completion_response("chatcmpl-1", 1700000000, "smollm", "Hi there", "stop", usage(30, 3, 16))
    parsed = ChatCompletion.model_validate(body)
    assert parsed.object == "chat.completion"
    assert (parsed.choices[0].message.role, parsed.choices[0].message.content) == ("assistant", "Hi there")
    assert parsed.usage.prompt_tokens_details.cached_tokens == 16


def test_chat_chunks_match_openai_schema() -> None:
    first = ChatCompletionChunk.model_validate(
        chat_completion_chunk("chatcmpl-1", 1, "m", "", role="assistant", with_usage_field=True))
    assert (first.choices[0].delta.role, first.choices[0].delta.content, first.usage) == ("assistant", "", None)
    middle = chat_completion_chunk("chatcmpl-1", 1, "m", "Hel", completion_token_ids=[5])
    assert middle["choices"][0]["delta"] == {"content": "Hel"}
    assert middle["choices"][0]["completion_token_ids"] == [5]
    assert "usage" not in middle
    last = ChatCompletionChunk.model_validate(chat_completion_chunk("chatcmpl-1", 1, "m", None, finish_reason="stop"))
    assert (last.choices[0].delta.content, last.choices[0].finish_reason) == (None, "stop")
    final = ChatCompletionChunk.model_validate(usage_chunk("chat.completion.chunk", "chatcmpl-1", 1, "m",
                                                           usage(5, 2)))
    assert final.choices == [] and final.usage.total_tokens == 7


def test_completion_chunk_shape() -> None:
    chunk = completion_chunk("cmpl-1", 1, "m", " world", prompt_token_ids=[1], completion_token_ids=[9],
                             with_usage_field=True)
    assert chunk == {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
                     "choices": [{"index": 0, "text": " world", "logprobs": None, "finish_reason": None,
                                  "prompt_token_ids": [1], "completion_token_ids": [9]}],
                     "usage": None}
    finished = Completion.model_validate(completion_chunk("cmpl-1", 1, "m", "", finish_reason="length"))
    assert finished.choices[0].finish_reason == "length"


def test_model_list_matches_openai_schema() -> None:
    body = model_list("smollm", 2048, created=5)
    assert body["object"] == "list"
    model = Model.model_validate(body["data"][0])
    assert (model.id, model.object, model.created) == ("smollm", "model", 5)


def test_error_body_shape() -> None:
    assert error_body("bad thing", param="top_p") == {
        "error": {"message": "bad thing", "type": "invalid_request_error", "param": "top_p", "code": None}}
    error = APIError("too big", status_code=413, code="request_too_large")
    assert error.body()["error"]["code"] == "request_too_large"
    assert error.status_code == 413


def test_sse_event_framing() -> None:
    event = sse_event({"text": "héllo 日本"})
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert event.count(b"\n") == 2
    assert json.loads(event[len(b"data: "):].decode("utf-8")) == {"text": "héllo 日本"}
    assert SSE_DONE == b"data: [DONE]\n\n"
