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

from engine.entrypoints.protocol import (SSE_DONE, APIError, ChatCompletionRequest, CompletionRequest, chat_choice,
                                         chat_completion_chunk, chat_completion_response, chat_delta_choice,
                                         completion_choice, completion_chunk, completion_response, error_body,
                                         model_list, sse_event, usage, usage_chunk)

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
    ("Once upon a time", ["Once upon a time"]),
    (["Once upon a time"], ["Once upon a time"]),
    ([1, 2, 3], [[1, 2, 3]]),
    ([[4, 5]], [[4, 5]]),
    ([7], [[7]]),
    (["a", "b"], ["a", "b"]),
    ([[1], [2, 3]], [[1], [2, 3]]),
])
def test_prompt_shapes_are_normalised_to_a_list_of_prompts(prompt: object, expected: object) -> None:
    assert parse_completion(prompt=prompt).prompts == expected


@pytest.mark.parametrize("prompt", [
    {"text": "hi"}, [], [[]], "", ["a", ""], [[1], []], ["a", [1]], [1, "a"], [True, 2], [1.5], [[1, 2.5]], 5, None,
    ["x"] * 257,
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


def test_unknown_fields_are_ignored_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="engine.entrypoints.protocol"):
        for _ in range(3):
            request = parse_completion(prompt="hi", metadata={"a": 1}, service_tier="auto", something_new=[1, 2])
            request.check_supported()
    assert request.prompts == ["hi"]
    assert [r.getMessage() for r in caplog.records].count(
        "ignoring the unknown request field 'something_new' (logged once)") == 1
    assert not any("metadata" in r.getMessage() for r in caplog.records)  # a declared field


def test_chat_messages_validation() -> None:
    assert rejected(parse_chat, messages="hi").param == "messages"
    assert rejected(parse_chat, messages=[{"content": "no role"}]).param == "messages"
    assert rejected(parse_chat, messages=[]).param == "messages"
    assert "unknown role" in rejected(parse_chat, messages=[{"role": "robot", "content": "hi"}]).message
    assert "needs content" in rejected(parse_chat, messages=[{"role": "user"}]).message
    assert rejected(parse_chat, messages=[{"role": "user", "content": None}]).param == "messages"
    assert rejected(parse_chat, messages=[{"role": "assistant", "content": None, "tool_calls": []}]).param \
        == "messages"
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    request = parse_chat(messages=[{"role": "user", "content": "hi", "name": "bob"},
                                   {"role": "assistant", "content": None, "tool_calls": calls},
                                   {"role": "tool", "content": "42", "tool_call_id": "c1"}])
    # Extra keys reach the chat template untouched.
    assert request.message_dicts() == [{"role": "user", "content": "hi", "name": "bob"},
                                       {"role": "assistant", "content": None, "tool_calls": calls},
                                       {"role": "tool", "content": "42", "tool_call_id": "c1"}]


# --- unsupported features ----------------------------------------------------------------------

@pytest.mark.parametrize("parse, field, value", [
    (parse_completion, "n", 0), (parse_chat, "n", 129), (parse_completion, "logprobs", 21),
    (parse_completion, "logprobs", -1), (parse_chat, "top_logprobs", 2), (parse_chat, "top_logprobs", 0),
    (parse_chat, "top_logprobs", 21),
    (parse_completion, "suffix", "end"), (parse_completion, "best_of", 2), (parse_chat, "best_of", 3),
    (parse_completion, "presence_penalty", 2.5), (parse_chat, "frequency_penalty", -2.1),
    (parse_completion, "repetition_penalty", 0.0), (parse_chat, "repetition_penalty", 4.7e-219),
    (parse_completion, "repetition_penalty", 101.0), (parse_chat, "min_p", 1.5), (parse_completion, "min_tokens", -1),
    (parse_completion, "logit_bias", {"abc": 1}), (parse_completion, "logit_bias", {"-3": 1}),
    (parse_completion, "logit_bias", {"5": 101}), (parse_completion, "stop", ""), (parse_chat, "stop", ["ok", ""]),
    (parse_completion, "prompt_logprobs", 21), (parse_completion, "max_completion_tokens", 5),
    (parse_completion, "max_tokens", 0), (parse_chat, "stream_options", {"include_usage": True}),
    (parse_chat, "modalities", ["text", "audio"]), (parse_chat, "echo", True),
    (parse_completion, "use_beam_search", True), (parse_chat, "priority", 1), (parse_chat, "cache_salt", "x"),
    (parse_completion, "bad_words", [""]), (parse_completion, "truncate_prompt_tokens", 0),
])
def test_unsupported_or_out_of_range_values_are_400(parse, field: str, value: object) -> None:
    fields = {field: value}
    if parse is parse_completion:
        fields["prompt"] = "hi"
    error = rejected(parse, **fields)
    assert (error.status_code, error.param) == (400, field)


def test_supported_and_neutral_values_pass() -> None:
    parse_completion(prompt="hi", n=1, logprobs=0, echo=False, presence_penalty=0, frequency_penalty=0.0,
                     best_of=1, logit_bias={}, stop=[], suffix="", priority=0, use_beam_search=False).check_supported()
    parse_completion(prompt=["a", "b"], n=3, best_of=3, logprobs=5, echo=True, max_tokens=0,
                     presence_penalty=-2, frequency_penalty=2, repetition_penalty=1.3, min_p=0.1, min_tokens=2,
                     logit_bias={"12": -100, " 7": 100}, prompt_logprobs=20).check_supported()
    parse_chat(n=1, logprobs=False, modalities=["text"], stream=True,
               stream_options={"include_usage": True}).check_supported()
    parse_chat(logprobs=True, top_logprobs=20, tool_choice="none", parallel_tool_calls=True, user="u",
               metadata={"k": "v"}, store=False, service_tier="auto", prompt_cache_key="k",
               safety_identifier="s", request_id="r").check_supported()


def test_model_name_check() -> None:
    for name in (None, "", "smollm"):
        parse_completion(prompt="hi", model=name).check_model("smollm")
    with pytest.raises(APIError) as info:
        parse_completion(prompt="hi", model="gpt-4").check_model("smollm")
    assert (info.value.status_code, info.value.code, info.value.param) == (404, "model_not_found", "model")


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
    choices = [completion_choice(0, "Hello", "length"), completion_choice(1, " there", "stop")]
    body = completion_response("cmpl-1", 1700000000, "smollm", choices, usage(3, 2, 0))
    parsed = Completion.model_validate(body)
    assert (parsed.object, parsed.choices[0].text, parsed.choices[0].finish_reason) == \
        ("text_completion", "Hello", "length")
    assert [c.index for c in parsed.choices] == [0, 1]
    assert parsed.usage.total_tokens == 5
    assert "prompt_token_ids" not in body["choices"][0] and "prompt_logprobs" not in body["choices"][0]


def test_completion_logprobs_validate_against_openai_schema() -> None:
    # (An echoed prompt's first token has null logprobs, as OpenAI and vLLM send; the openai package's
    # strict model has no room for that null, and its client does not validate responses with it.)
    logprobs = {"tokens": ["Hi", " there"], "token_logprobs": [-0.1, -0.5],
                "top_logprobs": [{"Hi": -0.1}, {" there": -0.5}], "text_offset": [0, 2]}
    body = completion_response("cmpl-1", 1, "m", [completion_choice(0, "Hi there", "stop", logprobs=logprobs)],
                               usage(1, 1))
    parsed = Completion.model_validate(body)
    assert parsed.choices[0].logprobs.token_logprobs == [-0.1, -0.5]
    assert parsed.choices[0].logprobs.text_offset == [0, 2]


def test_token_ids_and_prompt_logprobs_extensions_in_responses() -> None:
    choice = completion_choice(0, "Hi", "stop", prompt_token_ids=[1, 2], completion_token_ids=[3],
                               prompt_logprobs=[None, {"2": {"logprob": -1.0, "rank": 1, "decoded_token": "x"}}])
    body = completion_response("cmpl-1", 1, "m", [choice], usage(2, 1))
    assert body["choices"][0]["prompt_token_ids"] == [1, 2]
    assert body["choices"][0]["completion_token_ids"] == [3]
    assert body["choices"][0]["prompt_logprobs"][0] is None
    chat = chat_completion_response("chatcmpl-1", 1, "m", [chat_choice(0, "Hi", "stop", prompt_token_ids=[1, 2],
                                                                       completion_token_ids=[3])],
                                    usage(2, 1), prompt_logprobs=[None])
    assert (chat["choices"][0]["prompt_token_ids"], chat["choices"][0]["completion_token_ids"]) == ([1, 2], [3])
    assert chat["prompt_logprobs"] == [None]  # vLLM puts it at the top of a chat response


def test_chat_completion_response_matches_openai_schema() -> None:
    logprobs = {"content": [{"token": "Hi", "logprob": -0.1, "bytes": [72, 105],
                             "top_logprobs": [{"token": "Hi", "logprob": -0.1, "bytes": [72, 105]}]}]}
    body = chat_completion_response("chatcmpl-1", 1700000000, "smollm",
                                    [chat_choice(0, "Hi there", "stop", logprobs=logprobs),
                                     chat_choice(1, "Hello", "length")], usage(30, 3, 16))
    parsed = ChatCompletion.model_validate(body)
    assert parsed.object == "chat.completion"
    assert (parsed.choices[0].message.role, parsed.choices[0].message.content) == ("assistant", "Hi there")
    assert parsed.choices[0].logprobs.content[0].top_logprobs[0].bytes == [72, 105]
    assert parsed.choices[1].index == 1 and parsed.choices[1].logprobs is None
    assert parsed.usage.prompt_tokens_details.cached_tokens == 16
    assert "prompt_logprobs" not in body


def test_chat_chunks_match_openai_schema() -> None:
    first = ChatCompletionChunk.model_validate(
        chat_completion_chunk("chatcmpl-1", 1, "m", chat_delta_choice(2, "", role="assistant"), with_usage_field=True))
    assert (first.choices[0].delta.role, first.choices[0].delta.content, first.usage) == ("assistant", "", None)
    assert first.choices[0].index == 2
    middle = chat_completion_chunk("chatcmpl-1", 1, "m", chat_delta_choice(0, "Hel", completion_token_ids=[5]))
    assert middle["choices"][0]["delta"] == {"content": "Hel"}
    assert middle["choices"][0]["completion_token_ids"] == [5]
    assert "usage" not in middle and "prompt_logprobs" not in middle
    last = ChatCompletionChunk.model_validate(
        chat_completion_chunk("chatcmpl-1", 1, "m", chat_delta_choice(0, None, finish_reason="stop")))
    assert (last.choices[0].delta.content, last.choices[0].finish_reason) == (None, "stop")
    final = ChatCompletionChunk.model_validate(usage_chunk("chat.completion.chunk", "chatcmpl-1", 1, "m",
                                                           usage(5, 2)))
    assert final.choices == [] and final.usage.total_tokens == 7


def test_completion_chunk_shape() -> None:
    chunk = completion_chunk("cmpl-1", 1, "m", completion_choice(3, " world", None, prompt_token_ids=[1],
                                                                 completion_token_ids=[9]), with_usage_field=True)
    assert chunk == {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
                     "choices": [{"index": 3, "text": " world", "logprobs": None, "finish_reason": None,
                                  "prompt_token_ids": [1], "completion_token_ids": [9]}],
                     "usage": None}
    finished = Completion.model_validate(completion_chunk("cmpl-1", 1, "m", completion_choice(0, "", "length")))
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


# --- choices and logprobs formatting (engine/entrypoints/choices.py, logprobs_format.py) ------------------------

@pytest.fixture(scope="module")
def tokenizer():
    from config.model_config import default_model_path
    from engine.tokenizer import load_tokenizer
    return load_tokenizer(default_model_path())


def test_a_character_split_across_tokens_is_released_with_its_last_byte(tokenizer) -> None:
    from engine.entrypoints.choices import ChoiceState
    from engine.entrypoints.logprobs_format import TokenTexts, chat_logprobs, completion_logprobs
    from inter_communicator.messages import TokenLogprobs

    ids = tokenizer.encode(" 日 ok")  # " 日" is three byte-level tokens: " \xe6", "\x97", "\xa5"
    state = ChoiceState(0, tokenizer, [])
    deltas = [state.add([token], [TokenLogprobs(token, -0.5, 1, [token], [-0.5])], i == len(ids) - 1,
                        "length" if i == len(ids) - 1 else None) for i, token in enumerate(ids)]
    # The space before the split character goes out at once with the first token; the two tokens that
    # complete the character wait (no text yet) and go out with it.
    assert [(d.text, d.token_ids) for d in deltas] == [(" ", ids[:1]), ("", []), ("日", ids[1:3]), (" ok", ids[3:])]
    entries = [e for d in deltas for e in d.entries]
    assert [e.token_id for e in entries] == ids and [e.offset for e in entries] == sorted(e.offset for e in entries)
    texts = TokenTexts(tokenizer)
    # Raw bytes of each token add up to the text's UTF-8, even where one token holds part of a character.
    assert b"".join(bytes(item["bytes"]) for item in chat_logprobs(entries, texts, 0)["content"]) \
        == " 日 ok".encode()
    shown = completion_logprobs(entries, texts, 1)
    assert shown["token_logprobs"] == [-0.5] * len(ids)
    assert all(len(top) == 1 for top in shown["top_logprobs"])


def test_stop_string_cut_and_include_stop_str(tokenizer) -> None:
    from engine.entrypoints.choices import ChoiceState

    ids = tokenizer.encode(" one two three four")
    for include, text, kept in ((False, " one", 1), (True, " one two", 2)):
        state = ChoiceState(3, tokenizer, [" two"], include_stop_str=include)
        deltas = [state.add([token], None, False, None) for token in ids]
        assert "".join(d.text for d in deltas) == text
        assert [e.token_id for d in deltas for e in d.entries] == ids[:kept]
        assert state.finish_reason == "stop" and deltas[-1].index == 3
        # Tokens the engine sends after the cut are not shown.
        assert state.add(ids[:1], None, True, "length").empty


def test_echo_only_choice_drops_the_generated_token(tokenizer) -> None:
    from engine.entrypoints.choices import ChoiceState, PromptEcho

    state = ChoiceState(0, tokenizer, [], drop_generated=True)
    delta = state.add([42], None, True, "length")
    assert (delta.text, delta.token_ids, delta.finish_reason, state.completion_tokens) == ("", [], "length", 0)
    prompt = PromptEcho.build(tokenizer, tokenizer.encode("Hello there"), None)
    assert prompt.text == "Hello there" and [e.offset for e in prompt.entries] == [0, 5]


def test_vllm_prompt_logprobs_shape(tokenizer) -> None:
    from engine.entrypoints.logprobs_format import NEG_INF_LOGPROB, TokenTexts, vllm_prompt_logprobs
    from inter_communicator.messages import TokenLogprobs

    ids = tokenizer.encode("Hello there")
    shown = vllm_prompt_logprobs(ids, [None, TokenLogprobs(ids[1], float("-inf"), 7, [5, 6], [-0.1, -0.2])],
                                 TokenTexts(tokenizer), 2)
    assert shown[0] is None
    assert shown[1] == {"5": {"logprob": -0.1, "rank": 1, "decoded_token": tokenizer.decode([5], False)},
                        "6": {"logprob": -0.2, "rank": 2, "decoded_token": tokenizer.decode([6], False)},
                        str(ids[1]): {"logprob": NEG_INF_LOGPROB, "rank": 7, "decoded_token": " there"}}


def test_a_stop_token_id_is_listed_without_its_text(tokenizer) -> None:
    from engine.entrypoints.choices import ChoiceState

    one, two = tokenizer.encode(" one two")
    for include, text in ((False, " one"), (True, " one two")):
        state = ChoiceState(0, tokenizer, [], stop_token_ids=[two], include_stop_str=include)
        first, last = state.add([one], None, False, None), state.add([two], None, True, "stop")
        assert first.text + last.text == text
        assert first.token_ids + last.token_ids == [one, two] and state.completion_tokens == 2
    # The same token ending by length is ordinary text.
    state = ChoiceState(0, tokenizer, [], stop_token_ids=[two])
    assert state.add([one, two], None, True, "length").text == " one two"
