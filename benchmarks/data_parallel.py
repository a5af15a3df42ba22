#!/usr/bin/env python3
"""Data-parallel benchmark: output tok/s of DP=2 against DP=1 on the dense default model, in one run.

Owns the "DP+EP" throughput comparison. Three server set-ups get the same request set (``benchmarks/serving.py``:
by default 128 requests, concurrency 64, 64 prompt / 64 output tokens, ``ignore_eos``, streamed):

- ``dp2_t1``: ``--data-parallel-size 2 --num-threads 1`` (two engine replicas, one compute thread each);
- ``dp1_t1``: ``--num-threads 1`` (the same per-rank compute: the fair baseline for the DP speed-up);
- ``dp1_t2``: ``--num-threads 2`` (one replica using both cores: what DP=2 must beat to be worth it here).

Each set-up is started fresh (its own port, instance id and process group), measured, and stopped; the order
alternates between rounds (A B C, then C B A, ...) so a drift in the machine's load hits every set-up alike.
Besides tok/s, each run records the load average, the cores the server's processes actually got during the
measured load (CPU seconds / wall seconds: on a shared machine the main source of noise) and the output tokens
per CPU second. The warm-up requests (``--warmup``, other prompts) run before the measurement starts.
Reported: per set-up mean and median output tok/s; ratios DP2/DP1(1 thread) (target >= 1.7) and
DP2/DP1(2 threads) from the means and per round. JSON on stdout and in ``--out``.

    python benchmarks/data_parallel.py --rounds 2 --out benchmarks/results/data_parallel.json
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
# The server lifecycle (process group, instance id, clean stop) is harness.server.ServerProcess, through the
# load test's subclass, which adds the stop report both benchmarks write into their JSON.
from load_test import ROOT, Server, process_tree, raise_interrupt  # noqa: E402

logger = logging.getLogger(__name__)

SETUPS: dict[str, list[str]] = {
    "dp1_t1": ["--num-threads", "1"],
    "dp2_t1": ["--data-parallel-size", "2", "--num-threads", "1"],
    "dp1_t2": ["--num-threads", "2"],
}
TARGET_RATIO = 1.7
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
POLL_INTERVAL_S = 0.5


def get_json(url: str, timeout: float = 10.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def wait_healthy(server: Server, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.exited():
            raise RuntimeError(f"server exited with {server.proc.returncode} during start-up:\n{server.log_tail()}")
        try:
            return get_json(server.base_url + "/health", timeout=2.0)
        except OSError:  # URLError (HTTP 503 included), refused or reset connections, timeouts
            time.sleep(POLL_INTERVAL_S)  # not listening (or not healthy: HTTP 503) yet
    raise TimeoutError(f"server not healthy after {timeout_s:.0f} s:\n{server.log_tail()}")


def cpu_seconds(root_pid: int) -> float:
    """User + system CPU seconds of ``root_pid`` and its live descendants."""
    total = 0
    for pid, _ in process_tree(root_pid):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue  # exited while we looked
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of stat)
    return total / CLOCK_TICKS


def run_serving(port: int, args: argparse.Namespace, num_requests: int, seed: int) -> dict:
    """One ``benchmarks/serving.py`` run against ``port``; its JSON result."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = [sys.executable, str(ROOT / "benchmarks" / "serving.py"), "--port", str(port),
                   "--num-requests", str(num_requests), "--concurrency", str(args.concurrency),
                   "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--ignore-eos",
                   "--seed", str(seed), "--total-timeout", str(args.run_timeout), "--out", out.name]
        done = subprocess.run(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              timeout=args.run_timeout + 60, check=False)
        if not Path(out.name).stat().st_size:
            raise RuntimeError(f"serving.py wrote no result (exit {done.returncode}): {done.stderr[-2000:]!r}")
        return json.loads(Path(out.name).read_text())


def measure(setup: str, args: argparse.Namespace) -> dict:
    """Start the set-up's server, run the serving benchmark against it, stop it; the run's figures."""
    server = Server(["--max-num-seqs", str(args.concurrency), *SETUPS[setup]])
    run: dict = {"setup": setup, "server_args": SETUPS[setup], "load_average_1m_before": os.getloadavg()[0]}
    try:
        server.launch()
        health = wait_healthy(server, args.start_timeout)
        run["data_parallel_size"] = health.get("data_parallel_size", 1)
        if args.warmup:
            # Other prompts (seed + 1) than the measured ones, so the measurement starts with a cold prefix cache.
            run_serving(server.port, args, args.warmup, args.seed + 1)
        cpu_before, started = cpu_seconds(server.proc.pid), time.monotonic()
        result = run_serving(server.port, args, args.num_requests, args.seed)
        wall, cpu = time.monotonic() - started, cpu_seconds(server.proc.pid) - cpu_before
        health = get_json(server.base_url + "/health")
        run.update({
            "output_tokens_per_s": result["output_throughput_tps"],
            "completed": result["completed"], "failed": result["failed"], "errors": result["errors"],
            "duration_s": result["duration_s"], "total_output_tokens": result["total_output_tokens"],
            "tpot_ms_p50": result["tpot_ms"]["p50"], "ttft_ms_p50": result["ttft_ms"]["p50"],
            # The cores the server actually got during the measured load, and what it made of each CPU second.
            "server_cpu_cores_used": round(cpu / wall, 2) if wall > 0 else None,
            "output_tokens_per_cpu_s": round(result["total_output_tokens"] / cpu, 2) if cpu > 0 else None,
            "steps_per_rank": [r["scheduler"]["num_steps"] for r in health.get("ranks", [health])],
            "load_average_1m_after": os.getloadavg()[0],
        })
    except (OSError, RuntimeError, TimeoutError, subprocess.TimeoutExpired, ValueError, KeyError) as exc:
        logger.error("%s: run failed: %s", setup, exc)
        run["error"] = f"{type(exc).__name__}: {exc}"[:2000]
    finally:
        run["shutdown"] = server.stop_and_report(args.stop_timeout)
    if run.get("error") or run.get("failed"):
        run["server_log"] = str(server.log_path)
    else:
        server.remove_log()
    logger.info("%s: %s output tok/s (server used %s cores, load average %.1f)", setup,
                run.get("output_tokens_per_s"), run.get("server_cpu_cores_used"), run["load_average_1m_before"])
    return run


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return round(numerator / denominator, 3) if numerator and denominator else None


def mean_of(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return round(statistics.mean(values), 2) if values else None


def summarize(runs: list[dict], rounds: int) -> dict:
    good = [r for r in runs if r.get("output_tokens_per_s") and not r.get("failed") and not r.get("error")]
    by_setup = {name: [r for r in good if r["setup"] == name] for name in SETUPS}
    means = {name: mean_of(v, "output_tokens_per_s") for name, v in by_setup.items()}
    per_round = []
    for r in range(rounds):
        tps = {run["setup"]: run.get("output_tokens_per_s") for run in runs if run["round"] == r}
        per_round.append({"round": r, "dp2_over_dp1_t1": ratio(tps.get("dp2_t1"), tps.get("dp1_t1")),
                          "dp2_over_dp1_t2": ratio(tps.get("dp2_t1"), tps.get("dp1_t2"))})
    dp2_vs_t1 = ratio(means["dp2_t1"], means["dp1_t1"])
    return {
        "output_tokens_per_s": {
            name: {"runs": [r["output_tokens_per_s"] for r in v], "mean": means[name],
                   "median": round(statistics.median(r["output_tokens_per_s"] for r in v), 2) if v else None,
                   "server_cpu_cores_used_mean": mean_of(v, "server_cpu_cores_used"),
                   "output_tokens_per_cpu_s_mean": mean_of(v, "output_tokens_per_cpu_s")}
            for name, v in by_setup.items()},
        "ratio_dp2_over_dp1_1thread": dp2_vs_t1,
        "ratio_dp2_over_dp1_2threads": ratio(means["dp2_t1"], means["dp1_t2"]),
        "target_ratio_dp2_over_dp1_1thread": TARGET_RATIO,
        "meets_target": dp2_vs_t1 is not None and dp2_vs_t1 >= TARGET_RATIO,
        "per_round": per_round,
        "all_runs_ok": len(good) == len(runs),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--rounds", type=int, default=2, help="each set-up runs once per round; order alternates")
    # Concurrency 64 by default: data parallelism is for throughput under load, and at 64 each DP=2 rank still
    # decodes a batch of 32. At 32 the ranks get batches of 16, which yield fewer tokens per second per core
    # than DP=1's batch of 32, capping DP2/DP1 near 1.63x whatever the runtime does.
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=64, help="also --max-num-seqs of every server")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=4, help="requests sent and discarded before each measurement")
    parser.add_argument("--seed", type=int, default=0, help="same prompts for every set-up")
    parser.add_argument("--start-timeout", type=float, default=240.0)
    parser.add_argument("--run-timeout", type=float, default=900.0, help="seconds for one serving benchmark")
    parser.add_argument("--stop-timeout", type=float, default=30.0, help="seconds between SIGINT and SIGKILL")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "data_parallel.json"))
    args = parser.parse_args(argv)
    for name in ("rounds", "num_requests", "concurrency", "input_len", "output_len"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, raise_interrupt)  # so each run's `finally` stops its server
    order = list(SETUPS)
    runs: list[dict] = []
    started = time.monotonic()
    try:
        for r in range(args.rounds):
            for setup in (order if r % 2 == 0 else order[::-1]):
                runs.append({"round": r, **measure(setup, args)})
    except KeyboardInterrupt:
        logger.error("interrupted; reporting the runs so far")  # measure() already stopped its server
    report = {
        "config": vars(args),
        "cpu_count": os.cpu_count(),
        "note": "shared 2-core machine: other work ran at the same time; see load averages and server_cpu_cores_used",
        "duration_s": round(time.monotonic() - started, 1),
        "summary": summarize(runs, args.rounds),
        "runs": runs,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0 if report["summary"]["all_runs_ok"] and runs else 1


if __name__ == "__main__":
    sys.exit(main())
