"""HTTP-level errors of the OpenAI API against a real server (``python launch.py``).

One server for the module: ``--max-model-len 512 --api-key KEY`` and a small
``FD_MAX_REQUEST_BYTES``. Every bad request must get a 4xx with the OpenAI error body
(never a 5xx), and the server must still serve valid requests afterwards. Also checked:
a client that goes away mid-request leaves no request behind in the API server.
"""
from __future__ import annotations

import json
import time
from typing import Any, Iterator

import httpx
import pytest

from harness.server import ServerProcess


pytestmark = pytest.mark.integration

API_KEY = "test-api-errors-key"
MAX_MODEL_LEN = 512
MAX_REQUEST_BYTES = 200_000
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
HELLO = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess("--max-model-len", str(MAX_MODEL_LEN), "--api-key", API_KEY,
                       env={"FD_MAX_REQUEST_BYTES": str(MAX_REQUEST_BYTES)}) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=120) as http:
        yield http


def assert_error(response: httpx.Response, status: int, param: str | None = None,
                 code: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


# --- authentication ----------------------------------------------------------------------------

def test_health_needs_no_key(server: ServerProcess) -> None:
    response = httpx.get(server.base_url + "/health", timeout=10)
    assert response.status_code == 200
    assert response.json()["status"] == "ok"


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}])
def test_missing_or_wrong_api_key_is_401(server: ServerProcess, headers: dict[str, str]) -> None:
    for method, path in (("GET", "/v1/models"), ("POST", COMPLETIONS), ("POST", CHAT)):
        body = {"prompt": "hi", "messages": HELLO, "max_tokens": 1}
        response = httpx.request(method, server.base_url + path, headers=headers, json=body, timeout=10)
        assert_error(response, 401, code="invalid_api_key")


def test_models_with_key(client: httpx.Client) -> None:
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    assert len(body["data"]) == 1 and body["data"][0]["object"] == "model" and body["data"][0]["id"]


# --- malformed bodies --------------------------------------------------------------------------

@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("raw", [b'{"prompt": "hi",', b"not json at all", b""])
def test_invalid_json_is_400(client: httpx.Client, path: str, raw: bytes) -> None:
    response = client.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert_error(response, 400, code="invalid_json")


@pytest.mark.parametrize("raw", [b"[1, 2, 3]", b'"a string"', b"42"])
def test_body_must_be_an_object(client: httpx.Client, raw: bytes) -> None:
    assert_error(client.post(COMPLETIONS, content=raw), 400)


@pytest.mark.parametrize("path, body, param", [
    (COMPLETIONS, {"prompt": "hi", "max_tokens": "5"}, "max_tokens"),
    (COMPLETIONS, {"prompt": "hi", "temperature": "hot"}, "temperature"),
    (COMPLETIONS, {"prompt": "hi", "stream": "yes"}, "stream"),
    (COMPLETIONS, {"prompt": "hi", "stop": 3}, "stop"),
    (COMPLETIONS, {"prompt": {"text": "hi"}}, "prompt"),
    (COMPLETIONS, {"prompt": [1, "two"]}, "prompt"),
    (COMPLETIONS, {"prompt": ["one", [2]]}, "prompt"),
    (COMPLETIONS, {"prompt": ["one", ""]}, "prompt"),
    (COMPLETIONS, {"prompt": []}, "prompt"),
    (COMPLETIONS, {"max_tokens": 5}, "prompt"),
    (CHAT, {"messages": "hello"}, "messages"),
    (CHAT, {"messages": [{"content": "no role"}]}, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages"),
    (CHAT, {"messages": []}, "messages"),
    (CHAT, {"messages": HELLO, "top_p": [1]}, "top_p"),
    (CHAT, {"messages": HELLO, "stream_options": {"include_usage": "yes"}}, "stream_options"),
])
def test_wrong_field_types_and_shapes_are_400(client: httpx.Client, path: str, body: dict, param: str) -> None:
    assert_error(client.post(path, json=body), 400, param=param)


# --- values ------------------------------------------------------------------------------------

@pytest.mark.parametrize("path, body, param", [
    (COMPLETIONS, {"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    (CHAT, {"messages": HELLO, "max_completion_tokens": -3}, "max_completion_tokens"),
    (CHAT, {"messages": HELLO, "max_tokens": -3}, "max_tokens"),
    (COMPLETIONS, {"prompt": "hi", "temperature": -0.5}, "temperature"),
    (CHAT, {"messages": HELLO, "top_p": 1.5}, "top_p"),
    (CHAT, {"messages": HELLO, "top_p": 0}, "top_p"),
])
def test_out_of_range_values_are_400(client: httpx.Client, path: str, body: dict, param: str) -> None:
    assert_error(client.post(path, json=body), 400, param=param)


@pytest.mark.parametrize("path, body, param", [
    (COMPLETIONS, {"prompt": [100] * 600}, "prompt"),
    (COMPLETIONS, {"prompt": [100] * MAX_MODEL_LEN}, "prompt"),
    (COMPLETIONS, {"prompt": "hello " * 600}, "prompt"),
    (CHAT, {"messages": [{"role": "user", "content": "hello " * 600}]}, "messages"),
    (COMPLETIONS, {"prompt": [100] * 500, "max_tokens": 20}, "max_tokens"),
    (CHAT, {"messages": HELLO, "max_completion_tokens": MAX_MODEL_LEN}, "max_completion_tokens"),
])
def test_too_long_for_max_model_len_is_400(client: httpx.Client, path: str, body: dict, param: str) -> None:
    error = assert_error(client.post(path, json=body), 400, param=param, code="context_length_exceeded")
    assert str(MAX_MODEL_LEN) in error["message"]


def test_prompt_plus_max_tokens_exactly_max_model_len_is_accepted(client: httpx.Client) -> None:
    response = client.post(COMPLETIONS, json={"prompt": [100] * (MAX_MODEL_LEN - 1), "max_tokens": 1,
                                              "temperature": 0})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == MAX_MODEL_LEN - 1


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_unknown_model_is_404(client: httpx.Client, path: str) -> None:
    # As OpenAI and vLLM answer: the openai client raises NotFoundError.
    body = {"model": "gpt-4-does-not-exist", "prompt": "hi", "messages": HELLO, "max_tokens": 1}
    assert_error(client.post(path, json=body), 404, param="model", code="model_not_found")


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_n_out_of_range_is_400(client: httpx.Client, path: str) -> None:
    for n in (0, 129):
        assert_error(client.post(path, json={"prompt": "hi", "messages": HELLO, "n": n}), 400, param="n")


@pytest.mark.parametrize("body, param", [
    ({"prompt": [10**9]}, "prompt"),
    ({"prompt": [1, 2, -1]}, "prompt"),
    ({"prompt": [[5, 10**6]]}, "prompt"),
    ({"prompt": "hi", "stop_token_ids": [10**9]}, "stop_token_ids"),
])
def test_token_id_out_of_range_is_400(client: httpx.Client, body: dict, param: str) -> None:
    assert_error(client.post(COMPLETIONS, json=body), 400, param=param)


@pytest.mark.parametrize("path, body, param", [
    (COMPLETIONS, {"prompt": "hi", "logprobs": 21}, "logprobs"),
    (COMPLETIONS, {"prompt": "hi", "suffix": "end"}, "suffix"),
    (COMPLETIONS, {"prompt": "hi", "max_completion_tokens": 3}, "max_completion_tokens"),
    (COMPLETIONS, {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    (COMPLETIONS, {"prompt": "hi", "best_of": 3}, "best_of"),
    (COMPLETIONS, {"prompt": "hi", "logit_bias": {"999999": 1}}, "logit_bias"),
    (CHAT, {"messages": HELLO, "top_logprobs": 2}, "top_logprobs"),
    (CHAT, {"messages": HELLO, "presence_penalty": 3.0}, "presence_penalty"),
    (CHAT, {"messages": [{"role": "user"}]}, "messages"),
    (CHAT, {"messages": [{"role": "robot", "content": "hi"}]}, "messages"),
    (CHAT, {"messages": HELLO, "modalities": ["audio"]}, "modalities"),
])
def test_unsupported_features_are_400(client: httpx.Client, path: str, body: dict, param: str) -> None:
    assert_error(client.post(path, json=body), 400, param=param)


# --- transport-level errors --------------------------------------------------------------------

def test_oversized_body_is_413(client: httpx.Client) -> None:
    big = json.dumps({"prompt": "x" * (MAX_REQUEST_BYTES + 1000)}).encode()
    assert_error(client.post(COMPLETIONS, content=big), 413, code="request_too_large")


def test_oversized_chunked_body_is_413(client: httpx.Client) -> None:
    def chunks() -> Iterator[bytes]:  # no Content-Length: the server has to count
        yield b'{"prompt": "'
        for _ in range(MAX_REQUEST_BYTES // 10_000 + 2):
            yield b"y" * 10_000
        yield b'"}'

    assert_error(client.post(CHAT, content=chunks()), 413, code="request_too_large")


def test_unknown_routes_are_404_json(client: httpx.Client) -> None:
    for path in ("/v1/does-not-exist", "/nothing-here"):
        response = client.get(path)
        assert response.status_code == 404
        assert response.json()["error"]["message"]
    assert client.get(COMPLETIONS).status_code == 405


# --- still serving -----------------------------------------------------------------------------

def test_valid_completion_after_all_errors(client: httpx.Client) -> None:
    response = client.post(COMPLETIONS, json={"prompt": "The capital of France is", "max_tokens": 4,
                                              "temperature": 0, "return_token_ids": True})
    assert response.status_code == 200, response.text
    body = response.json()
    choice = body["choices"][0]
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert choice["finish_reason"] in ("stop", "length")
    assert 1 <= body["usage"]["completion_tokens"] <= 4
    assert len(choice["completion_token_ids"]) == body["usage"]["completion_tokens"]
    assert len(choice["prompt_token_ids"]) == body["usage"]["prompt_tokens"]
    assert isinstance(choice["text"], str)


def read_stream(response: httpx.Response) -> list[Any]:
    events: list[Any] = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def test_valid_chat_stream_after_all_errors(client: httpx.Client) -> None:
    request = {"messages": HELLO, "max_tokens": 6, "temperature": 0, "stream": True,
               "stream_options": {"include_usage": True}, "return_token_ids": True}
    with client.stream("POST", CHAT, json=request) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = read_stream(response)
    assert events[-1] == "[DONE]"
    chunks, usage_event = events[:-2], events[-2]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[0]["choices"][0]["prompt_token_ids"]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert usage_event["choices"] == [] and usage_event["usage"]["completion_tokens"] >= 1
    streamed_ids = [t for chunk in chunks for t in chunk["choices"][0]["completion_token_ids"]]
    assert len(streamed_ids) == usage_event["usage"]["completion_tokens"]


def test_stop_string_truncates_the_greedy_text(client: httpx.Client) -> None:
    base = {"prompt": "Count to ten: one, two, three,", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    full = client.post(COMPLETIONS, json=base).json()["choices"][0]["text"]
    if len(full.strip()) < 4:
        pytest.fail(f"the model produced too little text to pick a stop string from: {full!r}")
    start = len(full) // 2
    stop = full[start:start + 2]
    stopped = client.post(COMPLETIONS, json={**base, "stop": [stop]}).json()["choices"][0]
    assert stopped["finish_reason"] == "stop"
    assert stopped["text"] == full[:full.index(stop)]


def _active_requests(client: httpx.Client) -> int:
    health = client.get("/health").json()
    if "active_requests" not in health:
        pytest.skip("/health does not report active_requests")
    return int(health["active_requests"])


def _wait_no_active_requests(client: httpx.Client, timeout: float = 5.0) -> int:
    deadline = time.monotonic() + timeout
    while (active := _active_requests(client)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return active


def test_client_disconnect_releases_the_request(client: httpx.Client, server: ServerProcess) -> None:
    long_run = {"max_tokens": 400, "ignore_eos": True, "temperature": 0}
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=120) as own:
        with own.stream("POST", COMPLETIONS, json={"prompt": "Tell a story.", "stream": True, **long_run}) as r:
            first = next(r.iter_lines())
            assert first.startswith("data: ")
        # Non-streamed: the client gives up after a short timeout.
        with pytest.raises(httpx.ReadTimeout):
            own.post(CHAT, json={"messages": HELLO, **long_run}, timeout=1.0)
    assert _wait_no_active_requests(client) == 0
    assert client.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 1}).status_code == 200
