"""Raw model forward rate, without the server: prefill then timed decode steps per batch size.

This script owns the model-only performance figure (what the serving stack can at best
reach). It runs the serving worker's path: the registered model class, ``kv_cache_views``
over a numpy KV cache, ``build_attention_metadata`` every step, ``compute_logits`` on each
sequence's last token and a greedy argmax.

    python benchmarks/forward.py [--batch-sizes 1,8,32] [--context 128] [--steps 16] [--out result.json]
"""
from __future__ import annotations

import argparse
import logging
import statistics
import time
from typing import Any

from model_setup import add_model_arguments, contiguous_cache, load_model, write_report

logger = logging.getLogger(__name__)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,8,32", help="comma-separated decode batch sizes")
    add_model_arguments(parser, steps=16, steps_help="timed decode steps per batch size")
    args = parser.parse_args(argv)
    args.batch_sizes = [int(item) for item in args.batch_sizes.split(",") if item.strip()]
    if not args.batch_sizes or min(args.batch_sizes) < 1:
        parser.error("--batch-sizes needs positive integers")
    if args.context < 1 or args.steps < 1:
        parser.error("--context and --steps must be positive")
    return args


def run_batch(model: Any, config: Any, batch_size: int, args: argparse.Namespace) -> dict[str, float]:
    import numpy as np
    import paddle

    from worker.attention import build_attention_metadata

    total_len = args.context + args.warmup + args.steps + 1
    kv_caches, tables = contiguous_cache(config, batch_size, total_len, args.block_size)
    rng = np.random.default_rng(args.seed)
    prompts = rng.integers(0, config.vocab_size, size=(batch_size, args.context), dtype=np.int64)

    def step(input_ids: np.ndarray, query_len: int, context_len: int) -> np.ndarray:
        meta = build_attention_metadata([query_len] * batch_size, [context_len] * batch_size, tables, args.block_size)
        hidden = model(paddle.to_tensor(input_ids), meta.positions, kv_caches, meta)
        logits = model.compute_logits(paddle.index_select(hidden, meta.last_token_indices))
        return logits.argmax(axis=-1).numpy()

    with paddle.no_grad():
        started = time.perf_counter()
        tokens = step(prompts.reshape(-1), args.context, args.context)
        prefill_s = time.perf_counter() - started
        context = args.context
        durations = []
        for index in range(args.warmup + args.steps):
            context += 1
            started = time.perf_counter()
            tokens = step(tokens.astype(np.int64), 1, context)
            if index >= args.warmup:
                durations.append(time.perf_counter() - started)
    median = statistics.median(durations)
    return {
        "batch_size": batch_size,
        "prefill_ms": round(prefill_s * 1e3, 2),
        "prefill_tokens_per_s": round(batch_size * args.context / prefill_s, 1),
        "decode_step_ms_median": round(median * 1e3, 2),
        "decode_step_ms_min": round(min(durations) * 1e3, 2),
        "decode_tokens_per_s": round(batch_size / median, 1),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    loaded = load_model(args)
    import paddle

    model, config = loaded.model, loaded.config
    # The first forward pays one-off costs (allocator growth, GEMM kernel set-up) that are not the model's rate.
    run_batch(model, config, 1, argparse.Namespace(**{**vars(args), "steps": 1, "warmup": 1}))
    results = []
    for batch_size in args.batch_sizes:
        result = run_batch(model, config, batch_size, args)
        logger.info("batch %d: %s", batch_size, result)
        results.append(result)
    report = {
        "model": config.path,
        "model_fingerprint": config.model_fingerprint,
        "paddle_version": paddle.__version__,
        "device": paddle.device.get_device(),
        "threads": loaded.threads,
        "context": args.context,
        "steps": args.steps,
        "block_size": args.block_size,
        "results": results,
    }
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
