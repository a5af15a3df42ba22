"""KV-cache tiers under pressure against the real server: outputs must not change.

A tiny device pool forces eviction and preemption, a tiny host pool pushes
blocks through to storage, and a cache reset between rounds makes round two
reload prefixes from storage. Every configuration (file / mooncake backend,
FD_USE_KVCACHE_LOCK off / on) must give exactly the completion tokens of the
same requests with prefix caching off.
"""
from __future__ import annotations

import concurrent.futures
import math

import httpx
import pytest

from harness.server import ServerProcess

pytestmark = pytest.mark.integration

BLOCK = "--block-size", "16"
PRESSURE = (*BLOCK, "--num-gpu-blocks-override", "48", "--max-model-len", "512", "--max-num-seqs", "6",
            "--swap-space", "0.008")  # ~11 host blocks of 16 tokens

TOPICS = [
    "The history of the Roman Empire spans many centuries, from the founding of the city to the fall of the west. ",
    "Photosynthesis is the process plants use to turn sunlight, water and carbon dioxide into sugar and oxygen. ",
    "The Pacific Ocean is the largest and deepest of the world's oceans, covering about a third of the surface. ",
    "A computer program is a sequence of instructions that a machine follows to carry out a particular task. ",
    "Volcanoes form where molten rock from deep inside the Earth reaches the surface through cracks in the crust. ",
]
QUESTIONS = ["Summarise this.", "Give one fact.", "Why does it matter?", "Explain it to a child.",
             "What is a common misconception?", "Name a related topic.", "Write a title.",
             "What happens next?", "List two keywords.", "Ask a question about it."]


def build_requests(base_url: str) -> list[list[int]]:
    """50 chat prompts: 5 long shared prefixes x 10 questions, as token ids through the server's template."""
    prompts = []
    for topic in TOPICS:
        context = topic * 6  # a long shared prefix (several 16-token blocks)
        for question in QUESTIONS:
            resp = httpx.post(base_url + "/v1/chat/completions", json={
                "messages": [{"role": "system", "content": context}, {"role": "user", "content": question}],
                "max_tokens": 1, "temperature": 0, "return_token_ids": True}, timeout=120)
            resp.raise_for_status()
            prompts.append(resp.json()["choices"][0]["prompt_token_ids"])
    return prompts


def complete_all(base_url: str, prompts: list[list[int]], concurrency: int = 4) -> list[tuple[list[int], int]]:
    def one(prompt: list[int]) -> tuple[list[int], int]:
        resp = httpx.post(base_url + "/v1/completions", json={
            "prompt": prompt, "max_tokens": 8, "temperature": 0, "return_token_ids": True}, timeout=300)
        resp.raise_for_status()
        body = resp.json()
        return body["choices"][0]["completion_token_ids"], body["usage"]["prompt_tokens_details"]["cached_tokens"]

    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, prompts))


@pytest.fixture(scope="module")
def baseline():
    """The requests and their outputs with prefix caching off (same tiny pool)."""
    with ServerProcess(*PRESSURE[:-2], "--no-enable-prefix-caching") as server:
        prompts = build_requests(server.base_url)
        results = complete_all(server.base_url, prompts)
    assert all(cached == 0 for _, cached in results)
    return prompts, [tokens for tokens, _ in results]


def run_two_rounds(server: ServerProcess, prompts: list[list[int]]) -> tuple[list, list, dict]:
    first = complete_all(server.base_url, prompts)
    reset = httpx.post(server.base_url + "/v1/cache/reset", timeout=30).json()
    assert reset["dropped_blocks"] >= 0
    second = complete_all(server.base_url, prompts)
    stats = httpx.get(server.base_url + "/v1/cache/stats", timeout=30).json()
    return first, second, stats


def check_against_baseline(baseline, first, second, stats) -> None:
    _, expected = baseline
    assert [t for t, _ in first] == expected
    assert [t for t, _ in second] == expected
    assert sum(1 for _, cached in first if cached > 0) >= 40  # shared prefixes hit after the first of each topic
    assert all(cached > 0 for _, cached in second)  # round two: everything comes back from a lower tier
    assert stats["storage_hit_tokens"] > 0, stats
    assert stats["swap_out_blocks"] > 0, stats
    assert stats["transfer_timeouts"] == 0


@pytest.mark.parametrize("lock", ["0", "1"])
def test_file_backend_outputs_identical_to_no_cache(baseline, tmp_path, lock):
    prompts, _ = baseline
    with ServerProcess(*PRESSURE, "--kvcache-storage-backend", "file", "--file-backend-storage-dir",
                       str(tmp_path / "kv"), env={"FD_USE_KVCACHE_LOCK": lock}) as server:
        first, second, stats = run_two_rounds(server, prompts)
        health = httpx.get(server.base_url + "/health").json()
    check_against_baseline(baseline, first, second, stats)
    assert health["scheduler"]["num_running"] == 0


def test_mooncake_backend_outputs_identical_to_no_cache(baseline):
    pytest.importorskip("mooncake.store", reason="mooncake-transfer-engine-non-cuda is not installed")
    from tests.mooncake_utils import mooncake_master

    prompts, _ = baseline
    with mooncake_master() as master:
        with ServerProcess(*PRESSURE, "--kvcache-storage-backend", "mooncake",
                           env={"MOONCAKE_MASTER_SERVER_ADDR": master.address, "FD_USE_KVCACHE_LOCK": "1"}) as server:
            first, second, stats = run_two_rounds(server, prompts)
    check_against_baseline(baseline, first, second, stats)


def test_round_two_cached_tokens_are_whole_blocks(baseline, tmp_path):
    prompts, _ = baseline
    with ServerProcess(*PRESSURE, "--kvcache-storage-backend", "file", "--file-backend-storage-dir",
                       str(tmp_path / "kv")) as server:
        _, second, _ = run_two_rounds(server, prompts[:10])
    for prompt, (_, cached) in zip(prompts[:10], second):
        assert cached % 16 == 0 and 0 < cached <= math.floor((len(prompt) - 1) / 16) * 16
