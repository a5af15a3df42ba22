#!/usr/bin/env python3
"""Tensor-parallel all-reduce benchmark: shared memory (``ShmAllReduce``) against gloo (``GlooAllReduce``).

Owns the measurement of ``inter_communicator.allreduce``: per-call latency (median and p90 over
``--calls`` calls after a warm-up, measured on rank 0; every call is a barrier, so it is the group's
latency) at ``--ranks`` spawned processes, for the sizes of a decode step (1 x hidden floats) and
of a prefill chunk (``--chunk-tokens`` x hidden), plus the per-step all-reduce cost this implies
for a ``--layers``-layer model (two all-reduces per layer: after o_proj and after down).

    python benchmarks/tp_allreduce.py --out benchmarks/results/tp_allreduce.json

Prints JSON to stdout and writes it to ``--out`` if given.
"""
from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import queue
import statistics
import sys
import time
import uuid
from typing import Any

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

import numpy as np  # noqa: E402

from harness.server import free_port  # noqa: E402
from inter_communicator.allreduce import GlooAllReduce, ShmAllReduce, ShmAllReduceGroup  # noqa: E402

logger = logging.getLogger(__name__)

WARMUP_CALLS = 20
RESULT_TIMEOUT_S = 300.0


def _time_calls(reduce, sizes: dict[str, int], calls: dict[str, int], rank: int,
                world: int) -> dict[str, list[float]]:
    """Per-call seconds per size label; rank r contributes r + 1 everywhere, so the sum is N(N+1)/2."""
    timings: dict[str, list[float]] = {}
    for label, size in sizes.items():
        x = np.full(size, rank + 1, dtype=np.float32)
        for _ in range(WARMUP_CALLS):
            reduce(x)
        samples = []
        for _ in range(calls[label]):
            start = time.perf_counter()
            out = reduce(x)
            samples.append(time.perf_counter() - start)
        if not np.all(out == world * (world + 1) // 2):
            raise RuntimeError(f"{label}: wrong all-reduce result {out[:4]}")
        timings[label] = samples
    return timings


def _shm_rank(instance: str, rank: int, world: int, capacity: int, sizes: dict[str, int], calls: dict[str, int],
              results: Any) -> None:
    with ShmAllReduce(instance, rank, world, capacity) as group:
        results.put((rank, _time_calls(group.all_reduce, sizes, calls, rank, world)))


def _gloo_rank(port: int, rank: int, world: int, sizes: dict[str, int], calls: dict[str, int], results: Any) -> None:
    group = GlooAllReduce(rank, world, "127.0.0.1", port)
    try:
        results.put((rank, _time_calls(group.all_reduce, sizes, calls, rank, world)))
    finally:
        group.close()


def _run_group(target, args_of_rank, world: int) -> dict[str, list[float]]:
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args_of_rank(rank), results)) for rank in range(world)]
    for proc in procs:
        proc.start()
    by_rank: dict[int, dict[str, list[float]]] = {}
    deadline = time.monotonic() + RESULT_TIMEOUT_S
    try:
        while len(by_rank) < world:
            try:
                rank, timings = results.get(timeout=1.0)
                by_rank[rank] = timings
            except queue.Empty:
                failed = [proc.exitcode for proc in procs if proc.exitcode not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    raise RuntimeError(f"{target.__name__}: a rank failed (exit codes {failed}) or timed out")
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return by_rank[0]


def _summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {"median_us": round(statistics.median(ordered) * 1e6, 1),
            "p90_us": round(ordered[int(0.9 * (len(ordered) - 1))] * 1e6, 1),
            "calls": len(ordered)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    sizes = {"decode_1x%d" % args.hidden: args.hidden,
             "prefill_%dx%d" % (args.chunk_tokens, args.hidden): args.chunk_tokens * args.hidden}
    decode_label, prefill_label = list(sizes)
    calls = {decode_label: args.calls, prefill_label: max(args.calls // 10, 20)}
    report: dict[str, Any] = {"ranks": args.ranks, "sizes_floats": sizes, "cpus": os.cpu_count(),
                              "load_avg_1m": round(os.getloadavg()[0], 2), "backends": {}}
    instance = "tpar" + uuid.uuid4().hex[:8]
    capacity = max(sizes.values())
    with ShmAllReduceGroup(instance, args.ranks, capacity):
        shm = _run_group(_shm_rank, lambda r: (instance, r, args.ranks, capacity, sizes, calls), args.ranks)
    report["backends"]["shm"] = {label: _summary(samples) for label, samples in shm.items()}
    if not args.no_gloo:
        port = free_port()
        gloo = _run_group(_gloo_rank, lambda r: (port, r, args.ranks, sizes, calls), args.ranks)
        report["backends"]["gloo"] = {label: _summary(samples) for label, samples in gloo.items()}
    per_step = {}
    for backend, figures in report["backends"].items():
        per_step[backend] = round(2 * args.layers * figures[decode_label]["median_us"] / 1000, 2)
    report["decode_step_allreduce_ms"] = {"layers": args.layers, "calls_per_step": 2 * args.layers, **per_step}
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=576, help="hidden size (SmolLM2-135M: 576)")
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--layers", type=int, default=30, help="decoder layers for the per-step figure")
    parser.add_argument("--calls", type=int, default=2000, help="decode-size calls (prefill: a tenth)")
    parser.add_argument("--no-gloo", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    report = run(args)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as handle:
            handle.write(text + "\n")


if __name__ == "__main__":
    main()
