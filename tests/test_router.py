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
import os
import re
import signal
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from harness.router import RouterProcess
from harness.server import ServerProcess, free_port, prepare_server_child, shm_names
from inter_communicator.shm import sweep_stale
from router.backends import Backend, BackendPool, NoBackendError, Role
from router.cli import parse_args
from router.metrics import RouterMetrics
from router.proxy import Forwarder
from scripts.make_tiny_dense import make_tiny_dense

REPO_ROOT = Path(__file__).resolve().parents[1]
# Instances of the tiny model: a few sequences, room for one long one. A long stream (it takes seconds on the
# tiny model, which decodes fast) keeps a backend busy while a test looks; the tests end it early.
# Block size 16: the P/D instances transfer a prompt's full blocks, so short prompts have some.
SERVER_ARGS = ("--max-num-seqs", "8", "--num-gpu-blocks-override", "1280", "--block-size", "16")
CONTEXT = 16384
LONG = 16000
PROMPT = "The quick brown fox"
TIMEOUT = 60.0
WAIT_S = 30.0  # bound of every wait for a state change (the CPU is shared: a loaded one is slow)


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


def test_mode_goes_to_the_less_busy_side() -> None:
    decode, mixed = Backend("http://d:1", Role.DECODE, healthy=True), Backend("http://m:1", Role.MIXED, healthy=True)
    pool = BackendPool([Backend("http://p:1", Role.PREFILL), decode, mixed])
    forwarder = Forwarder(pool, client=None, metrics=RouterMetrics(pool))
    assert forwarder.choose_mode() == "pd"  # a tie; the prefill instance being down only costs a local prefill
    decode.in_flight = 1
    assert forwarder.choose_mode() == "mixed"
    mixed.mark_unhealthy("gone")
    assert forwarder.choose_mode() == "pd"
    decode.mark_unhealthy("gone too")
    with pytest.raises(NoBackendError, match="http://d:1 \\(decode\\): gone too; http://m:1 \\(mixed\\): gone"):
        forwarder.choose_mode()


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
def started_servers(arg_lists: list[tuple[str, ...]]) -> Iterator[list[ServerProcess]]:
    """launch.py instances started side by side (the start-up is the slow part), closed on every path."""
    servers = [ServerProcess(*args) for args in arg_lists]
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
def instances(tiny_model: str) -> Iterator[dict[str, list[ServerProcess]]]:
    """Two mixed instances, one prefill and one decode instance, all of the tiny model (started together)."""
    roles = ["mixed", "mixed", "prefill", "decode"]
    with started_servers([("--model", tiny_model, *SERVER_ARGS, "--splitwise-role", r) for r in roles]) as servers:
        yield {role: [s for s, r in zip(servers, roles) if r == role] for role in set(roles)}


@pytest.fixture(scope="module")
def backends(instances: dict[str, list[ServerProcess]]) -> list[ServerProcess]:
    return instances["mixed"]


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
    """An answer without what differs between two calls: the id, the creation time, the prefix-cache hits."""
    payload = re.sub(rb'"id":"[^"]*"', b'"id":"X"', payload)
    payload = re.sub(rb'"cached_tokens":\d+', b'"cached_tokens":0', payload)
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
    chat = {"messages": [{"role": "user", "content": PROMPT}]}
    body.update({"prompt": PROMPT} if path == "/v1/completions" else chat)
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


# ---- integration: P/D (prefill then decode) ------------------------------------------------------------------

LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 6  # 61 tokens: three full blocks to transfer
PD_CASES = [  # (path, prompt, stream)
    ("/v1/completions", LONG_PROMPT, False),
    ("/v1/completions", LONG_PROMPT + "Then", True),
    ("/v1/completions", "Once upon a time", False),  # shorter than a block: nothing to transfer
    ("/v1/chat/completions", "Tell me about foxes and dogs and why the quick one jumps over the lazy one.", True),
    ("/v1/chat/completions", LONG_PROMPT, False),
    ("/v1/completions", "A different prompt, long enough to fill a block of sixteen tokens or more.", True),
]


def pd_request(path: str, prompt: str, stream: bool) -> dict:
    body: dict = {"max_tokens": 24, "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    chat = {"messages": [{"role": "user", "content": prompt}]}
    body.update({"prompt": prompt} if path == "/v1/completions" else chat)
    return body


def answer_text_and_usage(path: str, response: httpx.Response) -> tuple[str, dict]:
    """The generated text and the usage of a streamed or a plain answer."""
    assert response.status_code == 200, response.text
    if not response.headers["content-type"].startswith("text/event-stream"):
        choice = response.json()["choices"][0]
        return (choice["text"] if path == "/v1/completions" else choice["message"]["content"]), response.json()["usage"]
    text, usage = "", None
    for event in response.content.split(b"\n\n"):
        if not event.startswith(b"data: {"):
            continue
        chunk = json.loads(event.removeprefix(b"data: "))
        usage = chunk.get("usage") or usage
        for choice in chunk["choices"]:
            text += choice.get("text", "") if path == "/v1/completions" else choice["delta"].get("content") or ""
    return text, usage


def prefill_fallbacks(router: RouterProcess) -> dict[str, float]:
    found = re.findall(r'fdserve_router_prefill_fallbacks_total\{reason="(\w+)"\} ([0-9.]+)',
                       httpx.get(router.base_url + "/metrics", timeout=TIMEOUT).text)
    return {reason: float(count) for reason, count in found}


@pytest.fixture(scope="module")
def pd_router(instances: dict[str, list[ServerProcess]]) -> Iterator[RouterProcess]:
    with RouterProcess(prefill=[instances["prefill"][0].base_url], decode=[instances["decode"][0].base_url],
                       args=["--health-interval", "0.5"]) as proc:
        yield proc
    if proc.returncode != 0:
        pytest.fail(f"router exited with {proc.returncode} after SIGINT:\n{proc.log_tail()}")


@pytest.mark.integration
def test_pd_greedy_answers_equal_a_mixed_instance_concurrently(pd_router: RouterProcess,
                                                                instances: dict[str, list[ServerProcess]]) -> None:
    mixed, prefill = instances["mixed"][0], instances["prefill"][0]
    expected = [answer_text_and_usage(path, httpx.post(mixed.base_url + path, json=pd_request(path, prompt, stream),
                                                       timeout=TIMEOUT))
                for path, prompt, stream in PD_CASES]
    with ThreadPoolExecutor(len(PD_CASES)) as pool:
        routed = list(pool.map(lambda case: answer_text_and_usage(case[0], httpx.post(
            pd_router.base_url + case[0], json=pd_request(*case), timeout=TIMEOUT)), PD_CASES))
    for (path, prompt, _), (text, usage), (want_text, want_usage) in zip(PD_CASES, routed, expected):
        assert text == want_text, (path, prompt)
        assert {k: usage[k] for k in ("prompt_tokens", "completion_tokens")} == {
            k: want_usage[k] for k in ("prompt_tokens", "completion_tokens")}
    # The long prompts' full blocks came from the prefill instance (the decode instance had never seen them).
    assert routed[0][1]["prompt_tokens_details"]["cached_tokens"] >= 48
    assert prefill_fallbacks(pd_router) == {"no_offer": 1.0}  # the prompt shorter than one block
    metrics = httpx.get(pd_router.base_url + "/metrics", timeout=TIMEOUT).text
    assert f'fdserve_router_requests_total{{endpoint="/v1/completions",mode="pd"}} 4.0' in metrics
    wait_until(lambda: httpx.get(prefill.base_url + "/v1/cache/stats", timeout=TIMEOUT).json()["pd_held_blocks"] == 0,
               "the prefill instance holds no blocks once the decode instance has read them")


@pytest.mark.integration
def test_pd_batch_prompt_and_client_errors(pd_router: RouterProcess, instances: dict[str, list[ServerProcess]]) -> None:
    mixed = instances["mixed"][0]
    body = {"prompt": [LONG_PROMPT, "Once upon a time"], "max_tokens": 6, "temperature": 0}
    routed = httpx.post(pd_router.base_url + "/v1/completions", json=body, timeout=TIMEOUT)
    direct = httpx.post(mixed.base_url + "/v1/completions", json=body, timeout=TIMEOUT)
    assert routed.status_code == 200, routed.text
    assert [c["text"] for c in routed.json()["choices"]] == [c["text"] for c in direct.json()["choices"]]
    assert prefill_fallbacks(pd_router).get("batch") == 1.0
    # A mistake the prefill instance finds comes back as its 4xx, and no decode call is made.
    bad = {"prompt": LONG_PROMPT, "max_tokens": 4, "temperature": -1}
    routed = httpx.post(pd_router.base_url + "/v1/completions", json=bad, timeout=TIMEOUT)
    direct = httpx.post(mixed.base_url + "/v1/completions", json=bad, timeout=TIMEOUT)
    assert routed.status_code == direct.status_code == 400 and routed.content == direct.content


@pytest.mark.integration
def test_pd_prefill_then_decode_killed(instances: dict[str, list[ServerProcess]]) -> None:
    """A router with P/D and a mixed instance: the prefill instance gone, the decode instance prefills locally;
    the decode instance killed mid-stream, an error event and [DONE], then the mixed instance serves. Kills both
    P/D instances: keep this after the other P/D tests."""
    prefill, decode, mixed = instances["prefill"][0], instances["decode"][0], instances["mixed"][1]
    want, _ = answer_text_and_usage("/v1/completions", complete(mixed.base_url, prompt=LONG_PROMPT))
    with RouterProcess(prefill=[prefill.base_url], decode=[decode.base_url], mixed=[mixed.base_url],
                       args=["--health-interval", "0.5"]) as router:
        prefill.kill_group()
        for _ in range(2):
            text, usage = answer_text_and_usage("/v1/completions", complete(router.base_url, prompt=LONG_PROMPT))
            assert text == want
        fallbacks = prefill_fallbacks(router)
        assert fallbacks.get("prefill_failed", 0) + fallbacks.get("no_prefill", 0) == 2, fallbacks

        with httpx.Client(timeout=TIMEOUT) as client:
            stream = open_stream(router.base_url, client)  # idle: P/D takes it
            chunks = stream.iter_raw()
            first = next(chunks)
            assert backend_status(router)[decode.base_url]["in_flight"] == 1
            decode.kill_group()
            rest = b"".join(chunks)
        events = (first + rest).split(b"\n\n")
        assert events[-2:] == [b"data: [DONE]", b""]
        error = json.loads(events[-3].removeprefix(b"data: "))["error"]
        assert decode.base_url in error["message"] and "decode backend" in error["message"]
        for _ in range(3):
            text, _ = answer_text_and_usage("/v1/completions", complete(router.base_url, prompt=LONG_PROMPT))
            assert text == want
        assert httpx.get(router.base_url + "/health", timeout=TIMEOUT).status_code == 200
        assert backend_status(router)[decode.base_url]["healthy"] is False
    assert router.returncode == 0, router.log_tail()


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


# ---- integration: scripts/run_pd.sh -------------------------------------------------------------------------


@pytest.mark.integration
def test_run_pd_script_serves_then_stops_clean(tiny_model: str, tmp_path: Path) -> None:
    ports = {"router": free_port(), "prefill": free_port(), "decode": free_port()}
    env = {**os.environ, "MODEL": tiny_model, "PREFILL_PORT": str(ports["prefill"]),
           "DECODE_PORT": str(ports["decode"]), "LOG_DIR": str(tmp_path), "STOP_TIMEOUT": "20"}
    stderr_path = tmp_path / "run_pd.err"
    with open(stderr_path, "wb") as stderr:
        proc = subprocess.Popen(["bash", str(REPO_ROOT / "scripts" / "run_pd.sh"), str(ports["router"]),
                                 *SERVER_ARGS], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=stderr,
                                start_new_session=True, preexec_fn=prepare_server_child)
    try:
        ready = proc.stdout.readline().decode()  # the script's only stdout line; EOF if it fails
        assert "ready" in ready and str(ports["router"]) in ready, stderr_path.read_text()
        base_url = f"http://127.0.0.1:{ports['router']}"
        assert httpx.get(base_url + "/health", timeout=TIMEOUT).status_code == 200
        answer = complete(base_url, prompt=LONG_PROMPT)
        assert answer.status_code == 200 and answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 48
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0, stderr_path.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
    started = [int(pid) for pid in re.findall(r"started \w+ \(pid (\d+)", stderr_path.read_text())]
    assert len(started) == 3
    left = [pid for pid in started if Path(f"/proc/{pid}").exists()]
    assert left == [], f"processes left: {left}"
    instance_ids = (f"pdp{ports['prefill']}", f"pdd{ports['decode']}")
    leftovers = [name for instance_id in instance_ids for name in shm_names(instance_id)]
    for instance_id in instance_ids:
        sweep_stale(instance_id)
    assert leftovers == []
    for port in ports.values():  # all three ports free again (TIME_WAIT connections aside)
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", port))
