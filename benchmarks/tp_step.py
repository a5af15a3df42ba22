#!/usr/bin/env python3
"""Per-step cost of tensor parallelism as served: TP=2 against TP=1 on the same cores.

Owns one measurement: two servers of the same dense checkpoint, one at TP=1 (one worker with every
core) and one at TP=2 (two workers, the cores split between them), both up at once and asked in
alternation (one request at a time, so they never compete). Each request is a greedy streamed
completion of ``--tokens`` tokens (EOS ignored) at ``--batch`` concurrent streams; the figure per
round is the time per output token after the first (the decode step as the client sees it: the
engine loop, rank 0's fan-out to the peers, the forward with its 2 x layers all-reduces, sampling),
and the report gives the medians over ``--rounds`` rounds and their ratio.

The checkpoint is random (``scripts/make_tiny_dense.py``) with SmolLM2-135M's shape except for
heads that divide by 2: 30 layers, hidden 576 = 8 heads x 72, 4 KV heads, MLP 1536.

    python benchmarks/tp_step.py --out benchmarks/results/tp_step.json
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

import httpx  # noqa: E402

from benchmarks.model_setup import write_report  # noqa: E402
from harness.server import ServerProcess  # noqa: E402
from scripts.make_tiny_dense import make_tiny_dense  # noqa: E402

SMOLLM2_SHAPED = {"layers": 30, "hidden": 576, "heads": 8, "kv_heads": 4, "head_dim": 72, "intermediate": 1536}
PROMPT = [(37 * i) % 5000 + 100 for i in range(32)]


def stream_tpot(server: ServerProcess, tokens: int, offset: int) -> float:
    """Seconds per output token after the first of one greedy streamed completion."""
    body = {"prompt": [t + offset for t in PROMPT], "max_tokens": tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    stamps = []
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=600) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {") and '"text"' in line:
                stamps.append(time.perf_counter())
    if len(stamps) < 2:
        raise RuntimeError(f"only {len(stamps)} chunks streamed")
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1)


def batch_tpot(server: ServerProcess, tokens: int, batch: int, round_index: int) -> float:
    """Median per-token time of ``batch`` concurrent streams (distinct prompts: no prefix sharing)."""
    with ThreadPoolExecutor(batch) as pool:
        samples = list(pool.map(lambda i: stream_tpot(server, tokens, 7 * (round_index * batch + i)), range(batch)))
    return statistics.median(samples)


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = make_tiny_dense(tempfile.mkdtemp(prefix="fdserve-tp-step-"), seed=1, **SMOLLM2_SHAPED)
    common = ("--model", model, "--num-gpu-blocks-override", "256", "--max-num-seqs", str(max(args.batch, 8)))
    report: dict[str, Any] = {"model": SMOLLM2_SHAPED, "cpus": os.cpu_count(), "batch": args.batch,
                              "tokens": args.tokens, "rounds": args.rounds,
                              "load_avg_1m_start": round(os.getloadavg()[0], 2)}
    with ServerProcess(*common, die_with_parent=True) as tp1, \
            ServerProcess(*common, "--tensor-parallel-size", "2", die_with_parent=True) as tp2:
        servers = {"tp1": tp1, "tp2": tp2}
        for server in servers.values():  # warm-up
            batch_tpot(server, 8, args.batch, 0)
        samples: dict[str, list[float]] = {name: [] for name in servers}
        for round_index in range(1, args.rounds + 1):
            order = list(servers) if round_index % 2 else list(reversed(servers))
            for name in order:
                samples[name].append(batch_tpot(servers[name], args.tokens, args.batch, round_index))
    for name, values in samples.items():
        report[f"{name}_step_ms_median"] = round(statistics.median(values) * 1000, 2)
        report[f"{name}_step_ms_samples"] = [round(v * 1000, 2) for v in values]
    report["tp2_over_tp1"] = round(report["tp2_step_ms_median"] / report["tp1_step_ms_median"], 2)
    report["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=48, help="output tokens per stream")
    parser.add_argument("--batch", type=int, default=1, help="concurrent streams per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out")
    args = parser.parse_args()
    write_report(run(args), args.out)


if __name__ == "__main__":
    main()
