"""The race the KV-cache lock was added for, reproduced on purpose.

Test-only faults: the scheduler runs a request as soon as its prefetch from
storage has *started* (FD_KVCACHE_FAULT_EARLY_SCHEDULE) and the transfer process
dawdles before copying (FD_KVCACHE_FAULT_SLOW_FILL_S). Without the lock,
execute_model reads blocks that are still being loaded: the sanitizer must flag
it by block id. With the lock, execute_model waits for the copy and the output
stays correct.
"""
from __future__ import annotations

import time

import httpx
import pytest

from tests.server_utils import ServerProcess, expected_prefix, load_reference

pytestmark = pytest.mark.integration

ENTRY = load_reference()[2]  # 44 prompt tokens: two full 16-token blocks to reload
FAULT = {"FD_KVCACHE_FAULT_EARLY_SCHEDULE": "1", "FD_KVCACHE_FAULT_SLOW_FILL_S": "0.5"}


def complete(server: ServerProcess) -> httpx.Response:
    return httpx.post(server.base_url + "/v1/completions", timeout=120, json={
        "prompt": ENTRY["prompt_ids"], "max_tokens": 16, "temperature": 0, "return_token_ids": True})


def reload_from_storage(server: ServerProcess) -> httpx.Response:
    """Compute the prompt once (written through to storage), drop device/host tiers, ask again."""
    first = complete(server)
    assert first.status_code == 200, first.text
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stats = httpx.get(server.base_url + "/v1/cache/stats", timeout=10).json()
        if stats["storage_blocks_known"] >= 2 and stats["transfers_in_flight"] == 0:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"prompt blocks never reached storage: {stats}")
    httpx.post(server.base_url + "/v1/cache/reset", timeout=10)
    return complete(server)


def server_args(tmp_path) -> tuple[str, ...]:
    return ("--block-size", "16", "--kvcache-storage-backend", "file", "--file-backend-storage-dir", str(tmp_path))


def test_sanitizer_flags_a_request_scheduled_before_its_prefetch_finished(tmp_path):
    env = {**FAULT, "FD_KVCACHE_SANITIZER": "1", "FD_USE_KVCACHE_LOCK": "0"}
    with ServerProcess(*server_args(tmp_path), env=env) as server:
        second = reload_from_storage(server)
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
        second = reload_from_storage(server)
    assert second.status_code == 200, second.text
    choice = second.json()["choices"][0]
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    ours, ref = expected_prefix(ENTRY, choice["completion_token_ids"])
    assert ours == ref[:16]
