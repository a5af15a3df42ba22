"""``GET /metrics`` of a real server (``python launch.py``, ``FD_USE_KVCACHE_LOCK=1``).

Scrapes before and after real requests (streamed and not, completions and chat, one prompt sent
twice so the second is a prefix-cache hit) and checks that the counters moved by exactly what
the responses' ``usage`` says, that the latency histograms got one observation per request,
that the engine gauges are sane, that the KV-cache lock counters come through, and that a
frozen engine (SIGSTOP) does not hang the scrape.
"""
from __future__ import annotations

import json
import os
import random
import signal
import time
from collections import Counter as Tally
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.entrypoints.metrics import endpoint_label
from inter_communicator.kvcache_lock import KVCacheLock
from harness.server import ServerProcess
from harness.reference import load_reference


pytestmark = pytest.mark.integration

REFERENCE = load_reference()
MAX_MODEL_LEN = 512
# Long enough that an idle engine always answers on a loaded 2-core CI machine.
ENGINE_TIMEOUT_S = 3.0
BLOCK_SIZE = 64  # the server's default --block-size
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"

Samples = dict[str, list[tuple[dict[str, str], float]]]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess("--max-model-len", str(MAX_MODEL_LEN),
                       env={"FD_USE_KVCACHE_LOCK": "1", "FD_METRICS_ENGINE_TIMEOUT": str(ENGINE_TIMEOUT_S)}) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        yield http


# --- scraping ----------------------------------------------------------------------------------

def scrape(client: httpx.Client) -> Samples:
    response = client.get("/metrics")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    samples: Samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` (0 if there are none)."""
    return sum(v for sample_labels, v in samples.get(name, []) if labels.items() <= sample_labels.items())


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


# --- requests ----------------------------------------------------------------------------------

def post(client: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    result = response.json()
    return {"usage": result["usage"], "finish_reason": result["choices"][0]["finish_reason"]}


def post_stream(client: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    usage, finish_reason = None, None
    with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200, response.read()
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        chunk = json.loads(line[len("data: "):])
        if chunk.get("usage"):
            usage = chunk["usage"]
        for choice in chunk.get("choices", []):
            finish_reason = choice.get("finish_reason") or finish_reason
    assert usage is not None and finish_reason is not None
    return {"usage": usage, "finish_reason": finish_reason}


def long_prompt(num_tokens: int) -> list[int]:
    # Random ids: no other test's prompt shares a cached block with it.
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    return [rng.randrange(100, 40_000) for _ in range(num_tokens)]


# --- tests -------------------------------------------------------------------------------------

def test_exposition_parses_and_every_metric_is_prefixed(client: httpx.Client) -> None:
    samples = scrape(client)
    names = set(samples)
    assert all(name.startswith("fdserve:") for name in names), sorted(n for n in names if "fdserve:" not in n)
    for name in ("fdserve:prompt_tokens_total", "fdserve:generation_tokens_total",
                 "fdserve:time_to_first_token_seconds_bucket", "fdserve:inter_token_latency_seconds_bucket",
                 "fdserve:e2e_request_latency_seconds_bucket", "fdserve:num_requests_running",
                 "fdserve:num_requests_waiting", "fdserve:kv_blocks_used", "fdserve:kv_blocks_total",
                 "fdserve:prefix_cache_hit_tokens_total", "fdserve:kv_storage_write_back_blocks_total",
                 "fdserve:kv_storage_miss_blocks_total", "fdserve:kv_storage_errors_total",
                 "fdserve:worker_restarts_total", "fdserve:kvcache_lock_acquisitions_total",
                 "fdserve:kvcache_lock_wait_seconds_total", "fdserve:kvcache_lock_hold_seconds_total"):
        assert name in names, f"{name} missing from /metrics"
    for name, series in samples.items():
        for labels, _value in series:
            assert labels.get("model_name") == "SmolLM2-135M-Instruct.Q4_1", (name, labels)
    assert {labels["tier"] for labels, _ in samples["fdserve:prefix_cache_hit_tokens_total"]} == {
        "device", "host", "storage"}
    total = value(samples, "fdserve:kv_blocks_total")
    assert total > 0 and 0 <= value(samples, "fdserve:kv_blocks_used") <= total
    assert value(samples, "fdserve:kvcache_lock_enabled") == 1
    # Every lock series names its DP rank (one rank here).
    for name in ("fdserve:kvcache_lock_enabled", "fdserve:kvcache_lock_acquisitions_total",
                 "fdserve:kvcache_lock_held"):
        assert [labels["dp_rank"] for labels, _ in samples[name]] == ["0"], name


def test_cache_stats_report_the_ranks_lock(client: httpx.Client) -> None:
    stats = client.get("/v1/cache/stats").json()
    assert stats["dp_rank"] == 0
    assert stats["kvcache_lock"]["enabled"] is True and stats["kvcache_lock"]["name"].endswith(".0")
    assert "kv_blocks_cached" in stats


def test_counters_and_histograms_follow_requests(client: httpx.Client) -> None:
    entry = REFERENCE[0]
    repeated = {"prompt": long_prompt(2 * BLOCK_SIZE + 20), "max_tokens": 3, "temperature": 0}
    chat = {"messages": [{"role": "user", "content": entry["prompt"]}], "max_tokens": 4, "temperature": 0}
    before = scrape(client)
    results = {
        COMPLETIONS: [
            post(client, COMPLETIONS, {"prompt": entry["prompt_ids"], "max_tokens": 6, "temperature": 0}),
            post_stream(client, COMPLETIONS, {"prompt": entry["prompt_ids"], "max_tokens": 5, "temperature": 0}),
            post(client, COMPLETIONS, repeated),
            post(client, COMPLETIONS, repeated),  # its first two blocks are now in the device prefix cache
        ],
        CHAT: [post(client, CHAT, chat), post_stream(client, CHAT, {**chat, "max_tokens": 3})],
    }
    after = scrape(client)
    assert delta(before, after, "fdserve:engine_query_failures_total") == 0, "cache_stats values are stale"
    everything = [r for per_endpoint in results.values() for r in per_endpoint]
    usages = [r["usage"] for r in everything]

    assert delta(before, after, "fdserve:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert delta(before, after, "fdserve:generation_tokens_total") == sum(u["completion_tokens"] for u in usages)
    for endpoint, endpoint_results in results.items():
        assert delta(before, after, "fdserve:http_requests_total", endpoint=endpoint,
                     status_code="200") == len(endpoint_results)
        reasons = Tally(r["finish_reason"] for r in endpoint_results)
        for reason, count in reasons.items():
            assert delta(before, after, "fdserve:request_finished_total", endpoint=endpoint,
                         finish_reason=reason) == count, (endpoint, reason)

    num_requests = len(everything)
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert delta(before, after, f"fdserve:{histogram}_count") == num_requests, histogram
        assert delta(before, after, f"fdserve:{histogram}_bucket", le="+Inf") == num_requests, histogram
        assert delta(before, after, f"fdserve:{histogram}_sum") > 0, histogram
    assert (delta(before, after, "fdserve:e2e_request_latency_seconds_sum")
            >= delta(before, after, "fdserve:time_to_first_token_seconds_sum"))
    gaps = sum(u["completion_tokens"] - 1 for u in usages)
    assert 1 <= delta(before, after, "fdserve:inter_token_latency_seconds_count") <= gaps
    assert delta(before, after, "fdserve:time_per_output_token_seconds_count") == sum(
        1 for u in usages if u["completion_tokens"] >= 2)

    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usages]
    assert cached[3] >= 2 * BLOCK_SIZE, "the repeated prompt was not served from the prefix cache"
    assert delta(before, after, "fdserve:num_preemptions_total") == 0
    assert delta(before, after, "fdserve:prefix_cache_hit_tokens_total", tier="device") == sum(cached)
    assert delta(before, after, "fdserve:engine_steps_total") >= max(u["completion_tokens"] for u in usages)

    assert delta(before, after, "fdserve:kvcache_lock_acquisitions_total") > 0
    assert delta(before, after, "fdserve:kvcache_lock_hold_seconds_total") > 0
    # Waits are tested where one is forced: test_lock_waits_are_exported.


LOCK_HOLD_S = 2.0


def test_fork_and_storage_lookup_counters_match_the_cache_stats(client: httpx.Client) -> None:
    before = scrape(client)
    # 2 full blocks plus a partial one: the 3 choices share 2 blocks each way and copy the partial one.
    post(client, COMPLETIONS, {"prompt": long_prompt(2 * BLOCK_SIZE + 10), "n": 3, "max_tokens": 2,
                               "temperature": 1.0, "seed": 1})
    after = scrape(client)
    stats = client.get("/v1/cache/stats").json()
    assert delta(before, after, "fdserve:kv_fork_shared_blocks_total") == 4
    assert delta(before, after, "fdserve:kv_fork_copied_blocks_total") == 2
    for key, name in (("fork_shared_blocks", "kv_fork_shared_blocks"),
                      ("fork_copied_blocks", "kv_fork_copied_blocks"),
                      ("storage_lookups", "kv_storage_lookups"),
                      ("storage_lookup_timeouts", "kv_storage_lookup_timeouts")):
        assert value(after, f"fdserve:{name}_total") == stats[key], key


def test_lock_waits_are_exported(server: ServerProcess, client: httpx.Client) -> None:
    """Hold the server's KV-cache lock from the test while a request runs: its execute_model has
    to wait, and the wait shows up in the exported counters."""
    lock = KVCacheLock.attach(server.instance_id, 0, "test")
    body = {"prompt": REFERENCE[1]["prompt_ids"], "max_tokens": 2, "temperature": 0}
    try:
        before = scrape(client)
        with ThreadPoolExecutor(max_workers=1) as pool:
            with lock.hold("test: keep execute_model waiting"):
                pending = pool.submit(post, client, COMPLETIONS, body)
                time.sleep(LOCK_HOLD_S)
            result = pending.result(timeout=120)
        after = scrape(client)
    finally:
        lock.close()
    assert result["usage"]["completion_tokens"] == 2
    assert delta(before, after, "fdserve:kvcache_lock_contended_total") >= 1
    # The request reaches the worker well within a second of being sent.
    assert delta(before, after, "fdserve:kvcache_lock_wait_seconds_total") >= LOCK_HOLD_S / 2
    assert value(after, "fdserve:kvcache_lock_max_wait_seconds") >= LOCK_HOLD_S / 2
    assert delta(before, after, "fdserve:kvcache_lock_hold_seconds_total") >= LOCK_HOLD_S


def test_gauges_return_to_idle(client: httpx.Client) -> None:
    post(client, COMPLETIONS, {"prompt": REFERENCE[1]["prompt_ids"], "max_tokens": 2, "temperature": 0})
    deadline = time.monotonic() + 10
    while True:
        samples = scrape(client)
        idle = {name: value(samples, f"fdserve:{name}") for name in
                ("num_requests_running", "num_requests_waiting", "kv_blocks_used", "api_server_active_requests")}
        if not any(idle.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert idle == dict.fromkeys(idle, 0.0)
    assert value(samples, "fdserve:kv_cache_usage_ratio") == 0
    assert value(samples, "fdserve:worker_restarts_total") == 0


def test_error_statuses_are_counted_by_endpoint(client: httpx.Client) -> None:
    before = scrape(client)
    assert client.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": -1}).status_code == 400
    assert client.post(CHAT, content=b"{not json").status_code == 400
    assert client.get("/no/such/route/for/metrics").status_code == 404
    after = scrape(client)
    assert delta(before, after, "fdserve:http_requests_total", endpoint=COMPLETIONS, status_code="400") == 1
    assert delta(before, after, "fdserve:http_requests_total", endpoint=CHAT, status_code="400") == 1
    # Unknown paths share one label value: scanners cannot blow up the series count.
    assert delta(before, after, "fdserve:http_requests_total", endpoint="other", status_code="404") == 1
    assert not any("no/such" in labels["endpoint"] for labels, _ in after["fdserve:http_requests_total"])
    # A rejected request never reached the engine: no finished request, no tokens.
    assert delta(before, after, "fdserve:request_finished_total") == 0
    assert delta(before, after, "fdserve:prompt_tokens_total") == 0


def engine_pid(server: ServerProcess) -> int:
    """The engine: the child of launch.py started by multiprocessing's spawn."""
    for pid in server.descendants():
        try:
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except FileNotFoundError:
            continue
        if ppid == server.proc.pid and b"spawn_main" in cmdline:
            return pid
    raise RuntimeError(f"no engine process under launch.py pid {server.proc.pid}")


def test_a_frozen_engine_does_not_hang_the_scrape(server: ServerProcess, client: httpx.Client) -> None:
    post(client, COMPLETIONS, {"prompt": REFERENCE[2]["prompt_ids"], "max_tokens": 2, "temperature": 0})
    before = scrape(client)
    pid = engine_pid(server)
    os.kill(pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        during = scrape(client)
        elapsed = time.monotonic() - started
    finally:
        os.kill(pid, signal.SIGCONT)
    # Without the timeout the scrape would wait for the engine as long as it is stopped.
    assert elapsed < ENGINE_TIMEOUT_S + 5.0, f"/metrics took {elapsed:.1f} s with the engine stopped"
    assert delta(before, during, "fdserve:engine_query_failures_total") == 1
    # The last values received are served: counters never drop back to 0.
    for tier in ("device", "host", "storage"):
        assert delta(before, during, "fdserve:prefix_cache_hit_tokens_total", tier=tier) == 0
    assert value(during, "fdserve:kv_blocks_total") == value(before, "fdserve:kv_blocks_total")
    # Once the engine runs again, queries succeed again and requests are served.
    post(client, COMPLETIONS, {"prompt": REFERENCE[2]["prompt_ids"], "max_tokens": 2, "temperature": 0})
    after = scrape(client)
    assert delta(during, after, "fdserve:engine_query_failures_total") == 0


def test_endpoint_labels_name_every_route_and_bound_the_rest():
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/tokenizer_info"):
        assert endpoint_label(path) == path
    assert endpoint_label("/v1/models/some-model") == "/v1/models/{model}"
    assert {endpoint_label(f"/probe/{i}") for i in range(100)} == {"other"}
