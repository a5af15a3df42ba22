"""Micro-benchmark of the native CPU kernels against the Paddle path they replace.

This script owns the per-kernel timing table of issue 15. For each case it times one attention
call of a SmolLM2-135M layer shape (9 heads, 3 KV heads, head_dim 64, block_size 64) over a paged
cache with scattered blocks, native kernel vs ``worker.attention``'s Paddle path, alternating the
two variants call by call (so load on the shared machine hits both alike), and reports medians
and the speed-up. The step's K/V write into the cache is timed in both (it is common to both).

    python benchmarks/kernels.py [--repeats 15] [--threads 2] [--only decode] [--out kernels.json]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Callable

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

import envs  # noqa: E402
from model_setup import write_report  # noqa: E402

# (name, query_lens, context_lens): decode batches, whole prompts, a chunk after a cached prefix.
CASES: list[tuple[str, list[int], list[int]]] = [
    ("decode b32 ctx128", [1] * 32, [128] * 32),
    ("decode b32 ctx1024", [1] * 32, [1024] * 32),
    ("decode b8 ctx4096", [1] * 8, [4096] * 8),
    ("decode b1 ctx2048", [1], [2048]),
    ("prefill 512", [512], [512]),
    ("prefill 2048", [2048], [2048]),
    ("prefill 4096", [4096], [4096]),
    ("prefill chunk 512 after 3584", [512], [4096]),
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15, help="timed calls per variant and case")
    parser.add_argument("--threads", type=int, default=0, help="compute threads (0: FD_NUM_THREADS or all cores)")
    parser.add_argument("--only", default="", help="run only cases whose name contains this")
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--out", default=None, help="also write the JSON result to this file")
    return parser.parse_args(argv)


def _median_ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e3, 3)


def time_alternating(variants: dict[str, Callable[[], Any]], repeats: int) -> dict[str, list[float]]:
    """Seconds per call for each variant, interleaved call by call, after one untimed warm-up call each."""
    for run in variants.values():
        run()
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, run in variants.items():
            started = time.perf_counter()
            run()
            samples[name].append(time.perf_counter() - started)
    return samples


def bench_case(args: argparse.Namespace, name: str, query_lens: list[int], context_lens: list[int]) -> dict[str, Any]:
    import numpy as np
    import paddle

    from worker import attention

    rng = np.random.default_rng(0)
    block_size, kv_heads, head_dim = args.block_size, args.kv_heads, args.head_dim
    used = [-(-c // block_size) for c in context_lens]
    pool = rng.permutation(sum(used) + 1)
    tables, offset = [], 0
    for count in used:
        tables.append(pool[offset: offset + count].tolist())
        offset += count
    shape = (len(pool), kv_heads, block_size, head_dim)
    k_cache = paddle.to_tensor(rng.standard_normal(shape).astype(np.float32))
    v_cache = paddle.to_tensor(rng.standard_normal(shape).astype(np.float32))
    tokens = sum(query_lens)
    q = paddle.to_tensor(rng.standard_normal((tokens, args.heads, head_dim)).astype(np.float32))
    k = paddle.to_tensor(rng.standard_normal((tokens, kv_heads, head_dim)).astype(np.float32))
    v = paddle.to_tensor(rng.standard_normal((tokens, kv_heads, head_dim)).astype(np.float32))
    meta = attention.build_attention_metadata(query_lens, context_lens, tables, block_size)
    scale = head_dim ** -0.5

    def run(native: bool) -> Callable[[], Any]:
        return lambda: attention.paged_attention(q, k, v, k_cache, v_cache, meta, scale, native=native)

    repeats = args.repeats if tokens < 2048 else max(3, args.repeats // 3)
    samples = time_alternating({"native": run(True), "paddle": run(False)}, repeats)
    native_ms, paddle_ms = _median_ms(samples["native"]), _median_ms(samples["paddle"])
    return {"case": name, "native_ms": native_ms, "paddle_ms": paddle_ms,
            "speedup": round(paddle_ms / native_ms, 2) if native_ms else None, "repeats": repeats}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    threads = args.threads or envs.FD_NUM_THREADS or envs.available_cores()
    envs.apply_compute_thread_env(threads)
    import paddle

    from worker.kernels import build, paged_attention

    if paged_attention.load() is None:
        raise SystemExit(f"native paged attention unavailable: {build.last_build('fd_paged_attention_ext')}")
    results = []
    with paddle.no_grad():
        for name, query_lens, context_lens in CASES:
            if args.only and args.only not in name:
                continue
            row = bench_case(args, name, query_lens, context_lens)
            print(f"{row['case']:<32} native {row['native_ms']:>9.3f} ms  paddle {row['paddle_ms']:>9.3f} ms  "
                  f"x{row['speedup']}", file=sys.stderr)
            results.append(row)
    report = {"kernel": "fd_paged_attention (one layer: K/V write + attention)", "threads": threads,
              "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
              "block_size": args.block_size, "paddle_version": paddle.__version__, "results": results}
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
