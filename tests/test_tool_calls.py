"""Tools: request validation (400s), prompt rendering (SmolLM2's template and the fallback), the schema
``required`` / named calls are decoded under, parsing calls out of text (whole and streamed), and shapes.

Decoding under the call schema is checked with the real tokenizer and a random sampler masked by the
engine's grammar manager: every output must parse into calls whose arguments validate.
"""
from __future__ import annotations

import asyncio
import json

import jsonschema
import numpy as np
import openai
import pytest

from config.model_config import default_model_path
from config.sampling_params import InvalidRequestError
from engine.entrypoints.structured_request import StructuredRequestError
from engine.entrypoints.tool_calls import (
    ToolCallStream,
    could_be_tool_call,
    fallback_tool_prompt,
    parse_tool_calls,
    parse_tool_request,
    render_chat,
    template_takes_tools,
    tool_call_deltas,
    tool_call_schema,
    tool_call_spec,
    tool_calls_message,
)
from engine.structured_output import StructuredOutputManager, ll_tokenizer_from
from engine.tokenizer import Tokenizer, load_tokenizer
from harness.server import ServerProcess

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8},
                           "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                           "b": {"type": "integer", "minimum": -99, "maximum": 99}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, ADD]
PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer(default_model_path())


def request_of(**fields):
    return parse_tool_request({"tools": TOOLS, **fields})


# -- request validation


def test_defaults_and_choices() -> None:
    assert parse_tool_request({}) is None
    assert parse_tool_request({"tools": [], "tool_choice": "none"}) is None
    assert parse_tool_request({"tool_choice": "auto", "parallel_tool_calls": False}) is None
    auto = request_of()
    assert (auto.choice, auto.parallel, auto.active, auto.constrained) == ("auto", True, True, False)
    assert [tool.name for tool in auto.tools] == ["get_weather", "add"]
    assert request_of(tool_choice="none").active is False
    assert request_of(tool_choice="required").constrained
    named = request_of(tool_choice={"type": "function", "function": {"name": "add"}}, parallel_tool_calls=False)
    assert (named.choice, named.function_name, named.parallel) == ("function", "add", False)
    no_params = parse_tool_request({"tools": [{"type": "function", "function": {"name": "now"}}]})
    assert no_params.tools[0].parameters["type"] == "object"


@pytest.mark.parametrize("fields, param, message", [
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice", "needs tools"),
    ({"tools": {"type": "function"}}, "tools", "must be a list"),
    ({"tools": [{"type": "retrieval"}]}, "tools", "tools[0].type must be 'function'"),
    ({"tools": [{"type": "function"}]}, "tools", "tools[0].function must be an object"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools", "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "given twice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools",
     "parameters must be a JSON schema object"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]}, "tools",
     "tools[0].function.parameters does not compile"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "tool_choice must be"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice",
     "not in tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice", "tool_choice must be"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls", "must be a boolean"),
])
def test_bad_tool_fields_are_400s_naming_the_field(fields, param, message) -> None:
    with pytest.raises(StructuredRequestError) as info:
        parse_tool_request(fields)
    assert info.value.param == param
    assert message in str(info.value)


# -- schema of constrained calls


def test_required_schema_accepts_calls_and_rejects_others() -> None:
    schema = tool_call_schema(request_of(tool_choice="required"))
    good = {"name": "add", "arguments": {"a": 1, "b": 2}}
    jsonschema.validate(good, schema)
    jsonschema.validate([good, {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}], schema)
    for bad in ({"name": "add", "arguments": {"a": 1}}, {"name": "sub", "arguments": {"a": 1, "b": 2}}, [], good["arguments"]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = tool_call_schema(request_of(tool_choice="required", parallel_tool_calls=False))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([good], single)


def test_named_schema_is_the_functions_parameters() -> None:
    request = request_of(tool_choice={"type": "function", "function": {"name": "add"}})
    assert tool_call_schema(request) == PARAMETERS["add"]
    assert tool_call_spec(request_of()) is None and tool_call_spec(request_of(tool_choice="none")) is None


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("choice", ["required", "named"])
def test_decoding_under_the_call_schema_always_yields_valid_calls(tokenizer, choice, seed) -> None:
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": "get_weather"}}
    request = request_of(tool_choice=tool_choice)
    vocab = 49152
    manager = StructuredOutputManager(ll_tokenizer_from(tokenizer.backend, tokenizer.eos_token_ids, vocab), vocab,
                                      tokenizer_vocab_size=tokenizer.vocab_size)
    rng = np.random.default_rng(seed)
    try:
        manager.add("call", tool_call_spec(request))
        assert manager.wait_ready("call", 30.0) and manager.error("call") is None
        tokens = []
        for _ in range(300):
            if manager.is_finished("call"):
                break
            bits = np.unpackbits(manager.bitmask("call").view(np.uint8), bitorder="little")
            allowed = np.flatnonzero(bits)
            # Uniform over the allowed tokens: the bounded parameter schemas keep the calls short.
            token = int(allowed[rng.integers(allowed.size)])
            assert manager.accept("call", token)
            if token in tokenizer.eos_token_ids:
                break
            tokens.append(token)
        else:
            pytest.fail(f"no complete call in 300 tokens: {tokenizer.decode(tokens)!r}")
    finally:
        manager.close()
    calls = parse_tool_calls(tokenizer.decode(tokens), request)
    assert calls, tokenizer.decode(tokens)
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), PARAMETERS[call.name])
    if choice == "named":
        assert [call.name for call in calls] == ["get_weather"]


# -- rendering


def test_smollm2_template_does_not_take_tools_so_the_fallback_prompt_is_used(tokenizer) -> None:
    assert not template_takes_tools(tokenizer)
    request = request_of()
    messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
    prompt = render_chat(tokenizer, messages, request)
    assert prompt.startswith("<|im_start|>system\nYou can call the following functions.")
    assert '"name": "get_weather"' in prompt and '"name": "add"' in prompt
    assert '{"name": "<function name>", "arguments":' in prompt
    assert prompt.endswith("<|im_start|>user\nWhat is the weather in Oslo?<|im_end|>\n<|im_start|>assistant\n")
    without = render_chat(tokenizer, messages, None)
    assert without == tokenizer.apply_chat_template(messages)
    # tool_choice none: tools are not rendered.
    assert render_chat(tokenizer, messages, request_of(tool_choice="none")) == without
    # A client system prompt is kept, the tool text appended to it.
    system = render_chat(tokenizer, [{"role": "system", "content": "Be brief."}, *messages], request)
    assert system.startswith("<|im_start|>system\nBe brief.\n\nYou can call the following functions.")


def test_fallback_prompt_states_the_choice() -> None:
    assert "You must call one of the functions." in fallback_tool_prompt(request_of(tool_choice="required"))
    named = fallback_tool_prompt(request_of(tool_choice={"type": "function", "function": {"name": "add"}}))
    assert 'You must call the function "add"' in named
    assert "JSON list" not in fallback_tool_prompt(request_of(parallel_tool_calls=False))


def test_follow_up_turn_with_tool_results_is_rendered(tokenizer) -> None:
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12 degrees, rain"},
    ]
    prompt = render_chat(tokenizer, messages, request_of())
    assert ('<|im_start|>assistant\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}'
            '<|im_end|>') in prompt
    assert "<|im_start|>user\nResult of get_weather (call call_1): 12 degrees, rain<|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    # Without tools in the follow-up request the history is still rendered the same way.
    assert "Result of get_weather (call call_1)" in render_chat(tokenizer, messages, None)


class _ToolTemplateTokenizer:
    """A tokenizer whose template takes ``tools`` (the case SmolLM2 does not cover)."""

    chat_template = "{% for t in tools %}{{ t.function.name }};{% endfor %}{{ messages[-1].content }}"

    def apply_chat_template(self, messages, add_generation_prompt=True, tools=None):
        names = "".join(f"{tool['function']['name']};" for tool in tools or [])
        return names + messages[-1]["content"]


def test_template_that_takes_tools_gets_them() -> None:
    fake = _ToolTemplateTokenizer()
    assert template_takes_tools(fake)
    assert render_chat(fake, [{"role": "user", "content": "hi"}], request_of()) == "get_weather;add;hi"


@pytest.mark.parametrize("messages, message", [
    ([{"role": "tool", "content": "x"}], "needs a 'tool_call_id'"),
    ([{"role": "tool", "tool_call_id": "c"}], "needs 'content'"),
    ([{"role": "tool", "tool_call_id": "c", "content": [{"type": "text", "text": 5}]}], "list of text parts"),
    ([{"role": "tool", "tool_call_id": "c", "content": {"a": 1}}], "list of text parts"),
    ([{"role": "user", "content": "x", "tool_calls": []}], "only allowed on assistant"),
    ([{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f"}}]}], "'arguments'"),
    ([{"role": "assistant", "tool_calls": "call"}], "must be a list"),
])
def test_malformed_tool_messages_are_400s(tokenizer, messages, message) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        render_chat(tokenizer, messages, request_of())


# -- parsing


@pytest.mark.parametrize("text, expected", [
    ('{"name": "add", "arguments": {"a": 1, "b": 2}}', [("add", {"a": 1, "b": 2})]),
    ('  {"name": "add", "parameters": {"a": 1, "b": 2}}\n', [("add", {"a": 1, "b": 2})]),
    ('{"name": "add", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}', [("add", {"a": 3, "b": 4})]),
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>', [("add", {"a": 1, "b": 2})]),
    ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n<tool_call>{"name": "get_weather", '
     '"arguments": {"city": "Rome", "unit": "celsius"}}</tool_call>',
     [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Rome", "unit": "celsius"})]),
    ('```json\n{"name": "add", "arguments": {"a": 5, "b": 6}}\n```', [("add", {"a": 5, "b": 6})]),
    ('[{"name": "add", "arguments": {}}, {"name": "add", "arguments": {"a": 1}}]', [("add", {}), ("add", {"a": 1})]),
    ("The weather is nice.", None),
    ('{"name": "unknown_tool", "arguments": {}}', None),
    ('{"city": "Oslo"}', None),
    ('{"name": "add", "arguments": {"a": 1', None),
    ("[]", None),
    ('Sure! {"name": "add", "arguments": {}}', None),
])
def test_parse_auto_output(text, expected) -> None:
    calls = parse_tool_calls(text, request_of())
    if expected is None:
        assert calls is None
        return
    assert [(call.name, json.loads(call.arguments)) for call in calls] == expected
    assert all(call.id.startswith("call_") for call in calls)
    assert len({call.id for call in calls}) == len(calls)


def test_parse_respects_parallel_and_none_and_named() -> None:
    text = '[{"name": "add", "arguments": {"a": 1, "b": 1}}, {"name": "add", "arguments": {"a": 2, "b": 2}}]'
    assert len(parse_tool_calls(text, request_of(parallel_tool_calls=False))) == 1
    assert parse_tool_calls(text, request_of(tool_choice="none")) is None
    named = request_of(tool_choice={"type": "function", "function": {"name": "add"}})
    [call] = parse_tool_calls('{"a": 7, "b": 8}', named)
    assert (call.name, json.loads(call.arguments)) == ("add", {"a": 7, "b": 8})


def test_streaming_holds_back_calls_and_passes_content() -> None:
    stream = ToolCallStream(request_of())
    pieces = ["  ", '{"name": "add", ', '"arguments": {"a": 1, ', '"b": 2}}']
    assert [stream.feed(piece) for piece in pieces] == ["", "", "", ""]
    [call] = stream.finish()
    assert (call.name, json.loads(call.arguments)) == ("add", {"a": 1, "b": 2})

    content = ToolCallStream(request_of())
    assert content.feed(" ") == ""
    assert content.feed("Hello") == " Hello"  # decided: not a call, the held text goes out
    assert content.feed(" world") == " world"
    assert content.finish() is None and content.finish_content() == ""

    json_content = ToolCallStream(request_of())  # JSON that is not a call is content at the end
    assert json_content.feed('{"city": "Oslo"}') == ""
    assert json_content.finish() is None and json_content.finish_content() == '{"city": "Oslo"}'

    plain = ToolCallStream(request_of(tool_choice="none"))
    assert plain.feed('{"name": "add"') == '{"name": "add"'


def test_could_be_tool_call_prefixes() -> None:
    assert could_be_tool_call("") and could_be_tool_call(" \n")
    assert could_be_tool_call("<tool") and could_be_tool_call("<tool_call>{") and could_be_tool_call("``")
    assert could_be_tool_call("```json\n{")
    assert not could_be_tool_call("<b>") and not could_be_tool_call("Hi")


def test_response_shapes() -> None:
    calls = parse_tool_calls('{"name": "add", "arguments": {"a": 1, "b": 2}}', request_of())
    message = tool_calls_message(calls)
    assert message["content"] is None and message["role"] == "assistant"
    assert message["tool_calls"][0]["type"] == "function"
    assert message["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    deltas = tool_call_deltas(calls)
    assert deltas[0]["tool_calls"][0] == {"index": 0, "id": calls[0].id, "type": "function",
                                          "function": {"name": "add", "arguments": ""}}
    assert deltas[1]["tool_calls"][0] == {"index": 0, "function": {"arguments": '{"a": 1, "b": 2}'}}


def test_open_parameter_schemas_are_closed_for_decoding_only() -> None:
    open_tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}}}}
    request = parse_tool_request({"tools": [open_tool], "tool_choice": "required", "parallel_tool_calls": False})
    schema = tool_call_schema(request)
    assert schema["properties"]["arguments"]["additionalProperties"] is False
    assert list(schema["properties"]) == ["name", "arguments"]
    assert "additionalProperties" not in request.tools[0].openai()["function"]["parameters"]


# ---------------------------------------------------------------------------------------------
# End to end: the real server through the real ``openai`` client (one server for the module)

MODEL = "SmolLM2-135M-Instruct.Q4_1"
SERVER_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {"type": "object",
                       "properties": {"city": {"type": "string", "maxLength": 30},
                                      "unit": {"enum": ["celsius", "fahrenheit"]}},
                       "required": ["city"]},
    },
}
SERVER_ADD = {
    "type": "function",
    "function": {"name": "add", "description": "Add two numbers",
                 "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                                "required": ["a", "b"]}},
}
SERVER_TOOLS = [SERVER_WEATHER, SERVER_ADD]
SERVER_PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in SERVER_TOOLS}
QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]
SAMPLINGS = [{"temperature": 0.0}] + [{"temperature": 1.0, "seed": seed} for seed in (1, 2, 3)]


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--max-num-seqs", "16") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.openai_client()


def check_calls(calls, names=None) -> None:
    assert calls, "no tool calls"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in (names or SERVER_PARAMETERS)
        jsonschema.validate(json.loads(call.function.arguments), SERVER_PARAMETERS[call.function.name])


def streamed_calls(stream) -> tuple[list[dict], str, str | None]:
    """Tool calls rebuilt from OpenAI-shaped deltas, the streamed content and the finish reason."""
    calls: dict[int, dict] = {}
    content, finish = [], None
    for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.content:
                content.append(choice.delta.content)
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
                if delta.id:
                    call["id"] = delta.id
                if delta.function and delta.function.name:
                    call["name"] = delta.function.name
                if delta.function and delta.function.arguments:
                    call["arguments"] += delta.function.arguments
            if choice.finish_reason:
                finish = choice.finish_reason
    return [calls[index] for index in sorted(calls)], "".join(content), finish


@pytest.mark.integration
def test_server_required_tool_choice_always_yields_valid_calls(client) -> None:
    for sampling in SAMPLINGS:
        response = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=SERVER_TOOLS,
                                                  tool_choice="required", max_tokens=120, **sampling)
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None
        check_calls(choice.message.tool_calls)


@pytest.mark.integration
def test_server_required_tool_choice_streamed(client) -> None:
    for sampling in SAMPLINGS:
        stream = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=SERVER_TOOLS,
                                                tool_choice="required", max_tokens=120, stream=True, **sampling)
        calls, content, finish = streamed_calls(stream)
        assert finish == "tool_calls" and content == ""
        assert calls and all(call["id"] and call["id"].startswith("call_") for call in calls)
        for call in calls:
            jsonschema.validate(json.loads(call["arguments"]), SERVER_PARAMETERS[call["name"]])


@pytest.mark.integration
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_server_named_function(client, stream) -> None:
    named = {"type": "function", "function": {"name": "add"}}
    messages = [{"role": "user", "content": "What is 12 plus 30?"}]
    for sampling in SAMPLINGS:
        kwargs = dict(model=MODEL, messages=messages, tools=SERVER_TOOLS, tool_choice=named, max_tokens=120,
                      parallel_tool_calls=False, **sampling)
        if stream:
            calls, content, finish = streamed_calls(client.chat.completions.create(stream=True, **kwargs))
            assert finish == "tool_calls" and [call["name"] for call in calls] == ["add"]
            jsonschema.validate(json.loads(calls[0]["arguments"]), SERVER_PARAMETERS["add"])
        else:
            choice = client.chat.completions.create(**kwargs).choices[0]
            assert choice.finish_reason == "tool_calls"
            check_calls(choice.message.tool_calls, names=["add"])
            assert len(choice.message.tool_calls) == 1


@pytest.mark.integration
def test_server_auto_answers_in_text_or_with_a_valid_call(client) -> None:
    plain = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=60, temperature=0.0)
    with_tools = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=SERVER_TOOLS,
                                                max_tokens=60, temperature=0.0)
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 50  # the tools are in the prompt
    for sampling in SAMPLINGS:
        for stream in (False, True):
            kwargs = dict(model=MODEL, messages=QUESTION, tools=SERVER_TOOLS, tool_choice="auto", max_tokens=60,
                          **sampling)
            if stream:
                calls, content, finish = streamed_calls(client.chat.completions.create(stream=True, **kwargs))
            else:
                choice = client.chat.completions.create(**kwargs).choices[0]
                calls = [{"name": c.function.name, "arguments": c.function.arguments}
                         for c in choice.message.tool_calls or []]
                content, finish = choice.message.content, choice.finish_reason
            if calls:
                assert finish == "tool_calls" and not content
                for call in calls:
                    json.loads(call["arguments"])
                    assert call["name"] in SERVER_PARAMETERS
            else:
                assert finish in ("stop", "length") and content


@pytest.mark.integration
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_server_follow_up_turn_with_tool_result(client, stream) -> None:
    messages = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 degrees celsius and sunny"},
    ]
    kwargs = dict(model=MODEL, messages=messages, tools=SERVER_TOOLS, max_tokens=60, temperature=0.0)
    if stream:
        calls, content, finish = streamed_calls(client.chat.completions.create(stream=True, **kwargs))
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in choice.message.tool_calls or []]
        content, finish = choice.message.content, choice.finish_reason
    # Greedy SmolLM2 answers this turn with the call JSON again: parsed in auto mode into a tool call.
    assert finish == "tool_calls" and content in (None, "")
    assert [(call["name"], json.loads(call["arguments"])) for call in calls] == [("get_weather", {"city": "Paris"})]
    # The same history without tools is still accepted (rendered with the fallback) and answered in text.
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0.0)
    assert plain.choices[0].message.tool_calls is None


@pytest.mark.integration
def test_server_async_client_required_calls(server) -> None:
    async def run() -> list:
        aclient = server.openai_client(asynchronous=True)
        try:
            return await asyncio.gather(*[aclient.chat.completions.create(
                model=MODEL, messages=QUESTION, tools=SERVER_TOOLS, tool_choice="required", max_tokens=120,
                temperature=1.0, seed=seed) for seed in range(4)])
        finally:
            await aclient.close()

    for response in asyncio.run(run()):
        assert response.choices[0].finish_reason == "tool_calls"
        check_calls(response.choices[0].message.tool_calls)


@pytest.mark.integration
@pytest.mark.parametrize("extras, param, message", [
    ({"tools": SERVER_TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not in tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools", "function.name"),
    ({"tools": SERVER_TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format", "tool_choice"),
])
def test_server_bad_tool_requests_are_400s(client, extras, param, message) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=5, **extras)
    assert info.value.body["param"] == param and message in info.value.body["message"], info.value.body


@pytest.mark.integration
def test_server_tool_message_without_call_id_is_a_400(client) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, max_tokens=5, messages=QUESTION + [
            {"role": "tool", "content": "22 degrees"}])
    assert "tool_call_id" in info.value.body["message"]


@pytest.mark.integration
def test_server_n_choices_each_carry_their_calls_streamed(client) -> None:
    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=SERVER_TOOLS, tool_choice="required",
                                            n=2, temperature=1.0, seed=11, max_tokens=120, stream=True,
                                            stream_options={"include_usage": True})
    calls: dict[int, dict[int, dict]] = {0: {}, 1: {}}
    finishes, usage = {}, None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                call = calls[choice.index].setdefault(delta.index, {"name": None, "arguments": ""})
                call["name"] = (delta.function.name if delta.function and delta.function.name else call["name"])
                call["arguments"] += (delta.function.arguments or "") if delta.function else ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert finishes == {0: "tool_calls", 1: "tool_calls"}
    for index in (0, 1):
        assert calls[index]
        for call in calls[index].values():
            jsonschema.validate(json.loads(call["arguments"]), SERVER_PARAMETERS[call["name"]])
    assert usage is not None and usage.completion_tokens > 0


@pytest.mark.integration
def test_server_tool_choice_none_does_not_render_or_parse(client) -> None:
    plain = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=30, temperature=0.0)
    none = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=SERVER_TOOLS, tool_choice="none",
                                          max_tokens=30, temperature=0.0)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert none.choices[0].message.tool_calls is None
