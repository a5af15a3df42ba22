"""The router (``python -m router``, issue 14 item 4) in front of real ``launch.py`` instances.

Fast tests: the backend pick (least in flight, round-robin among equals), the command line's checks, and that
the router imports no engine internals. Integration tests (one tiny dense model, two mixed instances started
once for the module, one router): requests spread round-robin when idle and to the idle instance when one is
busy; streamed and non-streamed answers through the router equal a direct call (ids and timestamps aside);
``/health``, ``/v1/models`` and ``/metrics``; bad input is a 4xx naming the problem; a client that leaves
aborts the backend's request; and (last, it kills one) a backend killed mid-stream gives an SSE error event and
``[DONE]``, then the router serves everything through the other one. A router whose only backend is down
answers 503 with the reason.
"""
from __future__ import annotations

import ast
import contextlib
import json
import re
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from harness.router import RouterProcess
from harness.server import ServerProcess, free_port
from router.backends import Backend, BackendPool, NoBackendError, Role
from router.cli import parse_args
from scripts.make_tiny_dense import make_tiny_dense

REPO_ROOT = Path(__file__).resolve().parents[1]
# Instances of the tiny model: a few sequences, room for one long one. A long stream (it takes seconds on the
# tiny model, which decodes fast) keeps a backend busy while a test looks; the tests end it early.
SERVER_ARGS = ("--max-num-seqs", "8", "--num-gpu-blocks-override", "320")
CONTEXT = 16384
LONG = 16000
PROMPT = "The quick brown fox"
TIMEOUT = 60.0
WAIT_S = 10.0  # bound of every wait for a state change


# ---- fast: the pick, the command line, the imports ---------------------------------------------------------


def test_pick_is_least_in_flight_then_round_robin() -> None:
    a, b, c = (Backend(f"http://h{i}:1", Role.MIXED, healthy=True) for i in range(3))
    pool = BackendPool([a, b, c, Backend("http://p:1", Role.PREFILL, healthy=True)])
    assert [pool.pick(Role.MIXED).url for _ in range(6)] == [x.url for x in (a, b, c, a, b, c)]
    a.in_flight, b.in_flight, c.in_flight = 2, 1, 1
    assert {pool.pick(Role.MIXED).url for _ in range(4)} == {b.url, c.url}
    b.mark_unhealthy("test")
    assert [pool.pick(Role.MIXED).url for _ in range(2)] == [c.url, c.url]
    c.mark_unhealthy("gone")
    assert pool.pick(Role.MIXED) is a
    a.mark_unhealthy("down")
    with pytest.raises(NoBackendError, match="no healthy mixed backend.*http://h2:1: gone"):
        pool.pick(Role.MIXED)
    assert pool.least_in_flight(Role.MIXED) is None and pool.least_in_flight(Role.PREFILL) == 0


@pytest.mark.parametrize(("argv", "message"), [
    ([], "at least one --decode"),
    (["--prefill", "127.0.0.1:9"], "--prefill needs at least one --decode"),
    (["--mixed", "127.0.0.1:9", "http://127.0.0.1:9/"], "given twice"),
    (["--mixed", "ftp://x:1"], "not an http"),
    (["--mixed", "http://x:1/v1"], "without a path"),
    (["--mixed", "x:1", "--health-timeout", "0"], "--health-timeout must be > 0"),
    (["--mixed", "x:1", "--port", "70000"], "--port must be in"),
])
def test_cli_rejects_bad_arguments(argv: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_normalises_backend_urls() -> None:
    args = parse_args(["--prefill", "127.0.0.1:1", "--decode", "http://localhost:2/", "--decode", "h:3",
                       "--port", str(free_port())])
    assert args.prefill == ["http://127.0.0.1:1"] and args.decode == ["http://localhost:2", "http://h:3"]


def test_router_imports_no_engine_internals() -> None:
    """A separate process: only uvicorn's set-up and the streaming response of the API server, and config.log."""
    allowed = {"engine.entrypoints.http_server", "engine.entrypoints.sse", "config.log", "envs"}
    own_layers = ("config", "inter_communicator", "cache_manager", "worker", "engine", "launch", "harness", "tests")
    wrong = []
    for path in sorted((REPO_ROOT / "router").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            wrong += [f"{path.name}: {n}" for n in names
                      if n.split(".")[0] in own_layers and n not in allowed]
    assert wrong == []


# ---- integration: two mixed instances behind the router ----------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_dense(str(tmp_path_factory.mktemp("router_tiny")), max_position_embeddings=CONTEXT)


@contextlib.contextmanager
def started_servers(count: int, *args: str) -> Iterator[list[ServerProcess]]:
    """``count`` launch.py instances started side by side (the start-up is the slow part), closed on every path."""
    servers = [ServerProcess(*args) for _ in range(count)]
    try:
        for server in servers:
            server.launch()
        for server in servers:
            server.wait_healthy()
        yield servers
    finally:
        for server in servers:
            server.close()


@pytest.fixture(scope="module")
def backends(tiny_model: str) -> Iterator[list[ServerProcess]]:
    with started_servers(2, "--model", tiny_model, *SERVER_ARGS) as servers:
        yield servers


@pytest.fixture(scope="module")
def router(backends: list[ServerProcess]) -> Iterator[RouterProcess]:
    # Frequent checks so a killed backend is noticed within the test's waits.
    with RouterProcess(mixed=[s.base_url for s in backends], args=["--health-interval", "0.5"]) as proc:
        yield proc
    if proc.returncode != 0:
        pytest.fail(f"router exited with {proc.returncode} after SIGINT:\n{proc.log_tail()}")


def backend_status(router: RouterProcess) -> dict[str, dict]:
    body = httpx.get(router.base_url + "/health", timeout=TIMEOUT).json()
    return {b["url"]: b for b in body["backends"]}


def requests_per_backend(router: RouterProcess) -> dict[str, int]:
    return {url: b["requests_total"] for url, b in backend_status(router).items()}


def complete(base_url: str, **fields: object) -> httpx.Response:
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, **fields}
    return httpx.post(base_url + "/v1/completions", json=body, timeout=TIMEOUT)


def normalise(payload: bytes) -> bytes:
    """An answer without what differs between two calls: the id and the creation time."""
    payload = re.sub(rb'"id":"[^"]*"', b'"id":"X"', payload)
    return re.sub(rb'"created":\d+', b'"created":0', payload)


def open_stream(base_url: str, client: httpx.Client, max_tokens: int = LONG) -> httpx.Response:
    request = client.build_request("POST", base_url + "/v1/completions", json={
        "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True})
    response = client.send(request, stream=True)
    assert response.status_code == 200, response.read()
    return response


def wait_until(predicate, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {WAIT_S} s: {what}")
        time.sleep(0.1)


@pytest.mark.integration
def test_health_models_and_metrics(router: RouterProcess, backends: list[ServerProcess]) -> None:
    health = httpx.get(router.base_url + "/health", timeout=TIMEOUT)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert {b["url"]: (b["role"], b["healthy"]) for b in health.json()["backends"]} == {
        s.base_url: ("mixed", True) for s in backends}
    direct = httpx.get(backends[0].base_url + "/v1/models", timeout=TIMEOUT).json()
    assert httpx.get(router.base_url + "/v1/models", timeout=TIMEOUT).json()["data"] == direct["data"]
    assert complete(router.base_url).status_code == 200
    metrics = httpx.get(router.base_url + "/metrics", timeout=TIMEOUT).text
    assert 'fdserve_router_requests_total{endpoint="/v1/completions",mode="mixed"}' in metrics
    assert 'fdserve_router_responses_total{endpoint="/v1/completions",status="200"}' in metrics
    assert f'fdserve_router_backend_healthy{{backend="{backends[1].base_url}",role="mixed"}} 1.0' in metrics


@pytest.mark.integration
def test_idle_backends_take_turns_and_a_busy_one_is_avoided(router: RouterProcess) -> None:
    before = requests_per_backend(router)
    for _ in range(4):
        assert complete(router.base_url).status_code == 200
    after = requests_per_backend(router)
    assert {url: after[url] - before[url] for url in after} == dict.fromkeys(after, 2)

    with httpx.Client(timeout=TIMEOUT) as client:
        stream = open_stream(router.base_url, client)
        try:
            busy = [url for url, b in backend_status(router).items() if b["in_flight"] == 1]
            assert len(busy) == 1
            before = requests_per_backend(router)
            for _ in range(3):
                assert complete(router.base_url).status_code == 200
            after = requests_per_backend(router)
            assert {url: after[url] - before[url] for url in after} == {
                url: 0 if url in busy else 3 for url in after}
        finally:
            stream.close()


@pytest.mark.integration
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streamed_answer_equals_a_direct_call(router: RouterProcess, backends: list[ServerProcess],
                                              path: str) -> None:
    body = {"max_tokens": 12, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    body.update({"prompt": PROMPT} if path == "/v1/completions" else {"messages": [{"role": "user", "content": PROMPT}]})
    direct = httpx.post(backends[0].base_url + path, json=body, timeout=TIMEOUT)
    routed = httpx.post(router.base_url + path, json=body, timeout=TIMEOUT)
    assert routed.status_code == direct.status_code == 200
    assert routed.headers["content-type"] == direct.headers["content-type"]
    assert routed.content.endswith(b"data: [DONE]\n\n") and routed.content.count(b"data: ") > 12
    assert normalise(routed.content) == normalise(direct.content)
    plain = dict(body, stream=False)
    plain.pop("stream_options")
    direct = httpx.post(backends[1].base_url + path, json=plain, timeout=TIMEOUT)
    routed = httpx.post(router.base_url + path, json=plain, timeout=TIMEOUT)
    assert normalise(routed.content) == normalise(direct.content)
    assert routed.json()["usage"] == direct.json()["usage"]


@pytest.mark.integration
def test_bad_input_is_a_4xx_with_a_message(router: RouterProcess, backends: list[ServerProcess]) -> None:
    url = router.base_url + "/v1/completions"
    cases = [(b"{not json", "not valid JSON"), (b"[1, 2]", "must be a JSON object"),
             (b'{"prompt": "x", "stream": "yes"}', "'stream' must be a boolean")]
    for payload, message in cases:
        answer = httpx.post(url, content=payload, timeout=TIMEOUT)
        assert answer.status_code == 400 and message in answer.json()["error"]["message"], answer.text
    # What the backend checks comes back unchanged.
    direct = complete(backends[0].base_url, max_tokens=-1)
    routed = complete(router.base_url, max_tokens=-1)
    assert routed.status_code == direct.status_code == 400 and routed.content == direct.content
    assert httpx.get(router.base_url + "/v1/nothing", timeout=TIMEOUT).status_code == 404
    too_big = httpx.post(url, content=b" " * (9 * 1024 * 1024), timeout=TIMEOUT)
    assert too_big.status_code == 413 and "larger than the limit" in too_big.json()["error"]["message"]


@pytest.mark.integration
def test_client_disconnect_aborts_the_backend_request(router: RouterProcess, backends: list[ServerProcess]) -> None:
    def active() -> int:
        return sum(httpx.get(s.base_url + "/health", timeout=TIMEOUT).json()["active_requests"] for s in backends)

    with httpx.Client(timeout=TIMEOUT) as client:
        stream = open_stream(router.base_url, client)
        chunks = stream.iter_raw()  # kept: a dropped iterator closes the response
        next(chunks)
        assert active() == 1
        stream.close()
    wait_until(lambda: active() == 0, "the backend aborts the streamed request after the client left")
    with pytest.raises(httpx.ReadTimeout):  # a non-streamed request, the client gives up before the answer
        httpx.post(router.base_url + "/v1/completions", timeout=1.0,
                   json={"prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True})
    wait_until(lambda: active() == 0, "the backend aborts the non-streamed request after the client left")
    wait_until(lambda: all(b["in_flight"] == 0 for b in backend_status(router).values()),
               "the router counts nothing in flight")


@pytest.mark.integration
def test_backend_killed_mid_stream_then_the_other_serves(router: RouterProcess,
                                                         backends: list[ServerProcess]) -> None:
    """Kills one backend: keep this test last in the module."""
    with httpx.Client(timeout=TIMEOUT) as client:
        stream = open_stream(router.base_url, client)
        chunks = stream.iter_raw()
        first = next(chunks)
        victim = next(s for s in backends if backend_status(router)[s.base_url]["in_flight"] == 1)
        victim.kill_group()
        rest = b"".join(chunks)
    events = (first + rest).split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""]
    error = json.loads(events[-3].removeprefix(b"data: "))["error"]
    assert error["code"] == "backend_error" and victim.base_url in error["message"]
    assert all(json.loads(e.removeprefix(b"data: "))["choices"] for e in events[:-3])  # whole events only

    survivor = next(s for s in backends if s is not victim)
    for _ in range(4):
        answer = complete(router.base_url)
        assert answer.status_code == 200, answer.text
    status = backend_status(router)
    assert status[victim.base_url]["healthy"] is False and status[victim.base_url]["last_error"]
    assert status[survivor.base_url]["healthy"] is True
    assert httpx.get(router.base_url + "/health", timeout=TIMEOUT).status_code == 200


@pytest.mark.integration
def test_no_healthy_backend_is_a_503_with_the_reason() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    proc = RouterProcess(mixed=[dead])
    try:
        proc.start(require_healthy=False)
        health = httpx.get(proc.base_url + "/health", timeout=TIMEOUT)
        assert health.status_code == 503 and health.json()["backends"][0]["healthy"] is False
        answer = complete(proc.base_url)
        assert answer.status_code == 503
        assert answer.json()["error"]["code"] == "no_healthy_backend" and dead in answer.json()["error"]["message"]
    finally:
        proc.close()
    assert proc.returncode == 0, proc.log_tail()
