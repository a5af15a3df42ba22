"""Raw model forward rate, without the server: prefill then timed decode steps per batch size.

This script owns the model-only performance figure (what the serving stack can at best
reach). It runs the serving worker's path: the registered model class, ``kv_cache_views``
over a numpy KV cache, ``build_attention_metadata`` every step, ``compute_logits`` on each
sequence's last token and a greedy argmax.

    python benchmarks/forward.py [--batch-sizes 1,8,32] [--context 128] [--steps 16] [--out result.json]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from typing import Any

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

import envs  # noqa: E402

logger = logging.getLogger(__name__)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2-135M GGUF)")
    parser.add_argument("--batch-sizes", default="1,8,32", help="comma-separated decode batch sizes")
    parser.add_argument("--context", type=int, default=128, help="prompt tokens prefilled per sequence")
    parser.add_argument("--steps", type=int, default=16, help="timed decode steps per batch size")
    parser.add_argument("--warmup", type=int, default=2, help="untimed decode steps before timing")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=0, help="compute threads (0: FD_NUM_THREADS or all cores)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="also write the JSON result to this file")
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

    from worker.attention import build_attention_metadata, kv_cache_shape, kv_cache_views

    total_len = args.context + args.warmup + args.steps + 1
    blocks_per_seq = -(-total_len // args.block_size)
    cache = np.zeros(kv_cache_shape(config, batch_size * blocks_per_seq, args.block_size), dtype=np.float32)
    kv_caches = kv_cache_views(cache)
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(batch_size)]
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
    logging.basicConfig(level=envs.FD_LOG_LEVEL, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    threads = args.threads or envs.FD_NUM_THREADS or envs.available_cores()
    envs.apply_compute_thread_env(threads)  # before paddle is imported, below
    import paddle

    from worker.loader import load_weights
    from worker.model_config import default_model_path, load_model_config
    from worker.models import get_model_class

    config = load_model_config(args.model or default_model_path())
    model = get_model_class(config.architecture)(config)
    model.load_weights(load_weights(config))
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
        "threads": threads,
        "context": args.context,
        "steps": args.steps,
        "block_size": args.block_size,
        "results": results,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            handle.write(text + "\n")
    return report


if __name__ == "__main__":
    main()
