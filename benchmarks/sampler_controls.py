"""Per-step cost of the worker's sampler with and without logits controls and logprobs.

This script owns the sampler's cost figures in the README: one ``Sampler.sample`` call on a
[batch, vocab] float32 logits array (random, model-like spread), median of ``--repeat`` calls,
for a batch of plain rows (the fast path), of rows using each control, and the cost of the raw
logprobs (``worker.logprobs.token_logprobs``) on top, with the worker's malloc tuning. With ``--baseline FILE`` it also times the
plain rows with another sampler module (e.g. the one before the controls existed) so the fast path
can be compared with what it cost before:

    git show be5adb0:worker/sampler.py > /tmp/sampler_before.py
    python benchmarks/sampler_controls.py --baseline /tmp/sampler_before.py [--batch-size 32] [--out r.json]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

import envs  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--history", type=int, default=256, help="output tokens per row (penalties, bad words)")
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens per row (repetition penalty)")
    parser.add_argument("--repeat", type=int, default=30, help="timed calls per case (median reported)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--baseline", default=None, help="a sampler.py to time the plain rows with as well")
    parser.add_argument("--out", default=None, help="also write the JSON result to this file")
    args = parser.parse_args(argv)
    if min(args.batch_size, args.vocab, args.repeat) < 1 or min(args.history, args.prompt) < 0:
        parser.error("--batch-size, --vocab, --repeat must be positive; --history, --prompt non-negative")
    return args


def median_ms(call: Callable[[], Any], repeat: int) -> float:
    call()  # warm-up: scratch buffers, page faults
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return round(statistics.median(times) * 1e3, 3)


def load_module(path: str, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    envs.apply_compute_thread_env(args.threads)
    import numpy as np

    from worker.worker_process import tune_malloc

    # As the worker: freed multi-MB buffers stay in the heap, so no call page-faults them in again.
    tune_malloc()

    from config.sampling_params import SamplingParams
    from worker.logits_processors import RowState
    from worker.logprobs import token_logprobs
    from worker.sampler import Sampler

    rng = np.random.default_rng(0)
    n, vocab = args.batch_size, args.vocab
    logits = (rng.standard_normal((n, vocab)) * 3.0).astype(np.float32)
    steps = list(range(n))
    histories = [RowState(prompt_token_ids=rng.integers(0, vocab, args.prompt).tolist(),
                          output_token_ids=rng.integers(0, vocab, args.history).tolist()) for _ in range(n)]
    mask = np.packbits(rng.random(-(-vocab // 32) * 32) < 0.5, bitorder="little").view("<i4").astype(np.int32)
    greedy = SamplingParams(temperature=0.0)
    random = SamplingParams(temperature=0.8, top_p=0.95)
    bad_words = [[int(t)] for t in rng.integers(0, vocab, 8)] + [histories[0].output_token_ids[-2:] + [5]]
    cases: dict[str, tuple[SamplingParams, list[RowState] | None]] = {
        "plain greedy": (greedy, None),
        "plain T=0.8 top_p=0.95": (random, None),
        "min_p=0.05 (T=0.8 top_p=0.95)": (SamplingParams(temperature=0.8, top_p=0.95, min_p=0.05), None),
        "greedy + presence/frequency": (SamplingParams(temperature=0.0, presence_penalty=0.5,
                                                       frequency_penalty=0.5), histories),
        "greedy + repetition": (SamplingParams(temperature=0.0, repetition_penalty=1.2), histories),
        "greedy + all three penalties": (SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.5,
                                                        repetition_penalty=1.2), histories),
        "greedy + logit_bias (20 ids) + bad words (9)": (
            SamplingParams(temperature=0.0, logit_bias={int(t): 5.0 for t in rng.integers(0, vocab, 20)},
                           bad_words_token_ids=bad_words), histories),
        "greedy + structured-output bitmask": (greedy, [RowState(allowed_token_bitmask=mask)] * n),
        "T=0.8 top_p=0.95 + penalties + bias + min_p": (
            SamplingParams(temperature=0.8, top_p=0.95, min_p=0.05, presence_penalty=0.5, frequency_penalty=0.5,
                           repetition_penalty=1.2, logit_bias={1: 2.0}), histories),
    }
    sampler = Sampler(seed=0)
    results: dict[str, float] = {}
    for label, (params, states) in cases.items():
        results[label] = median_ms(lambda: sampler.sample(logits, [params] * n, steps, states), args.repeat)
    tokens = logits.argmax(axis=1)
    for k in (0, 5, 20):
        results[f"logprobs k={k} (raw, on top of sampling)"] = median_ms(
            lambda: token_logprobs(logits, tokens, [k] * n), args.repeat)
    baseline: dict[str, float] = {}
    if args.baseline:
        old = load_module(args.baseline, "sampler_baseline").Sampler(seed=0)
        for label in ("plain greedy", "plain T=0.8 top_p=0.95"):
            params = cases[label][0]
            baseline[label] = median_ms(lambda: old.sample(logits, [params] * n, steps), args.repeat)
    report = {"batch_size": n, "vocab": vocab, "history": args.history, "prompt": args.prompt,
              "threads": args.threads, "median_ms_per_call": results, "baseline_median_ms": baseline}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return report


if __name__ == "__main__":
    main()
