#!/usr/bin/env python3
"""TTFT and inter-token latency of P/D disaggregation against mixed instances, through the router.

Starts four instances of one model on free 127.0.0.1 ports: a prefill and a decode instance behind one router
(``pd``), and two mixed instances behind another (``mixed``: the same number of instances, least-loaded
routing), then runs ``benchmarks/serving.py``'s load (streamed completions of exact-length random token
prompts, ``--concurrency`` in flight) against each router, at each concurrency, alternating which variant goes
first. Both variants pay the same router hop. Each concurrency uses its own prompts (another seed), the same for
both variants, so no run finds the previous one's prompts in a prefix cache. Reported per concurrency and
variant: serving.py's summary (TTFT and TPOT percentiles: TPOT is the mean inter-token latency of a request),
and the ratios P/D / mixed of the medians; for P/D also the router's prefill fallbacks and how many prompt
tokens the decode instance took from the prefill instance (warm-up requests included).

    python benchmarks/pd_serving.py --concurrency 8 32 --out /tmp/pd_serving.json

On 2 shared cores the four instances compete for the CPU, so P/D cannot show the isolation it gives on
separate machines; the figures measure the mechanism's cost here.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import re
import sys
from typing import Any, Iterator

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import serving  # noqa: E402
from benchmarks.model_setup import write_report  # noqa: E402
from harness.router import RouterProcess  # noqa: E402
from harness.server import ServerProcess  # noqa: E402

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def deployments(server_args: list[str]) -> Iterator[tuple[dict[str, RouterProcess], str]]:
    """The two routers (``pd``, ``mixed``) with their instances started (side by side) and healthy, and the
    decode instance's URL."""
    roles = ["prefill", "decode", "mixed", "mixed"]
    servers = [ServerProcess(*server_args, "--splitwise-role", role, die_with_parent=True) for role in roles]
    with contextlib.ExitStack() as stack:
        for server in servers:
            stack.callback(server.close)
            server.launch()
        for server in servers:
            server.wait_healthy()
        urls = {role: [s.base_url for s, r in zip(servers, roles) if r == role] for role in set(roles)}
        routers = {"pd": RouterProcess(prefill=urls["prefill"], decode=urls["decode"], die_with_parent=True),
                   "mixed": RouterProcess(mixed=urls["mixed"], die_with_parent=True)}
        for router in routers.values():
            stack.callback(router.close)
            router.start()
        yield routers, urls["decode"][0]


def router_counters(router: RouterProcess) -> dict[str, float]:
    text = httpx.get(router.base_url + "/metrics", timeout=30).text
    return {f"{name}{{{labels}}}" if labels else name: float(value) for name, labels, value in
            re.findall(r"^fdserve_router_(prefill_fallbacks_total|requests_total)\{?([^}\s]*)\}? (\S+)$", text, re.M)}


def run_load(router: RouterProcess, concurrency: int, args: argparse.Namespace, seed: int, label: str) -> dict:
    argv = ["--port", str(router.port), "--num-requests", str(args.requests_per_slot * concurrency),
            "--concurrency", str(concurrency), "--input-len", str(args.input_len),
            "--output-len", str(args.output_len), "--seed", str(seed), "--warmup", str(min(concurrency, 8)),
            "--label", label]
    return asyncio.run(serving.benchmark(serving.parse_args(argv)))


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--model", default=None, help="model of every instance (default: launch.py's)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--requests-per-slot", type=int, default=3,
                        help="requests per run = this x the concurrency")
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                        help="extra launch.py argument for every instance (repeat)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    # 384 blocks of 64 tokens: room for 32 requests of 576 tokens on one instance, and no more (four instances
    # with SmolLM2's float32 KV at 1.1 GB each; a larger pool got workers OOM-killed on a shared 24 GB host).
    server_args = ["--max-num-seqs", str(max(args.concurrency)), "--max-model-len", "2048",
                   "--num-gpu-blocks-override", "384", *args.server_arg]
    if args.model:
        server_args += ["--model", args.model]
    runs: list[dict[str, Any]] = []
    with deployments(server_args) as (routers, decode_url):
        for index, concurrency in enumerate(args.concurrency):
            seed = 1000 * (index + 1)
            order = ["pd", "mixed"] if index % 2 == 0 else ["mixed", "pd"]
            before = httpx.get(decode_url + "/v1/cache/stats", timeout=30).json()
            results = {variant: run_load(routers[variant], concurrency, args, seed, f"{variant} c={concurrency}")
                       for variant in order}
            after = httpx.get(decode_url + "/v1/cache/stats", timeout=30).json()
            remote_hits = after.get("remote_hit_tokens", 0) - before.get("remote_hit_tokens", 0)
            pd, mixed = results["pd"], results["mixed"]
            runs.append({
                "concurrency": concurrency,
                "order": order,
                "pd": pd,
                "mixed": mixed,
                "pd_over_mixed": {
                    "ttft_p50": ratio(pd["ttft_ms"]["p50"], mixed["ttft_ms"]["p50"]),
                    "tpot_p50": ratio(pd["tpot_ms"]["p50"], mixed["tpot_ms"]["p50"]),
                    "output_throughput": ratio(pd["output_throughput_tps"], mixed["output_throughput_tps"]),
                },
                "decode_remote_hit_tokens_incl_warmup": remote_hits,
            })
            logger.warning("c=%d: %s", concurrency, runs[-1]["pd_over_mixed"])
        counters = router_counters(routers["pd"])
    write_report({"benchmark": "pd_serving", "input_len": args.input_len, "output_len": args.output_len,
                  "server_args": server_args, "runs": runs, "pd_router_counters": counters}, args.out)


if __name__ == "__main__":
    main()
