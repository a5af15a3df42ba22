#!/usr/bin/env python3
"""What log-probabilities cost end to end, and how fast the server scores text (echo + logprobs).

Measures against a real server (started here on a free port, or ``--base-url`` of a running one):

- decode: a greedy 128-token completion (``ignore_eos``) without logprobs, with ``logprobs: 5`` and with
  ``logprobs: 20``, interleaved ``--repeats`` times; the minimum and median seconds of each, and the
  overhead of the minimum against the plain run (worker top-k + transfer + the API server's formatting of
  every token);
- scoring: ``echo: true, logprobs: 1, max_tokens: 0`` over a batch of 16 prompts (the request
  lm-evaluation-harness sends for log-likelihood tasks, without the extra token), prompt tokens per second,
  with the prefix cache reset before each run so every prompt position is computed.

    python benchmarks/api_logprobs.py --out /tmp/api_logprobs.json

Prints the JSON report (and writes it to ``--out``). Keeps under two minutes on 2 cores.
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from typing import Any

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness.server import ServerProcess  # noqa: E402
from benchmarks.model_setup import write_report  # noqa: E402

logger = logging.getLogger(__name__)

DECODE_TOKENS = 128
SCORING_BATCH = 16
SCORING_TEXT = ("In the middle of the nineteenth century, railways spread across the continent and changed how "
                "goods, people and news travelled; towns grew around stations and timetables made clocks agree. ")


def timed(client: httpx.Client, body: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    started = time.perf_counter()
    response = client.post("/v1/completions", json=body)
    response.raise_for_status()
    return time.perf_counter() - started, response.json()


def decode_runs(client: httpx.Client, repeats: int) -> dict[str, Any]:
    base = {"prompt": "Write a long story about a lighthouse keeper.", "max_tokens": DECODE_TOKENS,
            "temperature": 0, "ignore_eos": True}
    timed(client, base)  # warm-up (prefix cache, first-request costs)
    variants = (("plain", {}), ("logprobs_5", {"logprobs": 5}), ("logprobs_20", {"logprobs": 20}))
    seconds: dict[str, list[float]] = {label: [] for label, _ in variants}
    # Interleaved, so load from other processes on the machine hits every variant alike; the minimum is
    # the least disturbed run.
    for _ in range(repeats):
        for label, extra in variants:
            elapsed, body = timed(client, {**base, **extra})
            if extra and len(body["choices"][0]["logprobs"]["tokens"]) != DECODE_TOKENS:
                raise RuntimeError(f"{label}: expected {DECODE_TOKENS} logprob entries")
            seconds[label].append(elapsed)
    best = {label: min(values) for label, values in seconds.items()}
    return {"tokens": DECODE_TOKENS,
            "min_s": {k: round(v, 3) for k, v in best.items()},
            "median_s": {k: round(statistics.median(v), 3) for k, v in seconds.items()},
            "overhead_pct_of_min": {k: round(100 * (best[k] / best["plain"] - 1), 1)
                                    for k in ("logprobs_5", "logprobs_20")}}


def scoring_runs(client: httpx.Client, repeats: int) -> dict[str, Any]:
    prompts = [f"Passage {i}. " + SCORING_TEXT for i in range(SCORING_BATCH)]
    rates = []
    prompt_tokens = 0
    for _ in range(repeats):
        client.post("/v1/cache/reset").raise_for_status()
        elapsed, body = timed(client, {"prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 0})
        prompt_tokens = body["usage"]["prompt_tokens"]
        if len(body["choices"]) != SCORING_BATCH:
            raise RuntimeError(f"scoring: expected {SCORING_BATCH} choices, got {len(body['choices'])}")
        rates.append(prompt_tokens / elapsed)
    return {"prompts": SCORING_BATCH, "prompt_tokens": prompt_tokens,
            "prompt_tokens_per_s_median": round(statistics.median(rates), 1)}


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default=None, help="a running server (default: start one here)")
    parser.add_argument("--repeats", type=int, default=4, help="runs per measurement (default: 4)")
    parser.add_argument("--out", default=None, help="also write the JSON report to this file")
    args = parser.parse_args(argv)
    server = None if args.base_url else ServerProcess("--max-model-len", "2048").start()
    try:
        base_url = args.base_url or server.base_url
        with httpx.Client(base_url=base_url, timeout=300) as client:
            report = {"decode": decode_runs(client, args.repeats), "scoring": scoring_runs(client, args.repeats)}
    finally:
        if server is not None:
            server.close()
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
