#!/usr/bin/env python3
"""Tables of the peer benchmark (benchmarks/peer_vllm_cpu.sh) from its per-run JSON files.

Owns the aggregation only: the shell script runs ``benchmarks/serving.py`` once per (server,
concurrency, round) into ``WORK/{server}.c{c}.r{round}.json``, once per (server, prompt length,
round) into ``WORK/{server}.ttft.L{length}.r{round}.json``, and ``benchmarks/peer_greedy.py`` once
per server into ``WORK/{server}.greedy.json``. This prints a markdown table on stderr and the JSON
report on stdout (and ``--out``). Figures are medians over rounds; ratios are fdserve over the peer:
``fdserve_over_peer_tok_s`` >= 1 means fdserve is faster, ``fdserve_over_peer_ttft`` <= 1 means its
first token comes sooner. A ``-bf16`` peer is compared with ``fdserve-bf16`` when that was measured.

    python benchmarks/peer_report.py serving WORK --servers "fdserve vllm-fp32" --concurrency "1 8 32"
    python benchmarks/peer_report.py ttft WORK --servers "fdserve vllm-fp32" --lengths "512 1024"
"""
from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import statistics
import sys
from typing import Any

logger = logging.getLogger(__name__)

BASELINE = "fdserve"
BASELINE_BF16 = "fdserve-bf16"


def _load_runs(pattern: str) -> list[dict]:
    """The serving.py reports matching ``pattern``, each with ``load_avg_1m`` [before, after] when recorded."""
    runs = []
    for path in sorted(glob.glob(pattern)):
        with open(path, encoding="utf-8") as handle:
            run = json.load(handle)
        run["load_avg_1m"] = _load_average(f"{path}.load")
        runs.append(run)
    return runs


def _load_average(path: str) -> list[float] | None:
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as handle:
        return [float(value) for value in handle.read().split()]


def _median(values: list[float | None]) -> float | None:
    present = [value for value in values if value is not None]
    return round(statistics.median(present), 3) if present else None


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return round(numerator / denominator, 3) if numerator and denominator else None


def serving_cell(runs: list[dict]) -> dict[str, Any]:
    """Median tok/s and TTFT/TPOT p50 of one (server, concurrency) over its rounds."""
    return {
        "tok_s": _median([run["output_throughput_tps"] for run in runs]),
        "ttft_p50_ms": _median([run["ttft_ms"]["p50"] for run in runs]),
        "ttft_p99_ms": _median([run["ttft_ms"]["p99"] for run in runs]),
        "tpot_p50_ms": _median([run["tpot_ms"]["p50"] for run in runs]),
        "per_round_tok_s": [run["output_throughput_tps"] for run in runs],
        "per_round_load_avg_1m": [run["load_avg_1m"] for run in runs],
        "failed": sum(run["failed"] for run in runs),
        "rounds": len(runs),
    }


def _baseline_of(server: str, servers: list[str]) -> str:
    """The fdserve variant a peer is compared with: fdserve-bf16 for a bf16 peer when it was measured."""
    if server.endswith("-bf16") and BASELINE_BF16 in servers:
        return BASELINE_BF16
    return BASELINE


def serving_table(work: str, servers: list[str], concurrency: list[int]) -> list[dict]:
    rows = []
    for c in concurrency:
        row: dict[str, Any] = {"concurrency": c}
        for server in servers:
            row[server] = serving_cell(_load_runs(os.path.join(work, f"{server}.c{c}.r*.json")))
        for server in servers:
            base = row.get(_baseline_of(server, servers))
            if base is not None and not server.startswith(BASELINE):
                row[server]["fdserve_over_peer_tok_s"] = _ratio(base["tok_s"], row[server]["tok_s"])
                row[server]["fdserve_over_peer_ttft"] = _ratio(base["ttft_p50_ms"], row[server]["ttft_p50_ms"])
        rows.append(row)
    return rows


def greedy_summary(work: str, servers: list[str]) -> dict[str, str]:
    summary = {}
    for server in servers:
        path = os.path.join(work, f"{server}.greedy.json")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as handle:
                report = json.load(handle)
            summary[server] = f"{report['matched']}/{report['total']}"
        else:
            summary[server] = "not checked"
    return summary


def ttft_table(work: str, servers: list[str], lengths: list[int]) -> list[dict]:
    """Per prompt length: median single-request TTFT per server (s) and fdserve / each peer."""
    rows = []
    for length in lengths:
        row: dict[str, Any] = {"prompt_tokens": length}
        for server in servers:
            runs = _load_runs(os.path.join(work, f"{server}.ttft.L{length}.r*.json"))
            p50 = _median([run["ttft_ms"]["p50"] for run in runs])
            row[server] = {"ttft_s": round(p50 / 1000.0, 3) if p50 is not None else None,
                           "failed": sum(run["failed"] for run in runs), "rounds": len(runs),
                           "per_round_load_avg_1m": [run["load_avg_1m"] for run in runs]}
        for server in servers:
            if server != BASELINE and BASELINE in row:
                row[server]["fdserve_over_peer"] = _ratio(row[BASELINE]["ttft_s"], row[server]["ttft_s"])
        rows.append(row)
    return rows


def print_serving_markdown(rows: list[dict], servers: list[str], greedy: dict[str, str]) -> None:
    head = "| server | " + " | ".join(f"c={row['concurrency']} tok/s (fdserve/peer)" for row in rows)
    head += f" | TTFT p50 at c={rows[-1]['concurrency']} | greedy = reference |"
    print(head, file=sys.stderr)
    print("|---" * (len(rows) + 3) + "|", file=sys.stderr)
    for server in servers:
        cells = []
        for row in rows:
            cell = row[server]
            ratio = cell.get("fdserve_over_peer_tok_s")
            cells.append(f"{cell['tok_s']}" + (f" ({ratio})" if ratio is not None else ""))
        ttft = rows[-1][server]["ttft_p50_ms"]
        ttft_text = f"{ttft:.0f} ms" if ttft is not None else "n/a"
        print(f"| {server} | " + " | ".join(cells) + f" | {ttft_text} | {greedy.get(server, '')} |", file=sys.stderr)


def print_ttft_markdown(rows: list[dict], servers: list[str]) -> None:
    print("| prompt tokens | " + " | ".join(str(row["prompt_tokens"]) for row in rows) + " |", file=sys.stderr)
    print("|---" * (len(rows) + 1) + "|", file=sys.stderr)
    for server in servers:
        cells = [f"{row[server]['ttft_s']} s" if row[server]["ttft_s"] is not None else "n/a" for row in rows]
        print(f"| {server} | " + " | ".join(cells) + " |", file=sys.stderr)
    for server in servers:
        if server != BASELINE:
            cells = [str(row[server].get("fdserve_over_peer")) for row in rows]
            print(f"| fdserve / {server} | " + " | ".join(cells) + " |", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("serving", "ttft"))
    parser.add_argument("work")
    parser.add_argument("--servers", required=True, help="space-separated server names, as in the file names")
    parser.add_argument("--concurrency", default="1 8 32")
    parser.add_argument("--lengths", default="512 1024 2048 4096 7680")
    parser.add_argument("--setup", default="{}", help="JSON object describing the run, copied into the report")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    servers = args.servers.split()
    report: dict[str, Any] = {"setup": json.loads(args.setup),
                              "ratios": "fdserve over peer; a -bf16 peer is compared with fdserve-bf16 if measured"}
    if args.mode == "serving":
        rows = serving_table(args.work, servers, [int(c) for c in args.concurrency.split()])
        report["greedy_matches_reference"] = greedy_summary(args.work, servers)
        report["results"] = rows
        print_serving_markdown(rows, servers, report["greedy_matches_reference"])
    else:
        rows = ttft_table(args.work, servers, [int(length) for length in args.lengths.split()])
        report["results"] = rows
        print_ttft_markdown(rows, servers)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            handle.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
