"""Multi-turn chat traffic against the real server with a small KV pool and a small step budget.

Concurrent conversations resend their whole history every turn, so from turn two on every
prompt starts with cached blocks while other conversations hold the rest of the tiny pool: the
traffic that once killed the engine in ``_schedule_waiting`` (BlockAllocationError). Each
variant runs ``benchmarks/multiturn.py`` against one real server and requires: no request
error, a healthy server afterwards with no KV block held, prefix-cache hits on every turn after
the first, and completion tokens equal to those of a server with prefix caching off fed the
same histories.
"""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from benchmarks import multiturn
from harness.server import ServerProcess

pytestmark = pytest.mark.integration

CONVERSATIONS, TURNS = 4, 3
# 16 blocks of 16 tokens: a third-turn prompt (~150 tokens) takes ~10 of them, so four
# conversations cannot all fit and their cached prefixes are evicted and re-admitted.
SMALL = ("--block-size", "16", "--num-gpu-blocks-override", "16", "--max-num-batched-tokens", "64")
SWAP = ("--swap-space", "0.004")  # ~5 host blocks of 16 tokens: swaps out and evicts from the host tier
IDLE_TIMEOUT_S = 15.0


def run_benchmark(base_url: str, reference_url: str, known: dict) -> dict:
    config = multiturn.Config(
        base_url=base_url, model="", conversations=CONVERSATIONS, turns=TURNS, max_tokens=8,
        system_prompt_len=40, user_len=12, seed=3, request_timeout=60.0, total_timeout=150.0,
        check_against=reference_url,
    )
    report, _ = asyncio.run(multiturn.benchmark(config, known=known))
    return report


def wait_idle(server: ServerProcess) -> tuple[dict, dict]:
    """(/health, /v1/cache/stats) once nothing runs or holds a block, or the last ones after the timeout."""
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while True:
        try:
            health = httpx.get(server.base_url + "/health", timeout=10).json()
            stats = httpx.get(server.base_url + "/v1/cache/stats", timeout=30).json()
        except httpx.TransportError as exc:  # the server is gone: the assertions report it with its log
            return {"status": f"unreachable: {exc!r} (exit code {server.proc.poll()})"}, {}
        sched = health.get("scheduler") or {}
        idle = (sched.get("num_running") == 0 and sched.get("num_waiting") == 0 and sched.get("kv_blocks_used") == 0
                and stats.get("transfers_in_flight") == 0)
        if idle or time.monotonic() > deadline:
            return health, stats
        time.sleep(0.2)


@pytest.fixture(scope="module")
def reference():
    """The same small pool with prefix caching off: the greedy outputs every variant must reproduce."""
    with ServerProcess(*SMALL, "--no-enable-prefix-caching") as server:
        # Its replies by history: variants that agree with it send the same histories, asked once.
        yield server, {}


@pytest.mark.parametrize("variant,args,env", [
    ("lock_off", SMALL, {"FD_USE_KVCACHE_LOCK": "0"}),
    ("lock_on_file_swap", (*SMALL, *SWAP, "--kvcache-storage-backend", "file"), {"FD_USE_KVCACHE_LOCK": "1"}),
    ("dp2", (*SMALL, "--data-parallel-size", "2"), {"FD_USE_KVCACHE_LOCK": "0"}),
])
def test_multiturn_small_pool(reference, tmp_path, variant, args, env):
    if "--kvcache-storage-backend" in args:
        args = (*args, "--file-backend-storage-dir", str(tmp_path / "kv"))
    with ServerProcess(*args, env=env) as server:
        reference_server, known = reference
        report = run_benchmark(server.base_url, reference_server.base_url, known)
        health, stats = wait_idle(server)
        log = server.log_tail(150)

    context = f"{variant}: {report}\nserver log:\n{log}"
    assert report["error_count"] == 0 and report["not_sent"] == 0 and not report["timed_out"], context
    assert report["completed"] == CONVERSATIONS * TURNS, context
    assert health["status"] == "ok", f"{variant}: {health}\n{log}"
    sched = health["scheduler"]
    assert (sched["num_running"], sched["num_waiting"], sched["kv_blocks_used"]) == (0, 0, 0), f"{variant}: {health}"
    assert stats["kv_blocks_free"] + stats["kv_blocks_cached"] == sched["kv_blocks_total"], f"{variant}: {stats}"
    for turn in report["turns"][1:]:
        assert turn["cached_tokens"] > 0, f"{variant}: no prefix-cache hit on turn {turn['turn']}: {report['turns']}"
    check = report["check"]
    assert check["error_count"] == 0 and not check["timed_out"], f"{variant}: reference failed: {check}"
    assert check["compared"] == CONVERSATIONS * TURNS, check
    assert check["mismatches"] == 0, f"{variant}: outputs differ from prefix caching off: {check['mismatch_details']}"
    if variant == "lock_on_file_swap":
        assert stats["swap_out_blocks"] > 0, stats
        assert stats["write_back_blocks"] > 0, stats
        assert stats["transfer_timeouts"] == 0, stats
        assert stats["kvcache_lock"]["enabled"] and not stats["kvcache_lock"]["held"], stats
