"""Decode-sized float32 matmuls: paddle.matmul (MKL) against the native few-row kernel, with weights in 4 KiB or
2 MiB pages, read cold as a decode step reads them.

This script owns the figures behind ``worker/kernels/gemv.py`` (which row counts use the native kernel) and
``worker/weight_memory.py`` (weights in 2 MiB pages). For each of SmolLM2-135M's linear shapes (as
``benchmarks/gemm.py`` lists them) and each row count, it makes enough copies of the weight to exceed the
last-level cache (so every call reads its weight from memory, as one layer after another does in a step),
then times one call per copy, variants alternating round by round:

- ``matmul``: ``paddle.matmul``; ``native``: ``fd_f32_small_linear`` (rows <= 8 only);
- each over weights from ``paddle.to_tensor`` (``4k``: ordinary pages) and from
  ``weight_memory.weight_tensor`` (``2m``: 2 MiB pages where the kernel grants them).

``step_ms`` adds the shapes up as one decode step of SmolLM2-135M runs them (30 layers x qkv, o_proj,
gate_up, down, plus the LM head once).

    python benchmarks/few_row_linear.py [--m 1,2,4,8] [--rounds 5] [--out few_row_linear.json]
"""
from __future__ import annotations

import argparse
import logging
import statistics
import time
from typing import Any, Callable

from gemm import SHAPES
from model_setup import write_report

import envs

logger = logging.getLogger(__name__)

LAYERS = 30  # SmolLM2-135M
COLD_BYTES = 256 << 20  # copies of a weight per variant: well past the 32 MiB L3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", default="1,2,4,8", help="comma-separated row counts")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds per shape and row count")
    parser.add_argument("--threads", type=int, default=0, help="compute threads (0: FD_NUM_THREADS or all cores)")
    parser.add_argument("--out", default=None, help="also write the JSON result to this file")
    args = parser.parse_args(argv)
    args.m = [int(item) for item in args.m.split(",") if item.strip()]
    if not args.m or min(args.m) < 1 or args.rounds < 1:
        parser.error("--m needs positive integers and --rounds must be positive")
    return args


def _time_per_call(run: Callable[[Any, Any], Any], x: Any, weights: list[Any]) -> float:
    started = time.perf_counter()
    for weight in weights:
        run(x, weight)
    return (time.perf_counter() - started) / len(weights)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    logging.basicConfig(level=envs.FD_LOG_LEVEL, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    threads = args.threads or envs.FD_NUM_THREADS or envs.available_cores()
    envs.apply_compute_thread_env(threads)
    import numpy as np
    import paddle

    from worker import weight_memory
    from worker.kernels import gemv

    if gemv.load() is None:
        raise SystemExit("the native few-row kernel is unavailable here (FD_NATIVE_KERNELS, compiler or CPU)")
    rng = np.random.default_rng(0)
    results = []
    for shape_name, (k, n) in SHAPES.items():
        copies = max(2, COLD_BYTES // (k * n * 4))
        source = rng.standard_normal((k, n)).astype(np.float32)
        pages = {"4k": [paddle.to_tensor(source) for _ in range(copies)],
                 "2m": [weight_memory.weight_tensor(source) for _ in range(copies)]}
        for rows in args.m:
            x = paddle.to_tensor(rng.standard_normal((rows, k)).astype(np.float32))
            variants: dict[str, tuple[Callable[[Any, Any], Any], list[Any]]] = {}
            for page_name, weights in pages.items():
                variants[f"matmul_{page_name}"] = (paddle.matmul, weights)
                if rows <= gemv.MAX_ROWS:
                    variants[f"native_{page_name}"] = (lambda a, w: gemv.small_linear(a, w), weights)
            samples: dict[str, list[float]] = {name: [] for name in variants}
            for _ in range(args.rounds):
                for name, (run, weights) in variants.items():
                    samples[name].append(_time_per_call(run, x, weights))
            row = {"shape": shape_name, "k": k, "n": n, "rows": rows,
                   "us": {name: round(statistics.median(times) * 1e6, 1) for name, times in samples.items()}}
            row["gb_per_s"] = {name: round(k * n * 4 / (us * 1e3), 1) for name, us in row["us"].items()}
            logger.info("%s", row)
            results.append(row)
        del pages
    per_step = {}
    for rows in args.m:
        for variant in results[0]["us"]:
            total_us = 0.0
            for row in results:
                if row["rows"] != rows or variant not in row["us"]:
                    continue
                total_us += row["us"][variant] * (1 if row["shape"] == "lm_head" else LAYERS)
            if total_us:
                per_step.setdefault(str(rows), {})[variant] = round(total_us / 1e3, 2)
    report = {"threads": threads, "paddle_version": paddle.__version__, "rounds": args.rounds,
              "results": results, "step_ms": per_step}
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
