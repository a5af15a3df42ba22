"""Single-request time to first token by prompt length, for server variants that differ by environment.

This script owns the "TTFT by prompt length" table of issue 15. Per round and variant it starts a
server (``launch.py --no-enable-prefix-caching --max-model-len 8192`` plus ``--server-args``) with the
variant's environment, waits for /health, and for each length runs ``benchmarks/serving.py`` with
one request at a time (``--requests`` requests, the first length of each server also one warm-up
request), then stops the server. Variants alternate within each round so machine load hits them
alike; the report has the median TTFT per variant and length and the ratio to the first variant.

    python benchmarks/ttft_by_length.py [--lengths "512 1024 2048 4096 7680"] [--requests 2] [--rounds 1]
        [--variants "paddle:FD_NATIVE_KERNELS=0 native:FD_NATIVE_KERNELS=1"] [--out ttft.json]

``--in-process`` measures the same prefills without a server (what TTFT is made of on an idle server):
the model forward over the prompt in chunks of ``--chunk`` tokens (the server's default
--max-num-batched-tokens), plus the LM head on the last row, per variant alternating within each
length, reporting wall time and process CPU time (less sensitive to other jobs time-slicing the cores).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Any

from model_setup import write_report

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEALTH_TIMEOUT_S = 900.0
STOP_TIMEOUT_S = 60.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="512 1024 2048 4096 7680")
    parser.add_argument("--requests", type=int, default=2, help="timed requests per length")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--variants", default="paddle:FD_NATIVE_KERNELS=0 native:FD_NATIVE_KERNELS=1",
                        help="space-separated name:VAR=value[,VAR=value] entries")
    parser.add_argument("--server-args", default="", help="extra launch.py arguments")
    parser.add_argument("--in-process", action="store_true", help="time the model's chunked prefill, no server")
    parser.add_argument("--chunk", type=int, default=512, help="--in-process: prefill tokens per step")
    parser.add_argument("--threads", type=int, default=0, help="--in-process: compute threads (0: all cores)")
    parser.add_argument("--out", default=None)
    return parser.parse_args(argv)


def parse_variants(text: str) -> list[tuple[str, dict[str, str]]]:
    variants = []
    for entry in text.split():
        name, _, assignments = entry.partition(":")
        env = dict(item.split("=", 1) for item in assignments.split(",") if item)
        variants.append((name, env))
    return variants


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(port: int, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except (urllib.error.URLError, OSError):
            time.sleep(1.0)
    raise RuntimeError(f"server not healthy after {HEALTH_TIMEOUT_S:.0f} s")


def stop(process: subprocess.Popen) -> None:
    """SIGTERM the server's process group, then SIGKILL it if it has not exited in time."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def ttft_ms(port: int, length: int, requests: int, warmup: int, seed: int) -> float:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, os.path.join(REPO_ROOT, "benchmarks", "serving.py"), "--port", str(port),
                        "--num-requests", str(requests), "--concurrency", "1", "--input-len", str(length),
                        "--output-len", "4", "--ignore-eos", "--stream", "--warmup", str(warmup), "--seed", str(seed),
                        "--out", out.name], check=True, stdout=subprocess.DEVNULL, timeout=3600)
        report = json.load(open(out.name, encoding="utf-8"))
    if report.get("failed"):
        raise RuntimeError(f"{report['failed']} requests failed at length {length}")
    return float(report["ttft_ms"]["p50"])


def measure(name: str, env: dict[str, str], args: argparse.Namespace, lengths: list[int], round_index: int,
            log_dir: str) -> dict[int, float]:
    port = free_port()
    command = [sys.executable, "launch.py", "--host", "127.0.0.1", "--port", str(port), "--no-enable-prefix-caching",
               "--max-model-len", "8192", *args.server_args.split()]
    with open(os.path.join(log_dir, f"{name}.r{round_index}.log"), "wb") as log:
        process = subprocess.Popen(command, cwd=REPO_ROOT, env={**os.environ, **env}, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        try:
            started = time.monotonic()
            wait_healthy(port, process)
            print(f"[{name} round {round_index}] healthy after {time.monotonic() - started:.0f} s", file=sys.stderr)
            results = {}
            for index, length in enumerate(lengths):
                results[length] = ttft_ms(port, length, args.requests, 1 if index == 0 else 0,
                                          seed=100 * round_index + length)
                print(f"[{name} round {round_index}] {length} tokens: TTFT {results[length]:.0f} ms", file=sys.stderr)
            return results
        finally:
            stop(process)


def in_process(args: argparse.Namespace, lengths: list[int], variants: list[tuple[str, dict[str, str]]]) -> dict:
    """Chunked prefill of each length per variant (environment applied in-process: envs reads lazily)."""
    sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))
    from model_setup import contiguous_cache, load_model

    loaded = load_model(argparse.Namespace(model=None, threads=args.threads))
    import numpy as np
    import paddle

    from worker.attention import build_attention_metadata

    block_size = 64
    kv_caches, tables = contiguous_cache(loaded.config, 1, max(lengths), block_size)
    rng = np.random.default_rng(0)

    def prefill(ids: np.ndarray) -> None:
        for start in range(0, len(ids), args.chunk):
            chunk = ids[start: start + args.chunk]
            meta = build_attention_metadata([len(chunk)], [start + len(chunk)], [tables[0]], block_size)
            hidden = loaded.model(paddle.to_tensor(chunk), meta.positions, kv_caches, meta)
            loaded.model.compute_logits(paddle.index_select(hidden, meta.last_token_indices)).numpy()

    saved = {name: os.environ.get(name) for _, env in variants for name in env}
    rows: dict[str, dict[str, dict[str, float]]] = {name: {} for name, _ in variants}
    try:
        with paddle.no_grad():
            prefill(rng.integers(0, loaded.config.vocab_size, size=min(lengths), dtype=np.int64))  # warm-up
            for length in lengths:
                ids = rng.integers(0, loaded.config.vocab_size, size=length, dtype=np.int64)
                walls: dict[str, list[float]] = {name: [] for name, _ in variants}
                cpus: dict[str, list[float]] = {name: [] for name, _ in variants}
                for round_index in range(args.rounds):
                    order = variants if round_index % 2 == 0 else list(reversed(variants))
                    for name, env in order:
                        os.environ.update(env)
                        wall, cpu = time.perf_counter(), time.process_time()
                        prefill(ids)
                        walls[name].append(time.perf_counter() - wall)
                        cpus[name].append(time.process_time() - cpu)
                for name, _ in variants:
                    rows[name][str(length)] = {"wall_s": round(statistics.median(walls[name]), 3),
                                               "cpu_s": round(statistics.median(cpus[name]), 3)}
                print(f"{length} tokens: " + ", ".join(f"{name} {rows[name][str(length)]}" for name, _ in variants),
                      file=sys.stderr)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    first = variants[0][0]
    ratios = {name: {length: round(rows[first][length]["wall_s"] / row["wall_s"], 2) for length, row in per.items()}
              for name, per in rows.items() if name != first}
    return {"mode": "in-process chunked prefill", "chunk": args.chunk, "threads": loaded.threads,
            "lengths": lengths, "rounds": args.rounds, "variants": {name: env for name, env in variants},
            "prefill": rows, f"wall_speedup_vs_{first}": ratios}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    lengths = [int(value) for value in args.lengths.split()]
    variants = parse_variants(args.variants)
    if args.in_process:
        report = in_process(args, lengths, variants)
        print(json.dumps(report, indent=1))
        if args.out:
            with open(args.out, "w", encoding="utf-8") as handle:
                json.dump(report, handle, indent=1)
        return report
    samples: dict[str, dict[int, list[float]]] = {name: {length: [] for length in lengths} for name, _ in variants}
    log_dir = tempfile.mkdtemp(prefix="fdserve-ttft-")
    for round_index in range(args.rounds):
        order = variants if round_index % 2 == 0 else list(reversed(variants))
        for name, env in order:
            for length, value in measure(name, env, args, lengths, round_index, log_dir).items():
                samples[name][length].append(value)
    first = variants[0][0]
    table = {name: {str(length): round(statistics.median(values), 1) for length, values in per_length.items()}
             for name, per_length in samples.items()}
    ratios = {name: {length: round(table[first][length] / value, 2) for length, value in row.items()}
              for name, row in table.items() if name != first}
    report = {"lengths": lengths, "requests_per_length": args.requests, "rounds": args.rounds,
              "variants": {name: env for name, env in variants}, "ttft_ms_p50": table,
              f"speedup_vs_{first}": ratios, "server_logs": log_dir}
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
