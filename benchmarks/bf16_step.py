"""Decode-step cost, float32 against bfloat16, both models in one process and alternating step by step.

This script owns the model-level bf16 speed figure that stays readable on a shared machine: each
timed decode step of a batch (after a prefill of ``--context`` tokens per sequence) runs first on one
dtype and then on the other, and both the wall time and this process's CPU time are recorded. With
``--threads 1`` the CPU time is the work itself, which other jobs on the cores do not inflate (wall
time then measures the machine's load as much as the code). Medians over ``--steps`` steps.

    python benchmarks/bf16_step.py [--batch-sizes 1,8,32] [--threads 1] [--out benchmarks/results/bf16_step.json]
"""
from __future__ import annotations

import argparse
import logging
import statistics
import time
from typing import Any

from bf16_accuracy import load_models
from model_setup import contiguous_cache, write_report

import envs

logger = logging.getLogger(__name__)
BLOCK_SIZE = 64


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,8,32", help="comma-separated decode batch sizes")
    parser.add_argument("--context", type=int, default=128, help="prompt tokens prefilled per sequence")
    parser.add_argument("--steps", type=int, default=12, help="timed decode steps per batch size and dtype")
    parser.add_argument("--threads", type=int, default=1, help="compute threads")
    parser.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2-135M GGUF)")
    parser.add_argument("--out", default=None, help="also write the JSON result to this file")
    args = parser.parse_args(argv)
    args.batch_sizes = [int(item) for item in args.batch_sizes.split(",") if item.strip()]
    return args


class _Sequences:
    """One dtype's batch: its own KV cache, prefilled, and the next token of every sequence."""

    def __init__(self, model: Any, config: Any, batch_size: int, context: int, steps: int) -> None:
        import numpy as np
        import paddle

        self.model, self.batch_size = model, batch_size
        self.kv_caches, self.tables = contiguous_cache(config, batch_size, context + steps + 2, BLOCK_SIZE)
        prompts = np.random.default_rng(0).integers(0, config.vocab_size, size=(batch_size, context))
        self.context = context
        self.tokens = self._step(paddle.to_tensor(prompts.reshape(-1).astype(np.int64)), context)

    def _step(self, input_ids: Any, query_len: int) -> Any:
        import paddle

        from worker.attention import build_attention_metadata

        meta = build_attention_metadata([query_len] * self.batch_size, [self.context] * self.batch_size,
                                        self.tables, BLOCK_SIZE)
        with paddle.no_grad():
            hidden = self.model(input_ids, meta.positions, self.kv_caches, meta)
            logits = self.model.compute_logits(paddle.index_select(hidden, meta.last_token_indices))
            return logits.argmax(axis=-1).astype("int64")

    def decode(self) -> tuple[float, float]:
        """(wall s, CPU s) of one decode step."""
        self.context += 1
        wall, cpu = time.perf_counter(), time.process_time()
        self.tokens = self._step(self.tokens, 1)
        self.tokens.numpy()  # the step is done when its tokens are on the host
        return time.perf_counter() - wall, time.process_time() - cpu


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    logging.basicConfig(level=envs.FD_LOG_LEVEL, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    envs.apply_compute_thread_env(args.threads)
    config, fp32, bf16 = load_models(args.model)
    results = []
    for batch_size in args.batch_sizes:
        runs = {name: _Sequences(model, config, batch_size, args.context, args.steps + 1)
                for name, model in (("float32", fp32), ("bfloat16", bf16))}
        samples: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
        for step in range(args.steps + 1):
            for name, run in runs.items():
                sample = run.decode()
                if step > 0:  # the first decode step of each is a warm-up
                    samples[name].append(sample)
        row: dict[str, Any] = {"batch_size": batch_size}
        for name, values in samples.items():
            row[f"{name}_wall_ms"] = round(statistics.median(v[0] for v in values) * 1e3, 2)
            row[f"{name}_cpu_ms"] = round(statistics.median(v[1] for v in values) * 1e3, 2)
        row["cpu_speedup"] = round(row["float32_cpu_ms"] / row["bfloat16_cpu_ms"], 2)
        logger.info("batch %d: %s", batch_size, row)
        results.append(row)
    report = {"threads": args.threads, "context": args.context, "steps": args.steps, "results": results}
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
