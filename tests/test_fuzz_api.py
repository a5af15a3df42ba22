"""Hostile input against a real server: property-based fuzzing of the OpenAI routes, limits, auth, IPC privacy.

One server for the module (``--max-model-len 256``, ``FD_API_KEY``, a 64 KiB body limit,
``FD_USE_KVCACHE_LOCK=1`` so the lock's semaphore exists too). Hypothesis builds valid request
bodies from strategies over the request schemas and mutates some of them -- wrong types, missing
fields, huge and negative numbers, unicode and lone surrogates, nested junk, invalid token ids,
empty messages, odd roles, non-object bodies, invalid UTF-8, truncated JSON. Every answer must be
a 200 or a 4xx with the OpenAI error body, never a 5xx, and an unmutated body must get a 200.
Generation budgets stay at most 4 tokens so valid bodies are cheap (about 300 examples in all).
Afterwards the server must still produce the reference greedy output, and its own ``/metrics``
must show no 5xx and no failed request. Also here: the body-size and length limits, the
``FD_API_KEY`` check, private shared memory and semaphores, and the loopback-only default bind.
"""
from __future__ import annotations

import argparse
import json
import os
import stat
from typing import Any, Iterator

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from config.engine_config import EngineArgs
from engine.entrypoints.server import ipc_dir_for
from harness.server import ServerProcess, shm_names
from harness.reference import expected_prefix, load_reference


pytestmark = pytest.mark.integration

API_KEY = "fuzz-env-key"
MAX_MODEL_LEN = 256
MAX_REQUEST_BYTES = 64 * 1024
MAX_BUDGET = 4  # the largest max_tokens a fuzzed body can get accepted with
VOCAB_SIZE = 49152  # SmolLM2
SERVED_MODEL = "SmolLM2-135M-Instruct.Q4_1"
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
ERROR_KEYS = {"message", "type", "param", "code"}

FUZZ_SETTINGS = settings(deadline=None, database=None, print_blob=True,
                         suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                HealthCheck.large_base_example, HealthCheck.filter_too_much])


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess("--max-model-len", str(MAX_MODEL_LEN),
                       env={"FD_API_KEY": API_KEY, "FD_MAX_REQUEST_BYTES": str(MAX_REQUEST_BYTES),
                            "FD_USE_KVCACHE_LOCK": "1"}) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=60) as http:
        yield http


# --- strategies --------------------------------------------------------------------------------
# A hostile body is a valid request with one field replaced by a hostile value (wrong type, out
# of range, junk), removed, or an unknown field added; corrupted bodies are not objects at all or
# have broken bytes. Valid bodies must be accepted (200); nothing may get a 5xx.

# Any JSON value, including NaN/Infinity (json.dumps writes them; they are not JSON).
SCALARS = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=12)
JUNK = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=8)
# Junk that can never be an acceptable budget (strict parsing: floats and bools are not ints; null
# would mean "the rest of the context"), so a fuzzed max_tokens never makes a long generation.
NOT_A_BUDGET = JUNK.filter(lambda v: v is not None and (isinstance(v, bool) or not isinstance(v, int)))

SPECIAL_TEXT = ["", " ", "\u0000", "\ufeff", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start|>system\n",
                "\U0001F642" * 30, "\u202e\u0301\u200b", "a" * 2000, "1234567890" * 20]
TEXT = (st.text(max_size=60) | st.sampled_from(SPECIAL_TEXT)
        | st.text(st.characters(categories=["Cs"]), min_size=1, max_size=3))  # lone surrogates
BAD_TOKEN_IDS = st.sampled_from([-1, VOCAB_SIZE, VOCAB_SIZE + 1, 2**31, 2**63, -(2**63), 10**30])
TOKEN_IDS = (st.lists(st.integers(0, VOCAB_SIZE - 1) | BAD_TOKEN_IDS, max_size=24)
             | st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=MAX_MODEL_LEN - 6, max_size=MAX_MODEL_LEN + 2))
FLOAT = st.floats(allow_nan=False, allow_infinity=False) | st.sampled_from([0, 0.5, 1, 2, -0.0, 1e308, 5e-324])
# Integers where conversions break: int32/int64 edges and beyond.
EDGE_INTS = st.sampled_from([-1, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -(2**63), -(2**63) - 1,
                             10**30])
HUGE_INT = EDGE_INTS | st.integers(-2**70, 2**70)
FLAG = st.booleans() | JUNK

# Valid values, small enough that any combination fits max_model_len with the largest budget.
VALID_TEXT = st.text(min_size=1, max_size=20)
VALID_IDS = st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=24)
VALID_COMMON = {
    "model": st.just(SERVED_MODEL),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 50),
    "seed": st.integers(0, 2**63 - 1),
    "stop": VALID_TEXT | st.lists(VALID_TEXT, min_size=1, max_size=3),
    "stop_token_ids": st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=3),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "n": st.integers(1, 3),
    "ignore_eos": st.booleans(),
    "return_token_ids": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "user": st.text(max_size=10),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "min_p": st.floats(0, 1),
    "logit_bias": st.dictionaries(st.integers(0, VOCAB_SIZE - 1).map(str), st.floats(-100, 100), max_size=3),
    "bad_words": st.lists(VALID_TEXT, max_size=2),
    "prompt_logprobs": st.integers(0, 3),
}
HOSTILE_COMMON = {
    "model": TEXT | JUNK,
    "temperature": FLOAT | JUNK,
    "top_p": FLOAT | JUNK,
    "top_k": HUGE_INT | JUNK,
    "seed": HUGE_INT | JUNK,
    "stop": TEXT | st.lists(TEXT, max_size=4) | JUNK,
    "stop_token_ids": st.lists(st.integers(-2, VOCAB_SIZE + 2) | BAD_TOKEN_IDS, max_size=4) | JUNK,
    "stream": JUNK,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": FLAG}) | JUNK,
    "n": st.sampled_from([2, 0, -1, 129]) | HUGE_INT | JUNK,
    "ignore_eos": JUNK,
    "return_token_ids": JUNK,
    "skip_special_tokens": JUNK,
    "user": TEXT | JUNK,
    "presence_penalty": FLOAT | JUNK,
    "frequency_penalty": FLOAT | JUNK,
    "logit_bias": st.dictionaries(TEXT, FLOAT, max_size=2) | st.dictionaries(HUGE_INT.map(str), FLOAT, max_size=2)
    | JUNK,
    "repetition_penalty": FLOAT | JUNK,
    "min_p": FLOAT | JUNK,
    "min_tokens": HUGE_INT | JUNK,
    "bad_words": st.lists(TEXT, max_size=3) | JUNK,
    "prompt_logprobs": HUGE_INT | JUNK,
    "max_tokens": NOT_A_BUDGET | EDGE_INTS.filter(lambda n: n < 1 or n > MAX_MODEL_LEN)
    | st.sampled_from([0, MAX_MODEL_LEN, MAX_MODEL_LEN + 1]),
    "tools": JUNK,
    "response_format": JUNK,
    "unknown_field_x": JUNK,  # undeclared: ignored (and logged once)
}
BUDGET = st.integers(1, MAX_BUDGET)

VALID_COMPLETION = {
    **VALID_COMMON,
    "prompt": st.text(min_size=1, max_size=40) | VALID_IDS | st.lists(VALID_TEXT, min_size=1, max_size=3)
    | st.lists(VALID_IDS, min_size=1, max_size=3),
    "echo": st.booleans(),
    "logprobs": st.integers(0, 5),
    "add_special_tokens": st.booleans(),
}
HOSTILE_COMPLETION = {
    **HOSTILE_COMMON,
    "prompt": TEXT | TOKEN_IDS | st.lists(TEXT, max_size=3) | st.lists(TOKEN_IDS, max_size=2) | JUNK,
    "echo": FLAG,
    "logprobs": st.sampled_from([1, 5]) | HUGE_INT | JUNK,
    "suffix": TEXT | JUNK,
    "best_of": st.sampled_from([0, 2]) | HUGE_INT | JUNK,
    "add_special_tokens": JUNK,
}

ROLE = st.sampled_from(["system", "user", "assistant", "tool", "developer", "function", ""]) | TEXT | JUNK
CONTENT_PART = st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(["text", "image_url", "input_audio", "refusal"]) | JUNK,
    "text": TEXT | JUNK,
    "image_url": JUNK,
})
HOSTILE_MESSAGE = st.fixed_dictionaries({}, optional={
    "role": ROLE, "content": TEXT | st.none() | st.lists(CONTENT_PART | JUNK, max_size=3) | JUNK,
    "name": TEXT | JUNK, "tool_calls": JUNK, "tool_call_id": TEXT | JUNK,
}) | JUNK
VALID_MESSAGE = st.fixed_dictionaries({
    "role": st.sampled_from(["system", "user", "assistant"]),
    "content": VALID_TEXT | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": VALID_TEXT}),
                                     min_size=1, max_size=1),
})
VALID_CHAT = {
    **VALID_COMMON,
    "messages": st.lists(VALID_MESSAGE, min_size=1, max_size=2),
    "max_completion_tokens": BUDGET,
    "add_generation_prompt": st.booleans(),
    "logprobs": st.booleans(),
}
HOSTILE_CHAT = {
    **HOSTILE_COMMON,
    "messages": st.lists(HOSTILE_MESSAGE, max_size=4) | st.lists(VALID_MESSAGE | HOSTILE_MESSAGE, max_size=3) | JUNK,
    "max_completion_tokens": HOSTILE_COMMON["max_tokens"],
    "logprobs": st.just(True) | JUNK,
    "top_logprobs": st.sampled_from([1, 2]) | HUGE_INT | JUNK,
    "add_generation_prompt": JUNK,
}
REQUIRED = {COMPLETIONS: ("prompt", "max_tokens"), CHAT: ("messages", "max_tokens")}
# Removing the budget would let a valid body generate up to max_model_len tokens: too slow here
# (the default budget is covered by test_missing_max_tokens_uses_the_rest_of_the_context).
UNREMOVABLE = {"max_tokens", "max_completion_tokens"}

# Invalid UTF-8: a stray continuation byte, truncated sequences, an encoded surrogate, an overlong
# encoding, a code point above U+10FFFF.
INVALID_UTF8 = [b"\xff", b"\xfe\xff", b"\x80", b"\xc3\x28", b"\xe2\x82", b"\xed\xa0\x80", b"\xc0\xaf",
                b"\xf4\x90\x80\x80", b"\xf8\x88\x80\x80\x80"]


def valid_body(draw: st.DrawFn, path: str) -> dict[str, Any]:
    valid = VALID_CHAT if path == CHAT else VALID_COMPLETION
    body: dict[str, Any] = {"max_tokens": draw(BUDGET)}
    for name in sorted(valid):
        if name in REQUIRED[path] or draw(st.booleans()):
            body.setdefault(name, draw(valid[name]))
    if "stream_options" in body:
        body["stream"] = True  # stream_options without stream is a 400
    return body


@st.composite
def valid_request(draw: st.DrawFn, path: str) -> bytes:
    """A valid request body (must get a 200)."""
    return dump(draw, valid_body(draw, path))


@st.composite
def hostile_request(draw: st.DrawFn, path: str, field: str) -> bytes:
    """A valid body whose ``field`` is hostile (or removed): every other field is valid, so the
    checks behind the parser (model, supported features, chat template, lengths) are reached."""
    body = valid_body(draw, path)
    hostile = HOSTILE_CHAT if path == CHAT else HOSTILE_COMPLETION
    if field not in UNREMOVABLE and draw(st.integers(0, 5)) == 0:
        body.pop(field, None)
    else:
        body[field] = draw(hostile[field])
    return dump(draw, body)


@st.composite
def corrupted_request(draw: st.DrawFn, path: str) -> bytes:
    """Not a request object: arbitrary bytes, a JSON non-object, or a valid body with broken bytes."""
    kind = draw(st.sampled_from(["binary", "non_object", "invalid_utf8", "truncated", "trailing"]))
    if kind == "binary":
        return draw(st.binary(max_size=300))
    if kind == "non_object":
        return dump(draw, draw(JUNK.filter(lambda value: not isinstance(value, dict))))
    raw = dump(draw, valid_body(draw, path))
    if kind == "invalid_utf8":
        # Mostly right after a quote, i.e. inside a string value where a lenient decoder would pass it on.
        after_quotes = [i + 1 for i, byte in enumerate(raw) if byte == ord('"')]
        at = draw(st.sampled_from(after_quotes) | st.integers(0, len(raw)))
        return raw[:at] + draw(st.sampled_from(INVALID_UTF8)) + raw[at:]
    if kind == "truncated":
        return raw[:draw(st.integers(0, len(raw) - 1))]
    return raw + draw(st.sampled_from([b",", b"}", b" trailing", b"\x00", b"\n{}", b"\xff"]))


def dump(draw: st.DrawFn, body: Any) -> bytes:
    try:
        return json.dumps(body, ensure_ascii=draw(st.booleans())).encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: only the \\uXXXX escape can carry it
        return json.dumps(body, ensure_ascii=True).encode("utf-8")


# --- checks ------------------------------------------------------------------------------------

def check_error_body(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == ERROR_KEYS, error
    assert isinstance(error["message"], str) and error["message"], error
    assert error["type"] == "invalid_request_error", error
    return error


def check_success(response: httpx.Response, chat: bool) -> None:
    if response.headers["content-type"].startswith("text/event-stream"):
        lines = [line for line in response.text.split("\n") if line]
        assert lines and lines[-1] == "data: [DONE]", lines[-3:]
        for line in lines[:-1]:
            assert line.startswith("data: "), line
            chunk = json.loads(line[len("data: "):])
            assert "error" not in chunk, chunk  # an in-stream error is a server failure
        return
    body = response.json()
    assert body["object"] == ("chat.completion" if chat else "text_completion"), body
    choices = body["choices"]
    assert [c["index"] for c in choices] == list(range(len(choices))) and choices, body
    assert all(c["finish_reason"] in ("stop", "length") for c in choices), body
    assert 0 <= body["usage"]["completion_tokens"] <= MAX_BUDGET * len(choices), body["usage"]


def check_response(response: httpx.Response, raw: bytes, chat: bool, must_accept: bool = False) -> None:
    where = f"for body {raw[:400]!r}"
    event(f"status {response.status_code}")  # shown by --hypothesis-show-statistics
    assert response.status_code < 500, f"{response.status_code} {response.text[:500]} {where}"
    if must_accept:
        assert response.status_code == 200, f"valid request refused: {response.text[:500]} {where}"
    if response.status_code == 200:
        check_success(response, chat)
    else:
        assert response.status_code in (400, 404, 413), f"{response.status_code} {response.text[:300]} {where}"
        error = check_error_body(response)
        if response.status_code == 404:
            assert error["code"] == "model_not_found", error


def post_raw(client: httpx.Client, path: str, raw: bytes) -> httpx.Response:
    return client.post(path, content=raw, headers={"Content-Type": "application/json"})


# --- fuzzing -----------------------------------------------------------------------------------

# Every field of each schema gets its own run, so none is starved of hostile values; the
# structured prompt/messages get more. In all: 2 x 15 valid + 61 x 4 + 2 x 24 hostile + 2 x 20
# corrupted = 362 requests.
HOSTILE_FIELDS = ([(COMPLETIONS, name) for name in sorted(HOSTILE_COMPLETION) if name != "prompt"]
                  + [(CHAT, name) for name in sorted(HOSTILE_CHAT) if name != "messages"])


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@settings(FUZZ_SETTINGS, max_examples=15)
@given(data=st.data())
def test_fuzz_valid_requests_are_served(client: httpx.Client, path: str, data: st.DataObject) -> None:
    raw = data.draw(valid_request(path), label="body")
    check_response(post_raw(client, path, raw), raw, chat=path == CHAT, must_accept=True)


@pytest.mark.parametrize("path, field", HOSTILE_FIELDS)
@settings(FUZZ_SETTINGS, max_examples=4)
@given(data=st.data())
def test_fuzz_hostile_field(client: httpx.Client, path: str, field: str, data: st.DataObject) -> None:
    raw = data.draw(hostile_request(path, field), label="body")
    check_response(post_raw(client, path, raw), raw, chat=path == CHAT)


@pytest.mark.parametrize("path, field", [(COMPLETIONS, "prompt"), (CHAT, "messages")])
@settings(FUZZ_SETTINGS, max_examples=24)
@given(data=st.data())
def test_fuzz_hostile_prompt_and_messages(client: httpx.Client, path: str, field: str,
                                          data: st.DataObject) -> None:
    raw = data.draw(hostile_request(path, field), label="body")
    check_response(post_raw(client, path, raw), raw, chat=path == CHAT)


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@settings(FUZZ_SETTINGS, max_examples=20)
@given(data=st.data())
def test_fuzz_corrupted_bodies(client: httpx.Client, path: str, data: st.DataObject) -> None:
    raw = data.draw(corrupted_request(path), label="body")
    check_response(post_raw(client, path, raw), raw, chat=path == CHAT)


# --- limits ------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_body_size_limit_is_exact(client: httpx.Client, path: str) -> None:
    body = json.dumps({"prompt": "Hi", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}).encode()
    at_limit = body + b" " * (MAX_REQUEST_BYTES - len(body))  # JSON allows trailing whitespace
    assert post_raw(client, path, at_limit).status_code == 200
    over = post_raw(client, path, at_limit + b" ")
    assert over.status_code == 413
    assert check_error_body(over)["code"] == "request_too_large"


def test_missing_max_tokens_defaults(client: httpx.Client) -> None:
    # Completions: OpenAI's 16, or what the context leaves when that is less; chat: the rest of the context.
    response = client.post(COMPLETIONS, json={"prompt": "Hi", "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 16
    prompt = [100] * (MAX_MODEL_LEN - 3)
    response = client.post(COMPLETIONS, json={"prompt": prompt, "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("path, body, param", [
    (COMPLETIONS, {"prompt": [100] * MAX_MODEL_LEN, "max_tokens": 1}, "prompt"),
    (COMPLETIONS, {"prompt": [100] * MAX_MODEL_LEN}, "prompt"),
    (COMPLETIONS, {"prompt": [100] * (MAX_MODEL_LEN - 4), "max_tokens": 5}, "max_tokens"),
    (CHAT, {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": MAX_MODEL_LEN},
     "max_completion_tokens"),
    (CHAT, {"messages": [{"role": "user", "content": "word " * 400}], "max_tokens": 1}, "messages"),
])
def test_length_limits_are_400(client: httpx.Client, path: str, body: dict, param: str) -> None:
    response = client.post(path, json=body)
    assert response.status_code == 400, response.text
    error = check_error_body(response)
    assert (error["param"], error["code"]) == (param, "context_length_exceeded"), error


# --- authentication ----------------------------------------------------------------------------

@pytest.mark.parametrize("method, path", [("POST", COMPLETIONS), ("POST", CHAT), ("GET", "/v1/models"),
                                          ("GET", "/v1/cache/stats"), ("POST", "/v1/cache/reset")])
@pytest.mark.parametrize("authorization", [None, "Bearer wrong-key", API_KEY, f"Basic {API_KEY}",
                                           f"Bearer {API_KEY}x"])
def test_v1_routes_need_the_env_api_key(server: ServerProcess, method: str, path: str,
                                        authorization: str | None) -> None:
    headers = {} if authorization is None else {"Authorization": authorization}
    response = httpx.request(method, server.base_url + path, headers=headers, timeout=10,
                             json={"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    assert response.status_code == 401, response.text
    assert check_error_body(response)["code"] == "invalid_api_key"


def test_health_and_metrics_need_no_api_key(server: ServerProcess) -> None:
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
    response = httpx.get(server.base_url + "/metrics", timeout=10)
    assert response.status_code == 200
    assert "fdserve:http_requests_total" in response.text


# --- local security ----------------------------------------------------------------------------

def test_shared_memory_and_semaphores_are_private(server: ServerProcess) -> None:
    names = shm_names(server.instance_id)
    prefix = f"fd.{server.instance_id}."
    for required in (prefix + "engine_stats.0", prefix + "worker_ready.0", "sem." + prefix + "kvcache_lock.0"):
        assert required in names, f"{required} not in {names}"
    assert any(name.startswith(prefix + "kvcache_tp") for name in names), names  # the KV cache itself
    for name in names:
        info = os.stat(f"/dev/shm/{name}")
        assert stat.S_IMODE(info.st_mode) == 0o600, f"/dev/shm/{name} has mode {oct(stat.S_IMODE(info.st_mode))}"
        assert info.st_uid == os.getuid(), name
    ipc_dir = os.stat(ipc_dir_for(server.instance_id))  # the ZMQ ipc:// socket files live here
    assert stat.S_IMODE(ipc_dir.st_mode) == 0o700


def _listening_addresses(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net shows them) of TCP sockets listening on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as lines:
            next(lines)
            for line in lines:
                fields = line.split()
                address, port_hex = fields[1].split(":")
                if int(port_hex, 16) == port and fields[3] == "0A":  # 0A: LISTEN
                    found.append(address)
    return found


def test_binds_loopback_only_by_default(server: ServerProcess) -> None:
    assert "--host" not in server.args
    assert _listening_addresses(server.port) == ["0100007F"]  # 127.0.0.1, little-endian hex; no IPv6
    defaults = EngineArgs.add_cli_args(argparse.ArgumentParser()).parse_args([])
    assert defaults.host == "127.0.0.1" and EngineArgs().host == "127.0.0.1"


# --- still serving, and nothing failed ---------------------------------------------------------

def test_reference_output_after_fuzzing(client: httpx.Client) -> None:
    entry = load_reference()[0]
    response = client.post(COMPLETIONS, json={"prompt": entry["prompt_ids"], "max_tokens": len(entry["output_ids"]),
                                              "temperature": 0, "return_token_ids": True})
    assert response.status_code == 200, response.text
    ours, reference = expected_prefix(entry, response.json()["choices"][0]["completion_token_ids"])
    assert ours == reference
    assert len(reference) > 0


def test_metrics_show_no_server_error(server: ServerProcess) -> None:
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    by_status: dict[str, float] = {}
    finished: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "fdserve:http_requests_total":
                status = sample.labels["status_code"]
                by_status[status] = by_status.get(status, 0) + sample.value
            elif sample.name == "fdserve:request_finished_total":
                reason = sample.labels["finish_reason"]
                finished[reason] = finished.get(reason, 0) + sample.value
    assert sum(by_status.values()) > 0, by_status
    assert not {s: n for s, n in by_status.items() if s.startswith("5")}, by_status
    assert finished.get("error", 0) == 0, finished
