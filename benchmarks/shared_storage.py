#!/usr/bin/env python3
"""Time to first token on a second instance that finds a prompt in the shared storage tier, against cold.

Starts two servers (A and B) on free ports sharing one storage tier: a file directory (``--backend file``,
the default) or one Mooncake master started here (``--backend mooncake``). For each of ``--prompts`` distinct
long prompts (about ``--prompt-tokens`` tokens, no shared prefix between them): A serves it cold (no tier
holds it), its write-through copies land, then B serves it: B's engine looks the blocks up in the store,
prefetches them and computes only the last partial block. Reported: TTFT of a streaming request (first
content chunk) cold on A and from storage on B, minimum and median, with B's cached tokens, and B's storage
lookup latency from its cache stats.

    python benchmarks/shared_storage.py --out /tmp/shared_storage.json

Keeps under two minutes on 2 cores.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Iterator

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.model_setup import write_report  # noqa: E402
from harness.server import REPO_ROOT, ServerProcess, free_port  # noqa: E402

logger = logging.getLogger(__name__)

SENTENCES = [
    "The history of the Roman Empire spans many centuries, from the founding of the city to the fall of the west. ",
    "Photosynthesis is the process plants use to turn sunlight, water and carbon dioxide into sugar and oxygen. ",
    "The Pacific Ocean is the largest and deepest of the world's oceans, covering about a third of the surface. ",
    "A computer program is a sequence of instructions that a machine follows to carry out a particular task. ",
    "Volcanoes form where molten rock from deep inside the Earth reaches the surface through cracks in the crust. ",
    "Railways spread across the continent and changed how goods, people and news travelled between the towns. ",
]
SERVER_ARGS = ("--block-size", "16", "--max-model-len", "2048", "--max-num-seqs", "4")


def prompt_text(index: int, tokens: int) -> str:
    # About 22 tokens per sentence; a distinct opening keeps prompts from sharing a first block.
    sentence = SENTENCES[index % len(SENTENCES)]
    return f"Document {index}. " + sentence * max(1, tokens // 22) + "Summarise it."


def ttft(base_url: str, prompt: str) -> tuple[float, int]:
    """(seconds to the first content chunk, cached prompt tokens) of a greedy streaming completion."""
    started = time.perf_counter()
    first = None
    cached = -1
    with httpx.stream("POST", base_url + "/v1/completions", timeout=300, json={
            "prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if first is None and '"text"' in line:
                first = time.perf_counter() - started
            if '"usage"' in line and '"cached_tokens"' in line:
                cached = int(line.split('"cached_tokens":', 1)[1].split("}", 1)[0].split(",", 1)[0])
    if first is None:
        raise RuntimeError("the stream ended without a token")
    return first, cached


def wait_stored(base_url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = httpx.get(base_url + "/v1/cache/stats", timeout=30).json()
        if stats["transfers_in_flight"] == 0:
            return
        time.sleep(0.1)
    raise RuntimeError("write-through copies did not land")


@contextlib.contextmanager
def shared_store(backend: str, directory: str) -> Iterator[tuple[list[str], dict[str, str]]]:
    """Server arguments and environment of the shared tier."""
    if backend == "file":
        yield ["--kvcache-storage-backend", "file", "--file-backend-storage-dir", directory], {}
        return
    port = free_port()
    env = {**os.environ, "MOONCAKE_MASTER_METRICS_PORT": str(free_port()),
           "MOONCAKE_MASTER_LOG": os.path.join(directory, "mooncake_master.log")}
    started = subprocess.run(["bash", str(REPO_ROOT / "scripts" / "start_mooncake_master.sh"), str(port)],
                             env=env, capture_output=True, text=True, check=True)
    pid = int(started.stdout.split()[-1])
    try:
        yield ["--kvcache-storage-backend", "mooncake"], {
            "MOONCAKE_MASTER_SERVER_ADDR": f"127.0.0.1:{port}", "MOONCAKE_GLOBAL_SEGMENT_SIZE": str(256 << 20)}
    finally:
        os.kill(pid, signal.SIGTERM)  # the master this benchmark started, by its pid


def run(backend: str, prompts: int, prompt_tokens: int) -> dict[str, Any]:
    cold: list[float] = []
    warm: list[float] = []
    cached: list[int] = []
    with tempfile.TemporaryDirectory(prefix="fdserve-shared-") as directory, \
            shared_store(backend, directory) as (args, env):
        with ServerProcess(*SERVER_ARGS, *args, env=env, die_with_parent=True) as a, \
                ServerProcess(*SERVER_ARGS, *args, env=env, die_with_parent=True) as b:
            ttft(a.base_url, prompt_text(999, 64))  # warm-up of both servers' code paths
            ttft(b.base_url, prompt_text(998, 64))
            for index in range(prompts):
                text = prompt_text(index, prompt_tokens)
                seconds, hit = ttft(a.base_url, text)
                if hit != 0:
                    raise RuntimeError(f"prompt {index} was not cold on A ({hit} cached tokens)")
                cold.append(seconds)
                wait_stored(a.base_url)
                seconds, hit = ttft(b.base_url, text)
                warm.append(seconds)
                cached.append(hit)
            stats = httpx.get(b.base_url + "/v1/cache/stats", timeout=30).json()
    return {
        "backend": backend,
        "prompts": prompts,
        "prompt_tokens_approx": prompt_tokens,
        "cold_ttft_s_on_a": {"min": round(min(cold), 4), "median": round(statistics.median(cold), 4)},
        "storage_hit_ttft_s_on_b": {"min": round(min(warm), 4), "median": round(statistics.median(warm), 4)},
        "b_cached_tokens": cached,
        "speedup_median": round(statistics.median(cold) / statistics.median(warm), 2),
        "b_storage_lookups": stats["storage_lookups"],
        "b_storage_lookup_ms_mean": round(1e3 * stats["storage_lookup_seconds"] / max(1, stats["storage_lookups"]), 3),
        "b_storage_lookup_timeouts": stats["storage_lookup_timeouts"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--backend", choices=("file", "mooncake"), default="file")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    write_report(run(args.backend, args.prompts, args.prompt_tokens), args.out)


if __name__ == "__main__":
    main()
