"""--data-parallel-size 2 against the real server: both replicas serve, outputs stay exact."""
from __future__ import annotations

import concurrent.futures

import httpx
import pytest

from harness.server import ServerProcess
from harness.reference import expected_prefix, load_reference

pytestmark = pytest.mark.integration

REFERENCE = load_reference()


def greedy(base_url: str, entry: dict) -> dict:
    resp = httpx.post(base_url + "/v1/completions", timeout=300, json={
        "prompt": entry["prompt_ids"], "max_tokens": len(entry["output_ids"]), "temperature": 0,
        "return_token_ids": True})
    resp.raise_for_status()
    return resp.json()


def test_dense_model_at_dp2_matches_reference_and_uses_both_ranks():
    with ServerProcess("--data-parallel-size", "2", "--block-size", "16") as server:
        health = httpx.get(server.base_url + "/health").json()
        assert health["data_parallel_size"] == 2 and len(health["ranks"]) == 2
        pids = {w["pid"] for w in health["workers"]}
        assert len(pids) == 2  # one worker process per rank
        with concurrent.futures.ThreadPoolExecutor(len(REFERENCE)) as pool:
            results = list(pool.map(lambda e: greedy(server.base_url, e), REFERENCE))
        for entry, result in zip(REFERENCE, results):
            ours, ref = expected_prefix(entry, result["choices"][0]["completion_token_ids"])
            assert ours == ref
        steps = [rank["scheduler"]["num_steps"] for rank in httpx.get(server.base_url + "/health").json()["ranks"]]
        assert all(s > 0 for s in steps), f"a rank got no work: {steps}"
        # Prefix affinity: the same prompt again goes to the rank whose cache holds it.
        again = greedy(server.base_url, REFERENCE[2])
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert server.leftovers == [], "the server left shared-memory names for close() to sweep"
