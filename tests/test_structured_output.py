"""Structured output: the engine's grammar manager (llguidance) on the real SmolLM2 tokenizer.

The manager is driven the way the scheduler drives it (add, poll is_ready, bitmask, accept, is_finished)
with a random "model": random logits masked by the manager's bitmask, sampled at temperature 1. Every
output must decode to text that parses and validates against the spec. API-level spec building and the
400s are tested further down; end-to-end tests through the server are marked integration.
"""
from __future__ import annotations

import asyncio
import json
import re
from concurrent.futures import Future

import jsonschema
import numpy as np
import openai
import pytest

from config.model_config import default_model_path
from config.structured_output import CHOICE, GRAMMAR, JSON_OBJECT, JSON_SCHEMA, REGEX, StructuredOutputSpec
from engine.entrypoints.structured_request import StructuredRequestError, spec_from_request
from engine.structured_output import (
    StructuredOutputError,
    StructuredOutputManager,
    ll_tokenizer_from,
    validate_spec,
)
from engine.tokenizer import Tokenizer, load_tokenizer
from harness.server import ServerProcess

MODEL_VOCAB = 49152  # SmolLM2's logits width
COMPILE_TIMEOUT = 30.0
MAX_STEPS = 200

# Every value bounded, so a random sampler (which picks among thousands of allowed string tokens)
# still closes the object within MAX_STEPS.
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "member": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["name", "age", "member", "color", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def manager(tokenizer: Tokenizer):
    ll = ll_tokenizer_from(tokenizer.backend, tokenizer.eos_token_ids, MODEL_VOCAB)
    instance = StructuredOutputManager(ll, MODEL_VOCAB, tokenizer_vocab_size=tokenizer.vocab_size)
    yield instance
    instance.close()


def allowed_ids(mask: np.ndarray) -> np.ndarray:
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")
    return np.flatnonzero(bits)


def generate(manager: StructuredOutputManager, tokenizer: Tokenizer, seq_id: str, rng: np.random.Generator,
             max_steps: int = MAX_STEPS) -> tuple[str, list[int]]:
    """Sample under the mask until the grammar finishes or EOS; returns (text, token ids without EOS)."""
    assert manager.wait_ready(seq_id, COMPILE_TIMEOUT)
    assert manager.error(seq_id) is None
    tokens: list[int] = []
    for _ in range(max_steps):
        if manager.is_finished(seq_id):
            break
        mask = manager.bitmask(seq_id)
        assert mask is not None and mask.shape == ((MODEL_VOCAB + 31) // 32,)
        allowed = allowed_ids(mask)
        assert allowed.size > 0
        logits = rng.standard_normal(MODEL_VOCAB).astype(np.float32)
        masked = np.full(MODEL_VOCAB, -np.inf, dtype=np.float32)
        masked[allowed] = logits[allowed]
        probs = np.exp(masked - masked.max())
        token = int(rng.choice(MODEL_VOCAB, p=probs / probs.sum()))
        assert manager.accept(seq_id, token)
        if token in tokenizer.eos_token_ids:
            break
        tokens.append(token)
    else:
        pytest.fail(f"{seq_id}: grammar did not finish in {max_steps} steps: {tokenizer.decode(tokens)!r}")
    return tokenizer.decode(tokens), tokens


@pytest.mark.parametrize("seed", range(6))
def test_json_schema_outputs_parse_and_validate(manager, tokenizer, seed) -> None:
    spec = StructuredOutputSpec(JSON_SCHEMA, json.dumps(PERSON_SCHEMA))
    seq_id = f"schema-{seed}"
    manager.add(seq_id, spec)
    text, _ = generate(manager, tokenizer, seq_id, np.random.default_rng(seed))
    jsonschema.validate(json.loads(text), PERSON_SCHEMA)
    manager.remove(seq_id)
    assert seq_id not in manager


@pytest.mark.parametrize("seed", range(4))
def test_regex_outputs_match(manager, tokenizer, seed) -> None:
    pattern = r"[A-Z][a-z]{1,5}-\d{3}"
    manager.add(f"re-{seed}", StructuredOutputSpec(REGEX, pattern))
    text, _ = generate(manager, tokenizer, f"re-{seed}", np.random.default_rng(seed))
    assert re.fullmatch(pattern, text), text


@pytest.mark.parametrize("seed", range(4))
def test_choice_outputs_one_of_the_choices(manager, tokenizer, seed) -> None:
    choices = ["positive", "negative", "neutral ground"]
    manager.add(f"choice-{seed}", StructuredOutputSpec(CHOICE, json.dumps(choices)))
    text, _ = generate(manager, tokenizer, f"choice-{seed}", np.random.default_rng(seed))
    assert text in choices


@pytest.mark.parametrize("seed", range(4))
def test_lark_grammar_outputs_are_in_the_language(manager, tokenizer, seed) -> None:
    grammar = 'start: expr\nexpr: NUM | NUM OP expr\nOP: "+" | "-" | "*"\nNUM: /[1-9][0-9]?/'
    manager.add(f"lark-{seed}", StructuredOutputSpec(GRAMMAR, grammar))
    text, _ = generate(manager, tokenizer, f"lark-{seed}", np.random.default_rng(seed), max_steps=60)
    assert re.fullmatch(r"[1-9][0-9]?([+\-*][1-9][0-9]?)*", text), text


def test_json_object_starts_with_a_brace_and_finishes_with_eos_only(manager, tokenizer) -> None:
    manager.add("obj", StructuredOutputSpec(JSON_OBJECT))
    assert manager.wait_ready("obj", COMPILE_TIMEOUT)
    first = {tokenizer.decode([int(t)]).lstrip() for t in allowed_ids(manager.bitmask("obj"))}
    assert first and all(text.startswith("{") for text in first), first
    for token in tokenizer.encode('{"a": [1, 2]}'):
        assert manager.accept("obj", token)
    assert manager.is_finished("obj")
    assert allowed_ids(manager.bitmask("obj")).tolist() == list(tokenizer.eos_token_ids)
    assert manager.accept("obj", tokenizer.eos_token_ids[0])
    assert manager.is_finished("obj")


def test_disallowed_token_is_refused(manager, tokenizer) -> None:
    manager.add("refuse", StructuredOutputSpec(REGEX, r"\d+"))
    assert manager.wait_ready("refuse", COMPILE_TIMEOUT)
    letter = tokenizer.encode("x")[0]
    assert letter not in allowed_ids(manager.bitmask("refuse"))
    assert not manager.accept("refuse", letter)
    assert manager.error("refuse")  # the matcher is now in its error state, with llguidance's message
    assert not manager.is_finished("refuse")


def test_mask_is_model_vocab_wide_and_never_allows_ids_beyond_the_tokenizer(tokenizer) -> None:
    padded = MODEL_VOCAB + 100  # a model whose embedding is padded past the tokenizer
    ll = ll_tokenizer_from(tokenizer.backend, tokenizer.eos_token_ids, padded)
    manager = StructuredOutputManager(ll, padded, tokenizer_vocab_size=tokenizer.vocab_size)
    try:
        # A regex that allows nearly every byte string: the mask is almost all ones.
        manager.add("any", StructuredOutputSpec(REGEX, r"(.|\n)*"))
        assert manager.wait_ready("any", COMPILE_TIMEOUT)
        mask = manager.bitmask("any")
        assert mask.dtype == np.int32 and mask.shape == ((padded + 31) // 32,)
        allowed = allowed_ids(mask)
        assert allowed.size > 40000
        assert allowed.max() < tokenizer.vocab_size
    finally:
        manager.close()


def test_bad_specs_fail_with_the_compiler_message(manager) -> None:
    cases = {
        "bad-regex": (StructuredOutputSpec(REGEX, "[a-"), "unclosed character class"),
        "bad-lark": (StructuredOutputSpec(GRAMMAR, "start: foo"), 'unknown name: "foo"'),
        "bad-json": (StructuredOutputSpec(JSON_SCHEMA, "{not json"), "Expecting property name"),
        "bad-type": (StructuredOutputSpec(JSON_SCHEMA, json.dumps({"type": "nonsense"})), "nonsense"),
        "bad-choice": (StructuredOutputSpec(CHOICE, "[]"), "non-empty list of strings"),
    }
    for seq_id, (spec, message) in cases.items():
        manager.add(seq_id, spec)
    for seq_id, (spec, message) in cases.items():
        assert manager.wait_ready(seq_id, COMPILE_TIMEOUT)
        assert message in (manager.error(seq_id) or ""), (seq_id, manager.error(seq_id))
        assert manager.bitmask(seq_id) is None
        assert not manager.accept(seq_id, 5)
        manager.remove(seq_id)


def test_validate_spec_without_a_tokenizer() -> None:
    validate_spec(StructuredOutputSpec(JSON_SCHEMA, json.dumps(PERSON_SCHEMA)))
    validate_spec(StructuredOutputSpec(GRAMMAR, 'start: "a"+'))
    with pytest.raises(StructuredOutputError, match="unclosed character class"):
        validate_spec(StructuredOutputSpec(REGEX, "(x|[a-"))
    with pytest.raises(StructuredOutputError, match="unknown name"):
        validate_spec(StructuredOutputSpec(GRAMMAR, "start: missing_rule"))


def test_fork_copies_the_state_and_then_diverges(manager, tokenizer) -> None:
    choices = ["alpha beta", "alpha gamma"]
    manager.add("parent", StructuredOutputSpec(CHOICE, json.dumps(choices)))
    assert manager.wait_ready("parent", COMPILE_TIMEOUT)
    prefix = tokenizer.encode("alpha")
    for token in prefix:
        assert manager.accept("parent", token)
    manager.fork("parent", "child")
    assert manager.is_ready("child")
    np.testing.assert_array_equal(manager.bitmask("child"), manager.bitmask("parent"))
    for seq_id, text in (("parent", "alpha beta"), ("child", "alpha gamma")):
        for token in tokenizer.encode(text)[len(prefix):]:
            assert manager.accept(seq_id, token), (seq_id, text)
        assert manager.is_finished(seq_id)


def test_fork_before_compiled_starts_the_child_fresh(tokenizer) -> None:
    pending: Future = Future()  # the tokenizer is not there yet: nothing can compile
    manager = StructuredOutputManager(pending, MODEL_VOCAB, tokenizer_vocab_size=tokenizer.vocab_size)
    try:
        manager.add("p", StructuredOutputSpec(REGEX, "ab"))
        assert not manager.is_ready("p")
        assert manager.bitmask("p") is None
        manager.fork("p", "c")
        assert not manager.is_ready("c")
        pending.set_result(ll_tokenizer_from(tokenizer.backend, tokenizer.eos_token_ids, MODEL_VOCAB))
        assert manager.wait_ready("p", COMPILE_TIMEOUT) and manager.wait_ready("c", COMPILE_TIMEOUT)
        np.testing.assert_array_equal(manager.bitmask("c"), manager.bitmask("p"))
        for token in tokenizer.encode("ab"):
            assert manager.accept("c", token)
        assert manager.is_finished("c") and not manager.is_finished("p")
    finally:
        manager.close()


def test_batched_masks_equal_single_masks(manager, tokenizer) -> None:
    specs = [StructuredOutputSpec(JSON_SCHEMA, json.dumps(PERSON_SCHEMA)), StructuredOutputSpec(REGEX, r"\d+"),
             StructuredOutputSpec(JSON_OBJECT)]
    ids = [f"batch-{i}" for i in range(len(specs))]
    for seq_id, spec in zip(ids, specs):
        manager.add(seq_id, spec)
    for seq_id in ids:
        assert manager.wait_ready(seq_id, COMPILE_TIMEOUT)
    batch = manager.fill_bitmasks(ids)
    for row, seq_id in enumerate(ids):
        np.testing.assert_array_equal(batch[row], manager.bitmask(seq_id))
    assert not np.array_equal(batch[0], batch[1])


def test_batched_masks_with_an_executor_equal_in_thread_masks(manager, tokenizer) -> None:
    threaded = StructuredOutputManager(ll_tokenizer_from(tokenizer.backend, tokenizer.eos_token_ids, MODEL_VOCAB),
                                       MODEL_VOCAB, tokenizer_vocab_size=tokenizer.vocab_size, mask_threads=2)
    try:
        specs = [StructuredOutputSpec(JSON_SCHEMA, json.dumps(PERSON_SCHEMA)), StructuredOutputSpec(REGEX, r"\d+")]
        for index, spec in enumerate(specs):
            for owner in (manager, threaded):
                owner.add(f"exec-{index}", spec)
                assert owner.wait_ready(f"exec-{index}", COMPILE_TIMEOUT)
        ids = [f"exec-{index}" for index in range(len(specs))]
        np.testing.assert_array_equal(threaded.fill_bitmasks(ids), manager.fill_bitmasks(ids))
    finally:
        threaded.close()


def test_same_spec_reuses_the_compiled_grammar(manager) -> None:
    spec = StructuredOutputSpec(REGEX, r"cached-[0-9]")
    manager.add("first", spec)
    assert manager.wait_ready("first", COMPILE_TIMEOUT)
    template = manager._grammar_cache[spec]
    manager.add("second", spec)
    assert manager.wait_ready("second", COMPILE_TIMEOUT)
    assert manager._grammar_cache[spec] is template
    np.testing.assert_array_equal(manager.bitmask("first"), manager.bitmask("second"))


def test_add_twice_and_unknown_ids_are_errors(manager) -> None:
    manager.add("dup", StructuredOutputSpec(REGEX, "a"))
    with pytest.raises(ValueError, match="already"):
        manager.add("dup", StructuredOutputSpec(REGEX, "a"))
    with pytest.raises(KeyError):
        manager.is_ready("never-added")
    manager.remove("never-added")  # removing twice / unknown is harmless (aborts race with finishes)


@pytest.mark.timeout(120)
def test_for_model_loads_the_tokenizer_off_the_caller() -> None:
    manager = StructuredOutputManager.for_model(default_model_path(), MODEL_VOCAB)
    try:
        manager.add("late", StructuredOutputSpec(CHOICE, json.dumps(["yes", "no"])))
        assert manager.wait_ready("late", 60.0)
        assert manager.error("late") is None
        assert allowed_ids(manager.bitmask("late")).size >= 2
    finally:
        manager.close()


# ---------------------------------------------------------------------------------------------
# Request fields -> spec (engine/entrypoints/structured_request.py)


@pytest.mark.parametrize("fields, expected", [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutputSpec(JSON_OBJECT)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "integer"},
                                                                  "strict": True}}},
     StructuredOutputSpec(JSON_SCHEMA, '{"type": "integer"}')),
    ({"guided_json": {"type": "integer"}}, StructuredOutputSpec(JSON_SCHEMA, '{"type": "integer"}')),
    ({"guided_json": '{"type": "integer"}'}, StructuredOutputSpec(JSON_SCHEMA, '{"type": "integer"}')),
    ({"guided_regex": r"\d+"}, StructuredOutputSpec(REGEX, r"\d+")),
    ({"guided_choice": ["a", "b"]}, StructuredOutputSpec(CHOICE, '["a", "b"]')),
    ({"guided_grammar": 'start: "x"'}, StructuredOutputSpec(GRAMMAR, 'start: "x"')),
    ({"structured_outputs": {"json": {"type": "integer"}}}, StructuredOutputSpec(JSON_SCHEMA, '{"type": "integer"}')),
    ({"structured_outputs": {"regex": "a+"}}, StructuredOutputSpec(REGEX, "a+")),
    ({"structured_outputs": {"choice": ["x"]}}, StructuredOutputSpec(CHOICE, '["x"]')),
    ({"structured_outputs": {"grammar": 'start: "x"'}}, StructuredOutputSpec(GRAMMAR, 'start: "x"')),
    ({"structured_outputs": {"json_object": True}}, StructuredOutputSpec(JSON_OBJECT)),
    # text response_format plus a guided field: one constraint only
    ({"response_format": {"type": "text"}, "guided_regex": "a"}, StructuredOutputSpec(REGEX, "a")),
])
def test_request_fields_to_spec(fields, expected) -> None:
    assert spec_from_request(fields) == expected


@pytest.mark.parametrize("fields, param, message", [
    ({"response_format": "json"}, "response_format", "must be an object"),
    ({"response_format": {"type": "xml"}}, "response_format", "response_format.type must be"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema must be an object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
     "schema is required"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}}, "response_format",
     "must be a JSON schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "integer"}, "strict": "yes"}}},
     "response_format", "strict must be a boolean"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "wrong"}}}},
     "response_format", "does not compile"),
    ({"guided_json": "{bad"}, "guided_json", "guided_json is not valid JSON"),
    ({"guided_json": 5}, "guided_json", "must be a JSON schema"),
    ({"guided_json": {"properties": {"a": {"$ref": "#/nowhere"}}}}, "guided_json", "does not compile"),
    ({"guided_regex": ""}, "guided_regex", "non-empty string"),
    ({"guided_regex": "(a|[b-"}, "guided_regex", "unclosed character class"),
    ({"guided_choice": "a"}, "guided_choice", "non-empty list of strings"),
    ({"guided_choice": []}, "guided_choice", "non-empty list of strings"),
    ({"guided_choice": ["a", ""]}, "guided_choice", "empty strings"),
    ({"guided_grammar": "start: nothing_here"}, "guided_grammar", "unknown name"),
    ({"guided_grammar": 7}, "guided_grammar", "non-empty string"),
    ({"structured_outputs": ["regex"]}, "structured_outputs", "must be an object"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs", "structural_tag is not supported"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "takes one constraint"),
    ({"structured_outputs": {"regex": "[z-a]"}}, "structured_outputs", "structured_outputs.regex does not compile"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "only one"),
    ({"guided_regex": "a", "structured_outputs": {"regex": "a"}}, "structured_outputs", "only one"),
])
def test_bad_request_fields_are_400s_naming_the_field(fields, param, message) -> None:
    with pytest.raises(StructuredRequestError) as info:
        spec_from_request(fields)
    assert info.value.param == param
    assert message in str(info.value), str(info.value)


def test_regex_digit_class_is_ascii(manager, tokenizer) -> None:
    manager.add("digits", StructuredOutputSpec(REGEX, r"\d{3}"))
    assert manager.wait_ready("digits", COMPILE_TIMEOUT)
    allowed = {tokenizer.decode([int(token)]) for token in allowed_ids(manager.bitmask("digits"))}
    assert allowed and all(re.fullmatch(r"[0-9]+", text) for text in allowed), sorted(allowed)[:10]


# ---------------------------------------------------------------------------------------------
# End to end: the real server through the real ``openai`` client (one server for the module)

SERVER_PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20},
                   "age": {"type": "integer", "minimum": 0, "maximum": 150}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
# (case, request extras, chat prompt, check of the output text). Prompts the model can answer briefly:
# the mask makes every prefix valid; these keep generations well inside max_tokens at temperature 1.
SERVER_CASES = [
    ("json_object", {"response_format": {"type": "json_object"}},
     'What is the capital of France? Answer in JSON with the key "capital".',
     lambda text: isinstance(json.loads(text), dict)),
    ("json_schema", {"response_format": {"type": "json_schema",
                                         "json_schema": {"name": "person", "schema": SERVER_PERSON, "strict": True}}},
     "Invent a person with a name and an age.",
     lambda text: jsonschema.validate(json.loads(text), SERVER_PERSON) is None),
    ("guided_json", {"extra_body": {"guided_json": SERVER_PERSON}}, "Invent a person with a name and an age.",
     lambda text: jsonschema.validate(json.loads(text), SERVER_PERSON) is None),
    ("guided_regex", {"extra_body": {"guided_regex": r"\d{3}-\d{4}"}}, "Write a phone number.",
     lambda text: re.fullmatch(r"[0-9]{3}-[0-9]{4}", text) is not None),
    ("guided_choice", {"extra_body": {"guided_choice": ["yes", "no", "maybe"]}}, "Is the sky blue?",
     lambda text: text in ("yes", "no", "maybe")),
    ("guided_grammar", {"extra_body": {"guided_grammar": 'start: "The answer is " N "."\nN: /[0-9]{1,3}/'}},
     "What is 2+3?", lambda text: re.fullmatch(r"The answer is [0-9]{1,3}\.", text) is not None),
    ("structured_outputs", {"extra_body": {"structured_outputs": {"choice": ["red", "green"]}}},
     "Name a color.", lambda text: text in ("red", "green")),
]
SAMPLINGS = [{"temperature": 0.0}] + [{"temperature": 1.0, "seed": seed} for seed in (1, 2, 3)]
SERVER_MAX_TOKENS = 120


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--max-num-seqs", "16") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.openai_client()


def chat_text(client: openai.OpenAI, prompt: str, extras: dict, sampling: dict, stream: bool) -> tuple[str, str]:
    kwargs = {"model": "SmolLM2-135M-Instruct.Q4_1", "messages": [{"role": "user", "content": prompt}],
              "max_tokens": SERVER_MAX_TOKENS, **sampling, **extras}
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        return choice.message.content, choice.finish_reason
    parts, finish = [], None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            if choice.delta.content:
                parts.append(choice.delta.content)
            if choice.finish_reason:
                finish = choice.finish_reason
    return "".join(parts), finish


@pytest.mark.integration
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("case, extras, prompt, check", SERVER_CASES, ids=[case[0] for case in SERVER_CASES])
def test_server_outputs_parse_and_validate(client, case, extras, prompt, check, stream) -> None:
    samplings = SAMPLINGS
    if case == "json_object":
        # Any object may have any number of keys: at temperature 1 over the full vocabulary SmolLM2-135M
        # sometimes keeps adding keys past max_tokens (the prefix is valid JSON, the end is cut: "length").
        # Nucleus sampling keeps it on the question.
        samplings = [{"temperature": 0.0}] + [{"temperature": 1.0, "top_p": 0.8, "seed": seed} for seed in (1, 2, 3)]
    for sampling in samplings:
        text, finish = chat_text(client, prompt, extras, sampling, stream)
        assert finish == "stop", (case, sampling, text)
        assert check(text), (case, sampling, text)


@pytest.mark.integration
def test_server_completions_endpoint_takes_guided_fields(client) -> None:
    for seed in (1, 2):
        completion = client.completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt="My phone number is ",
                                               max_tokens=20, temperature=1.0, seed=seed,
                                               extra_body={"guided_regex": r"\(\d{3}\) \d{3}-\d{4}"})
        assert re.fullmatch(r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}", completion.choices[0].text)
        assert completion.choices[0].finish_reason == "stop"


@pytest.mark.integration
def test_server_n_choices_each_follow_the_grammar(client) -> None:
    response = client.chat.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1", messages=[{"role": "user", "content": "Invent a person."}], n=3,
        temperature=1.0, seed=7, max_tokens=SERVER_MAX_TOKENS, extra_body={"guided_json": SERVER_PERSON})
    assert sorted(choice.index for choice in response.choices) == [0, 1, 2]
    for choice in response.choices:
        jsonschema.validate(json.loads(choice.message.content), SERVER_PERSON)


@pytest.mark.integration
def test_server_async_client_concurrent_with_plain_requests(server) -> None:
    async def run() -> list:
        aclient = server.openai_client(asynchronous=True)
        try:
            constrained = [aclient.chat.completions.create(
                model="SmolLM2-135M-Instruct.Q4_1", messages=[{"role": "user", "content": "Invent a person."}],
                temperature=1.0, seed=seed, max_tokens=SERVER_MAX_TOKENS,
                response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SERVER_PERSON}})
                for seed in range(4)]
            plain = [aclient.chat.completions.create(
                model="SmolLM2-135M-Instruct.Q4_1", messages=[{"role": "user", "content": "Tell me a story."}],
                temperature=0.0, max_tokens=40) for _ in range(2)]
            return await asyncio.gather(*constrained, *plain)
        finally:
            await aclient.close()

    results = asyncio.run(run())
    for response in results[:4]:
        jsonschema.validate(json.loads(response.choices[0].message.content), SERVER_PERSON)
    for response in results[4:]:
        # Unconstrained requests batched beside them are unaffected (plain prose, full length).
        assert response.choices[0].finish_reason == "length"
        assert not response.choices[0].message.content.lstrip().startswith("{")


@pytest.mark.integration
@pytest.mark.parametrize("extras, param, message", [
    ({"extra_body": {"guided_regex": "(a|[b-"}}, "guided_regex", "unclosed character class"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wrong"}}}},
     "response_format", "does not compile"),
    ({"extra_body": {"guided_grammar": "start: nowhere"}}, "guided_grammar", "unknown name"),
    ({"extra_body": {"guided_grammar": 'start: "a" <|no_such_token|>'}}, "guided_grammar", "unknown special token"),
    ({"extra_body": {"guided_choice": "yes"}}, "guided_choice", "non-empty list of strings"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a"}}, "guided_regex", "only one"),
    ({"response_format": {"type": "yaml"}}, "response_format", "response_format.type must be"),
])
def test_server_bad_constraints_are_400s(client, extras, param, message) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1",
                                       messages=[{"role": "user", "content": "hi"}], max_tokens=5, **extras)
    error = info.value.body
    assert error["param"] == param and message in error["message"], error


def test_validation_with_the_servers_tokenizer_checks_the_vocabulary(tokenizer) -> None:
    fields = {"guided_grammar": 'start: "a" <|no_such_token|>'}
    assert spec_from_request(fields) is not None  # the grammar alone is well-formed
    with pytest.raises(StructuredRequestError, match="unknown special token") as info:
        spec_from_request(fields, tokenizer=tokenizer)
    assert info.value.param == "guided_grammar"
    assert spec_from_request({"guided_grammar": 'start: "a" <|im_end|>'}, tokenizer=tokenizer) is not None
