"""DP=2 + expert parallelism on a tiny MoE against the real server.

Equivalence: greedy outputs equal the single-replica, no-EP server's, token for
token. Regression test for the race seen in the system we follow (NaN under
DP+EP with a storage cache): DP=2 + EP + file storage + a tiny device pool that
forces swap, write-back and prefetch, with FD_USE_KVCACHE_LOCK on and off.
"""
from __future__ import annotations

import concurrent.futures
import random

import httpx
import pytest

from scripts.make_tiny_moe import make_tiny_moe
from harness.server import ServerProcess

pytestmark = pytest.mark.integration

PRESSURE = ("--block-size", "16", "--num-gpu-blocks-override", "16", "--max-model-len", "256",
            "--max-num-seqs", "8", "--swap-space", "0.001")


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> str:
    return make_tiny_moe(str(tmp_path_factory.mktemp("tiny_moe")), seed=0)


def make_prompts(count: int = 24) -> list[list[int]]:
    """Seeded prompts: groups sharing long prefixes (so the cache tiers get work) with varied tails."""
    rng = random.Random(7)
    prefixes = [[rng.randrange(1000, 40000) for _ in range(48)] for _ in range(4)]
    return [prefixes[i % 4] + [rng.randrange(1000, 40000) for _ in range(rng.randrange(3, 20))] for i in range(count)]


def complete_all(server: ServerProcess, prompts: list[list[int]]) -> list[list[int]]:
    def one(prompt: list[int]) -> list[int]:
        resp = httpx.post(server.base_url + "/v1/completions", timeout=300, json={
            "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_token_ids": True})
        assert resp.status_code == 200, resp.text
        return resp.json()["choices"][0]["completion_token_ids"]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, prompts))


@pytest.fixture(scope="module")
def baseline(tiny_moe):
    prompts = make_prompts()
    with ServerProcess("--model", tiny_moe, "--no-enable-prefix-caching", *PRESSURE[:2]) as server:
        return prompts, complete_all(server, prompts)


def test_dp2_with_expert_parallel_equals_single_replica(tiny_moe, baseline):
    prompts, expected = baseline
    with ServerProcess("--model", tiny_moe, "--data-parallel-size", "2", "--enable-expert-parallel") as server:
        got = complete_all(server, prompts)
        steps = [rank["scheduler"]["num_steps"] for rank in httpx.get(server.base_url + "/health").json()["ranks"]]
    assert got == expected
    assert all(s > 0 for s in steps)


@pytest.mark.parametrize("lock", ["0", "1"])
def test_dp_ep_with_storage_cache_under_pressure_matches_no_cache(tiny_moe, baseline, tmp_path, lock):
    prompts, expected = baseline
    with ServerProcess("--model", tiny_moe, "--data-parallel-size", "2", "--enable-expert-parallel", *PRESSURE,
                       "--kvcache-storage-backend", "file", "--file-backend-storage-dir", str(tmp_path),
                       env={"FD_USE_KVCACHE_LOCK": lock}) as server:
        first = complete_all(server, prompts)
        httpx.post(server.base_url + "/v1/cache/reset", timeout=30)
        second = complete_all(server, prompts)
        stats = httpx.get(server.base_url + "/v1/cache/stats", timeout=30).json()
    assert first == expected and second == expected
    assert stats["storage_hit_tokens"] > 0 and stats["swap_out_blocks"] > 0, stats


def test_two_nodes_as_separate_launches_form_one_ep_group(tiny_moe, baseline):
    """The multi-node shape on one host: each "node" is its own launch.py hosting one DP rank."""
    from harness.server import free_port

    prompts, expected = baseline
    master_port = str(free_port())
    common = ("--model", tiny_moe, "--data-parallel-size", "2", "--enable-expert-parallel", "--nnodes", "2",
              "--master-addr", "127.0.0.1", "--master-port", master_port)
    nodes = [ServerProcess(*common, "--node-rank", str(rank)) for rank in range(2)]
    try:
        for node in nodes:
            node.launch()  # both must be up before either can finish start-up (they meet in the EP group)
        for node in nodes:
            node.wait_healthy()
        half = len(prompts) // 2
        got = complete_all(nodes[0], prompts[:half]) + complete_all(nodes[1], prompts[half:])
    finally:
        for node in nodes:
            node.stop()
            node.kill_group()
    assert got == expected


def test_run_dp_ep_script_serves_the_moe(tiny_moe, baseline, tmp_path):
    import os
    import signal
    import subprocess

    from harness.server import REPO_ROOT, free_port

    prompts, expected = baseline
    server = ServerProcess()  # only for its port, instance id and health polling
    server.port = free_port()
    server.base_url = f"http://127.0.0.1:{server.port}"
    env = {**server.env, "MODEL": tiny_moe, "DP": "2", "PORT": str(server.port), "FD_USE_KVCACHE_LOCK": "1",
           "STORAGE_DIR": str(tmp_path)}
    with open(server.log_path, "wb") as log:
        server.proc = subprocess.Popen(["bash", str(REPO_ROOT / "scripts" / "run_dp_ep.sh")], cwd=REPO_ROOT, env=env,
                                       stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        server.wait_healthy()
        health = httpx.get(server.base_url + "/health").json()
        assert health["data_parallel_size"] == 2
        assert complete_all(server, prompts[:6]) == expected[:6]
        stats = httpx.get(server.base_url + "/v1/cache/stats", timeout=30).json()
        assert all("kvcache_lock" in rank for rank in stats["ranks"])  # the script passed the lock setting on
    finally:
        server.stop()
        if server.proc.poll() is None:
            os.killpg(server.proc.pid, signal.SIGKILL)
