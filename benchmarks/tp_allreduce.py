#!/usr/bin/env python3
"""Tensor-parallel all-reduce benchmark: shared memory (``ShmAllReduce``) against gloo (``GlooAllReduce``).

Owns the measurement of ``inter_communicator.allreduce``: per-call latency (median and p90 over
``--calls`` calls after a warm-up, measured on rank 0; every call is a barrier, so it is the group's
latency) at ``--ranks`` spawned processes, for the sizes of a decode step (1 x hidden floats) and
of a prefill chunk (``--chunk-tokens`` x hidden), plus the per-step all-reduce cost this implies
for a ``--layers``-layer model (two all-reduces per layer: after o_proj and after down).

``--model-steps K`` also times K batch-1 decode steps (after a 32-token prefill) of the default model
(SmolLM2-135M) at TP=1 and at TP=``--model-tp`` (one spawned process per rank, shm all-reduce,
``--threads`` compute threads per process), median per-step forward time measured on rank 0.

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


PREFILL_TOKENS = 32
MODEL_BLOCK_SIZE = 16


def _model_rank(instance: str, rank: int, tp_size: int, steps: int, threads: int, results: Any) -> None:
    """One rank of the default model: prefill 32 tokens, then ``steps`` timed batch-1 decode steps."""
    import envs

    envs.apply_compute_thread_env(threads)
    import paddle

    from cache_manager.kv_layout import device_cache_shape
    from config.model_config import default_model_path, load_model_config
    from worker.attention import build_attention_metadata, kv_cache_views
    from worker.loader import load_weights
    from worker.models.llama import LlamaForCausalLM
    from worker.tensor_parallel import paddle_all_reduce

    config = load_model_config(default_model_path())
    group = None
    if tp_size > 1:
        group = ShmAllReduce(instance, rank, tp_size, capacity=PREFILL_TOKENS * config.hidden_size, timeout_s=120)
        model = LlamaForCausalLM(config, tp_rank=rank, tp_size=tp_size, all_reduce=paddle_all_reduce(group.all_reduce))
    else:
        model = LlamaForCausalLM(config)
    try:
        model.load_weights(load_weights(config))
        total = PREFILL_TOKENS + steps + 1
        blocks = -(-total // MODEL_BLOCK_SIZE)
        shape = list(device_cache_shape(config, blocks, MODEL_BLOCK_SIZE))
        shape[3] = model.num_kv_heads  # this rank's KV heads only
        caches = kv_cache_views(np.zeros(shape, dtype=np.float32))
        table = list(range(blocks))
        tokens = [(17 * i) % 1000 + 3 for i in range(total)]
        samples = []
        with paddle.no_grad():
            for done, count in [(0, PREFILL_TOKENS)] + [(PREFILL_TOKENS + i, 1) for i in range(steps)]:
                meta = build_attention_metadata([count], [done + count], [table], MODEL_BLOCK_SIZE)
                start = time.perf_counter()
                hidden = model(paddle.to_tensor(tokens[done:done + count], dtype="int64"), meta.positions, caches, meta)
                model.compute_logits(hidden[-1:]).numpy()
                samples.append(time.perf_counter() - start)
        results.put((rank, {"decode": samples[1:]}))
    finally:
        if group is not None:
            group.close()


def model_steps(args: argparse.Namespace) -> dict[str, Any]:
    """Median decode-step time of the default model at TP=1 and TP=``args.model_tp``."""
    figures: dict[str, Any] = {"threads_per_process": args.threads, "steps": args.model_steps}
    for tp_size in (1, args.model_tp):
        instance = "tpms" + uuid.uuid4().hex[:8]
        if tp_size > 1:
            with ShmAllReduceGroup(instance, tp_size, PREFILL_TOKENS * args.hidden):
                timings = _run_group(_model_rank, lambda r: (instance, r, tp_size, args.model_steps, args.threads),
                                     tp_size)
        else:
            timings = _run_group(_model_rank, lambda r: (instance, r, 1, args.model_steps, args.threads), 1)
        figures[f"tp{tp_size}_decode_step_ms"] = round(statistics.median(timings["decode"]) * 1000, 2)
    return figures


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
    if args.model_steps:
        report["model_decode_step"] = model_steps(args)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=576, help="hidden size (SmolLM2-135M: 576)")
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--layers", type=int, default=30, help="decoder layers for the per-step figure")
    parser.add_argument("--calls", type=int, default=2000, help="decode-size calls (prefill: a tenth)")
    parser.add_argument("--no-gloo", action="store_true")
    parser.add_argument("--model-steps", type=int, default=0, help="also time this many decode steps of the model")
    parser.add_argument("--model-tp", type=int, default=3, help="TP size for --model-steps (SmolLM2: 3)")
    parser.add_argument("--threads", type=int, default=1, help="compute threads per rank process")
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
