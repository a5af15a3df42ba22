"""The race the KV-cache lock was added for, reproduced on purpose.

Test-only faults: the scheduler runs a request as soon as its prefetch from
storage has *started* (FD_KVCACHE_FAULT_EARLY_SCHEDULE) and the transfer process
dawdles before copying each chunk (FD_KVCACHE_FAULT_SLOW_FILL_S). The prompt is
cut into more blocks than one staging chunk holds, so the prefetch runs in two
chunks and the race covers both. Without the lock, execute_model reads blocks
that are still being loaded: the sanitizer must flag it by block id. With the
lock, execute_model waits (the lock's wait counters show it) for the whole fill
and the output stays correct.
"""
from __future__ import annotations

import time

import httpx
import pytest

from cache_manager.cache_transfer_manager import STAGING_BLOCKS
from harness.server import ServerProcess
from harness.reference import expected_prefix, load_reference

pytestmark = pytest.mark.integration

ENTRY = load_reference()[2]  # 44 prompt tokens
BLOCK_SIZE = 2
PROMPT_BLOCKS = len(ENTRY["prompt_ids"]) // BLOCK_SIZE  # 22 full blocks: a prefetch of two chunks
SLOW_FILL_S = 0.5
FAULT = {"FD_KVCACHE_FAULT_EARLY_SCHEDULE": "1", "FD_KVCACHE_FAULT_SLOW_FILL_S": str(SLOW_FILL_S)}


def complete(server: ServerProcess) -> httpx.Response:
    return httpx.post(server.base_url + "/v1/completions", timeout=120, json={
        "prompt": ENTRY["prompt_ids"], "max_tokens": 16, "temperature": 0, "return_token_ids": True})


def cache_stats(server: ServerProcess) -> dict:
    return httpx.get(server.base_url + "/v1/cache/stats", timeout=10).json()


def reload_from_storage(server: ServerProcess) -> tuple[httpx.Response, dict, dict]:
    """Compute the prompt once (written through to storage), drop device/host tiers, ask again.

    Returns the second response and the cache stats just before and after it.
    """
    assert PROMPT_BLOCKS > STAGING_BLOCKS, "the prompt must need more than one prefetch chunk"
    first = complete(server)
    assert first.status_code == 200, first.text
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stats = cache_stats(server)
        if stats["storage_blocks_known"] >= PROMPT_BLOCKS and stats["transfers_in_flight"] == 0:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"prompt blocks never reached storage: {stats}")
    httpx.post(server.base_url + "/v1/cache/reset", timeout=10)
    before = cache_stats(server)
    second = complete(server)
    return second, before, cache_stats(server)


def server_args(tmp_path) -> tuple[str, ...]:
    return ("--block-size", str(BLOCK_SIZE), "--kvcache-storage-backend", "file",
            "--file-backend-storage-dir", str(tmp_path))


def test_sanitizer_flags_a_request_scheduled_before_its_prefetch_finished(tmp_path):
    env = {**FAULT, "FD_KVCACHE_SANITIZER": "1", "FD_USE_KVCACHE_LOCK": "0"}
    with ServerProcess(*server_args(tmp_path), env=env) as server:
        second, _, _ = reload_from_storage(server)
        assert second.status_code == 500
        message = second.json()["error"]["message"]
        assert "sanitizer" in message and "block" in message and "LOAD" in message, message
        assert "KV sanitizer" in server.log_tail(200)
        # The server keeps serving: a request with nothing to reload (no shared first block) runs normally.
        again = httpx.post(server.base_url + "/v1/completions", timeout=120, json={
            "prompt": list(range(1000, 1040)), "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 8


def test_with_the_lock_the_early_schedule_still_gives_correct_output(tmp_path):
    env = {**FAULT, "FD_USE_KVCACHE_LOCK": "1"}
    with ServerProcess(*server_args(tmp_path), env=env) as server:
        second, before, after = reload_from_storage(server)
    assert second.status_code == 200, second.text
    choice = second.json()["choices"][0]
    cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > STAGING_BLOCKS * BLOCK_SIZE, f"only {cached} tokens reloaded: the prefetch was one chunk"
    ours, ref = expected_prefix(ENTRY, choice["completion_token_ids"])
    assert ours == ref[:16]
    # The fault really ran and the lock closed it: execute_model had to wait for the fill,
    # which sleeps SLOW_FILL_S before each of its two chunks under one hold.
    lock_before, lock_after = before["kvcache_lock"], after["kvcache_lock"]
    assert lock_after["contended"] > lock_before["contended"], (lock_before, lock_after)
    assert lock_after["wait_ns_total"] - lock_before["wait_ns_total"] >= SLOW_FILL_S * 1e9, (lock_before, lock_after)
    assert lock_after["recoveries"] == 0
