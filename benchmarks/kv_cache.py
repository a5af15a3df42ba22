#!/usr/bin/env python3
"""KV-cache benchmark: prefix-hit TTFT per tier, and the throughput cost of ``FD_USE_KVCACHE_LOCK``.

Owns the end-to-end measurement of the KV-cache tiers of a real fdserve server, in one run:

1. TTFT of one long prompt (``--prefix-len`` random token ids + a few distinct suffix tokens,
   ``max_tokens`` 1, not streamed: the response time *is* the time to the first token) on ONE
   server with a host tier and the file storage backend, ``--repetitions`` times each:
   - cold: a prefix never seen (a new random prefix every repetition);
   - device hit: the same prefix again right away (``cached_tokens`` must cover the prefix);
   - storage hit: after every write-through to storage finished and ``POST /v1/cache/reset``
     dropped the device and host tiers, the prefix again; it must come back from storage
     (``cached_tokens`` > 0 and ``storage_hit_tokens`` of ``GET /v1/cache/stats`` grew).
   Medians and the ratios device/cold and storage/cold (targets 0.1 and 0.25).
2. Output tokens/s of one request set (shared prefixes in groups that come back, so swap-outs,
   swap-ins and write-backs happen; ``ignore_eos``, fixed output length) against servers with
   ``FD_USE_KVCACHE_LOCK=0`` and ``=1``, started one after the other in alternating order
   (off, on, off, on, ...) to spread the noise of a shared machine; medians, on/off ratio
   (target >= 0.99), and the lock's wait/hold counters of each ``on`` run. ``--lock-rounds``
   off+on pairs (default 3); pairs after the second are skipped if they would overrun
   ``--time-budget`` (default 600 s), so a loaded machine still finishes in about that time.

    python benchmarks/kv_cache.py --out benchmarks/results/kv_cache.json
    python benchmarks/kv_cache.py --quick          # smoke run, under 3 minutes on 2 cores

Every server runs in its own process group with a unique instance id and its own storage
directory; it is stopped (SIGINT, then SIGKILL of the group) on every exit path, its temporary
files are removed, and its /dev/shm names are checked (leftovers are reported and removed).
Prints JSON to stdout and writes it to ``--out`` if given. Exit code: 0 when every request and
every check passed (targets missed are reported in the JSON, not an error), 1 when a check or
request failed, 2 when a server could not be started, 130 when interrupted (SIGINT/SIGTERM).
A SIGKILLed benchmark cannot clean up: its servers still get SIGTERM from the kernel (parent-death
signal) and remove their /dev/shm names, but /tmp/fdserve-kvb* directories stay behind.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import signal
import statistics
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import FrameType
from typing import Any

import aiohttp

REPO_ROOT = Path(__file__).resolve().parents[1]
BENCH_DIR = Path(__file__).resolve().parent
for _path in (str(REPO_ROOT), str(BENCH_DIR)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import serving as serving_bench  # noqa: E402  (benchmarks/serving.py: the load generator)
from harness.server import ServerProcess  # noqa: E402  (needs REPO_ROOT on sys.path)

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 240.0
STOP_TIMEOUT_S = 20.0
CONTROL_TIMEOUT_S = 30.0
STORAGE_SETTLE_TIMEOUT_S = 60.0
POLL_INTERVAL_S = 0.1
LOG_TAIL_LINES = 40
TTFT_TARGETS = {"device_hit_over_cold": 0.10, "storage_hit_over_cold": 0.25}
LOCK_TARGET_ON_OVER_OFF = 0.99
MIN_LOCK_ROUNDS = 2  # off+on pairs always run, whatever the time budget
SUFFIX_LEN = 3


class BenchmarkError(RuntimeError):
    """A check of the benchmark failed (the measured condition did not happen as required)."""


class ServerStartError(RuntimeError):
    """A server did not become healthy."""


# ---------------------------------------------------------------------------------------------
# Servers


class Server(ServerProcess):
    """One ``launch.py`` with a unique instance id, a temporary storage dir and log; a context manager.

    The lifecycle (process group, parent-death signal, stop, /dev/shm sweep into ``leftovers``, removal of the
    temporary dir) is ``harness.server.ServerProcess``; this adds the label and the JSON helpers.
    """

    def __init__(self, server_args: list[str], lock: bool, label: str) -> None:
        # The child's environment is assembled here; the server reads it through envs.py.
        super().__init__(*server_args, env={"FD_USE_KVCACHE_LOCK": "1" if lock else "0"}, id_prefix="kvb",
                         temp_storage=True, die_with_parent=True)
        self.label = label

    def start(self, timeout: float = START_TIMEOUT_S) -> "Server":
        self.launch()
        logger.info("%s: starting server pid %d on port %d (instance %s)", self.label, self.proc.pid, self.port,
                    self.instance_id)
        try:
            self.wait_healthy(timeout)
        except (RuntimeError, TimeoutError) as exc:
            raise ServerStartError(f"{self.label}: {exc}") from exc
        return self

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        return super().log_tail(lines)

    def close(self, timeout: float = STOP_TIMEOUT_S) -> None:
        super().close(timeout)
        for name in self.leftovers:
            logger.error("server of instance %s left /dev/shm/%s behind; it was removed", self.instance_id, name)

    # --- HTTP helpers ---------------------------------------------------------------------

    def get_json(self, path: str) -> dict:
        with urllib.request.urlopen(self.base_url + path, timeout=CONTROL_TIMEOUT_S) as resp:
            return json.loads(resp.read())

    def post_json(self, path: str, body: dict | None = None, timeout: float = CONTROL_TIMEOUT_S) -> dict:
        data = json.dumps(body or {}).encode()
        request = urllib.request.Request(self.base_url + path, data=data, method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:300].decode(errors="replace")
            raise BenchmarkError(f"{self.label}: POST {path} answered HTTP {exc.code}: {detail}") from exc


# ---------------------------------------------------------------------------------------------
# Part 1: TTFT per tier


def random_ids(rng: random.Random, count: int) -> list[int]:
    low, high = serving_bench.TOKEN_ID_RANGE
    return [rng.randrange(low, high) for _ in range(count)]


def timed_completion(server: Server, model: str, prompt: list[int], timeout: float) -> tuple[float, int]:
    """(seconds to the response of a 1-token completion, cached_tokens); the one token is the first token."""
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0}
    start = time.perf_counter()
    reply = server.post_json("/v1/completions", body, timeout=timeout)
    elapsed = time.perf_counter() - start
    usage = reply.get("usage") or {}
    if usage.get("completion_tokens") != 1:
        raise BenchmarkError(f"{server.label}: expected 1 completion token, got usage {usage}")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is None:
        raise BenchmarkError(f"{server.label}: usage.prompt_tokens_details.cached_tokens missing: {usage}")
    return elapsed, int(cached)


def wait_storage_settled(server: Server, min_blocks_known: int) -> dict:
    """Block until write-through finished: ``storage_blocks_known`` reached and no transfer in flight."""
    deadline = time.monotonic() + STORAGE_SETTLE_TIMEOUT_S
    stats = server.get_json("/v1/cache/stats")
    while time.monotonic() < deadline:
        if stats["storage_blocks_known"] >= min_blocks_known and stats["transfers_in_flight"] == 0:
            return stats
        time.sleep(POLL_INTERVAL_S)
        stats = server.get_json("/v1/cache/stats")
    raise BenchmarkError(f"{server.label}: write-through did not finish within {STORAGE_SETTLE_TIMEOUT_S:.0f} s "
                         f"(wanted storage_blocks_known >= {min_blocks_known} and no transfer in flight): {stats}")


def ttft_repetition(server: Server, model: str, prefix: list[int], rng: random.Random, full_hit: int,
                    block_size: int, timeout: float) -> dict[str, Any]:
    """One cold / device-hit / storage-hit triple on a fresh ``prefix``; raises if a tier was not used."""
    suffixes = [random_ids(rng, SUFFIX_LEN) for _ in range(3)]
    known_before = server.get_json("/v1/cache/stats")["storage_blocks_known"]
    cold_s, cold_cached = timed_completion(server, model, prefix + suffixes[0], timeout)
    if cold_cached != 0:
        raise BenchmarkError(f"cold request hit the cache ({cold_cached} tokens): the prefix was not new")

    device_s, device_cached = timed_completion(server, model, prefix + suffixes[1], timeout)
    if device_cached < full_hit:
        raise BenchmarkError(f"device hit: cached_tokens {device_cached} < {full_hit} (the whole prefix's blocks)")

    # The cold request's prefix blocks must all be in storage before the reset, or the reload would miss.
    before = wait_storage_settled(server, min_blocks_known=known_before + full_hit // block_size)
    server.post_json("/v1/cache/reset")
    storage_s, storage_cached = timed_completion(server, model, prefix + suffixes[2], timeout)
    after = server.get_json("/v1/cache/stats")
    grown = after["storage_hit_tokens"] - before["storage_hit_tokens"]
    if storage_cached <= 0 or grown <= 0:
        raise BenchmarkError(f"storage hit not observed after /v1/cache/reset: cached_tokens {storage_cached}, "
                             f"storage_hit_tokens grew by {grown} (stats before {before}, after {after})")
    if after["device_hit_tokens"] != before["device_hit_tokens"] or after["host_hit_tokens"] != before["host_hit_tokens"]:
        raise BenchmarkError(f"after /v1/cache/reset the prefix was found in the device or host tier: before {before}, "
                             f"after {after}")
    return {"cold_s": cold_s, "device_hit_s": device_s, "storage_hit_s": storage_s,
            "cached_tokens": {"cold": cold_cached, "device_hit": device_cached, "storage_hit": storage_cached},
            "storage_hit_tokens_grew": grown}


def measure_ttft(args: argparse.Namespace) -> dict[str, Any]:
    server_args = ["--block-size", str(args.block_size), "--swap-space", str(args.swap_space)]
    full_hit = args.prefix_len // args.block_size * args.block_size
    if full_hit == 0:
        raise BenchmarkError(f"--prefix-len {args.prefix_len} is shorter than one block ({args.block_size} tokens)")
    rng = random.Random(args.seed)
    reps: list[dict[str, Any]] = []
    with Server(server_args, lock=False, label="ttft") as server:
        model = server.get_json("/v1/models")["data"][0]["id"]
        # First requests of a fresh server pay one-off costs (allocator growth, lazy init): not part of TTFT.
        for _ in range(args.ttft_warmup):
            timed_completion(server, model, random_ids(rng, args.prefix_len + SUFFIX_LEN), args.request_timeout)
        for rep in range(args.repetitions):
            result = ttft_repetition(server, model, random_ids(rng, args.prefix_len), rng, full_hit,
                                     args.block_size, args.request_timeout)
            logger.info("ttft repetition %d: cold %.3f s, device hit %.3f s, storage hit %.3f s", rep + 1,
                        result["cold_s"], result["device_hit_s"], result["storage_hit_s"])
            reps.append(result)
        final_stats = server.get_json("/v1/cache/stats")
    leftovers = server.leftovers
    if leftovers:
        raise BenchmarkError(f"ttft server left /dev/shm entries behind: {leftovers}")
    return summarize_ttft(args, server_args, reps, final_stats, full_hit)


def summarize_ttft(args: argparse.Namespace, server_args: list[str], reps: list[dict[str, Any]],
                   final_stats: dict, full_hit: int) -> dict[str, Any]:
    medians = {kind: statistics.median(r[f"{kind}_s"] for r in reps) for kind in ("cold", "device_hit", "storage_hit")}
    ratios = {"device_hit_over_cold": medians["device_hit"] / medians["cold"],
              "storage_hit_over_cold": medians["storage_hit"] / medians["cold"]}
    return {
        "config": {"server_args": [*server_args, "--kvcache-storage-backend", "file"], "prefix_len": args.prefix_len,
                   "suffix_len": SUFFIX_LEN, "max_tokens": 1, "stream": False, "repetitions": args.repetitions,
                   "warmup_requests": args.ttft_warmup, "expected_cached_tokens": full_hit,
                   "FD_USE_KVCACHE_LOCK": 0},
        "median_ms": {kind: round(value * 1000.0, 2) for kind, value in medians.items()},
        "samples_ms": {kind: [round(r[f"{kind}_s"] * 1000.0, 2) for r in reps]
                       for kind in ("cold", "device_hit", "storage_hit")},
        "cached_tokens": [r["cached_tokens"] for r in reps],
        "ratios": {name: round(value, 4) for name, value in ratios.items()},
        "targets": TTFT_TARGETS,
        "meets_targets": {name: ratios[name] <= target for name, target in TTFT_TARGETS.items()},
        "cache_stats_end": final_stats,
    }


# ---------------------------------------------------------------------------------------------
# Part 2: throughput with the lock off and on


def group_order(num_requests: int, groups: int) -> list[int]:
    """Prefix group of each request: runs of requests per group, every group coming back once.

    A group's prefix goes cold while the other groups run, so it is swapped out (and written to
    storage) and later swapped back in: the transfer process works during the whole load.
    """
    run_len = max(1, num_requests // (2 * groups))
    return [(i // run_len) % groups for i in range(num_requests)]


def build_lock_prompts(args: argparse.Namespace, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [random_ids(rng, args.lock_prefix_len) for _ in range(args.lock_prefix_groups)]
    unique_len = args.lock_input_len - args.lock_prefix_len
    return [prefixes[g] + random_ids(rng, unique_len) for g in group_order(args.lock_num_requests, args.lock_prefix_groups)]


def load_config(args: argparse.Namespace, base_url: str, model: str, label: str) -> serving_bench.Config:
    return serving_bench.Config(
        base_url=base_url, model=model, num_requests=args.lock_num_requests, concurrency=args.lock_concurrency,
        input_len=args.lock_input_len, output_len=args.lock_output_len, shared_prefix_len=args.lock_prefix_len,
        stream=True, ignore_eos=True, seed=args.seed, request_timeout=args.request_timeout,
        total_timeout=args.load_timeout, warmup=args.lock_warmup, label=label,
    )


async def run_load(config: serving_bench.Config, prompts: list[list[int]]) -> dict:
    """``prompts`` through serving.py's bounded load loop; its summary (throughput, TTFT, failures)."""
    connector = aiohttp.TCPConnector(limit=max(config.concurrency, 1))
    async with aiohttp.ClientSession(connector=connector) as session:
        start = time.perf_counter()
        results, timed_out = await serving_bench.run_bounded(session, config, prompts)
        return serving_bench.summarize(config, results, time.perf_counter() - start, timed_out)


def check_load(label: str, report: dict) -> None:
    if report["failed"] or report["timed_out"]:
        raise BenchmarkError(f"{label}: {report['failed']} requests failed (timed out: {report['timed_out']}): "
                             f"{report['errors']}")


class LockStatsReader:
    """The lock's shared counters of a running server, attached from outside (None when the lock is off).

    Used when ``GET /v1/cache/stats`` has no ``kvcache_lock`` entry; reading takes no lock.
    """

    def __init__(self, server: Server, enabled: bool) -> None:
        self._lock = None
        if enabled:
            from inter_communicator.kvcache_lock import KVCacheLock
            self._lock = KVCacheLock.attach(server.instance_id, 0, "benchmark")

    def read(self) -> dict | None:
        return None if self._lock is None else self._lock.stats()

    def close(self) -> None:
        if self._lock is not None:
            self._lock.close()


def lock_window(before: dict | None, after: dict | None) -> dict | None:
    """Counters of the measured window (after - before) plus derived means."""
    if before is None or after is None:
        return None
    keys = ("acquisitions", "contended", "wait_ns_total", "hold_ns_total", "recoveries", "handed_over")
    delta = {key: after[key] - before[key] for key in keys if key in after and key in before}
    acquisitions, contended = delta.get("acquisitions", 0), delta.get("contended", 0)
    delta["mean_hold_us"] = round(delta["hold_ns_total"] / acquisitions / 1000.0, 2) if acquisitions else None
    delta["mean_wait_us_when_contended"] = (round(delta["wait_ns_total"] / contended / 1000.0, 2)
                                            if contended else None)
    delta["max_wait_ms_since_start"] = round(after.get("max_wait_ns", 0) / 1e6, 3)
    delta["max_hold_ms_since_start"] = round(after.get("max_hold_ns", 0) / 1e6, 3)
    return delta


def lock_run(args: argparse.Namespace, lock: bool, index: int, prompts: list[list[int]],
             warmup: list[list[int]]) -> dict[str, Any]:
    label = f"lock-{'on' if lock else 'off'}-{index}"
    loadavg_start = os.getloadavg()
    with Server(lock_server_args(args), lock=lock, label=label) as server:
        model = server.get_json("/v1/models")["data"][0]["id"]
        config = load_config(args, server.base_url, model, label)
        reader = LockStatsReader(server, lock)
        try:
            if warmup:
                check_load(f"{label} warm-up", asyncio.run(run_load(config, warmup)))
            # Counters are read after the warm-up, so the window holds the measured load only.
            stats_before = server.get_json("/v1/cache/stats")
            lock_before = stats_before.get("kvcache_lock") or reader.read()
            report = asyncio.run(run_load(config, prompts))
            stats_after = server.get_json("/v1/cache/stats")
            lock_after = stats_after.get("kvcache_lock") or reader.read()
        finally:
            reader.close()
    if server.leftovers:
        raise BenchmarkError(f"{label}: server left /dev/shm entries behind: {server.leftovers}")
    check_load(label, report)
    window = {key: stats_after[key] - stats_before[key] for key in
              ("swap_out_blocks", "write_back_blocks", "device_hit_tokens", "host_hit_tokens", "storage_hit_tokens",
               "write_back_failed", "transfer_timeouts") if key in stats_after}
    logger.info("%s: %.1f output tok/s, cache window %s", label, report["output_throughput_tps"], window)
    return {
        "label": label, "lock": lock, "output_throughput_tps": report["output_throughput_tps"],
        "loadavg_1m": [round(loadavg_start[0], 2), round(os.getloadavg()[0], 2)],
        "duration_s": report["duration_s"], "completed": report["completed"],
        "ttft_ms_p50": report["ttft_ms"]["p50"], "tpot_ms_p50": report["tpot_ms"]["p50"],
        "cache_window": window, "cache_stats_end": stats_after,
        "kvcache_lock": lock_after, "kvcache_lock_window": lock_window(lock_before, lock_after),
        "kvcache_lock_source": ("cache_stats" if "kvcache_lock" in stats_after else "attached") if lock else None,
    }


def lock_server_args(args: argparse.Namespace) -> list[str]:
    return ["--block-size", str(args.block_size), "--swap-space", str(args.lock_swap_space),
            "--num-gpu-blocks-override", str(args.lock_gpu_blocks), "--max-num-seqs", str(args.lock_concurrency)]


def measure_lock(args: argparse.Namespace, deadline: float) -> dict[str, Any]:
    """Alternating off/on pairs; pairs beyond ``MIN_LOCK_ROUNDS`` are skipped if they would pass ``deadline``."""
    prompts = build_lock_prompts(args, args.seed)
    # Warm-up prompts use other prefixes (another seed) so they leave nothing the measured load could hit.
    warmup = build_lock_prompts(args, args.seed + 1)[:args.lock_warmup]
    runs: list[dict[str, Any]] = []
    order: list[bool] = []
    slowest_pair = 0.0
    for round_index in range(1, args.lock_rounds + 1):
        if round_index > MIN_LOCK_ROUNDS and time.monotonic() + slowest_pair > deadline:
            logger.warning("time budget: skipping lock rounds %d..%d (a pair takes up to %.0f s)", round_index,
                           args.lock_rounds, slowest_pair)
            break
        pair_start = time.monotonic()
        for lock in (False, True):
            runs.append(lock_run(args, lock, round_index, prompts, warmup))
            order.append(lock)
        slowest_pair = max(slowest_pair, time.monotonic() - pair_start)
    off = [r["output_throughput_tps"] for r in runs if not r["lock"]]
    on = [r["output_throughput_tps"] for r in runs if r["lock"]]
    ratio = statistics.median(on) / statistics.median(off)
    window_totals = {key: sum(r["cache_window"].get(key, 0) for r in runs)
                     for key in ("swap_out_blocks", "write_back_blocks", "host_hit_tokens", "storage_hit_tokens")}
    if window_totals["write_back_blocks"] == 0 and window_totals["swap_out_blocks"] == 0:
        raise BenchmarkError(f"the lock load caused no swap-out and no write-back: the transfer process was idle, "
                             f"so the lock was not exercised ({window_totals})")
    return {
        "config": {"server_args": [*lock_server_args(args), "--kvcache-storage-backend", "file"],
                   "num_requests": args.lock_num_requests, "concurrency": args.lock_concurrency,
                   "input_len": args.lock_input_len, "shared_prefix_len": args.lock_prefix_len,
                   "prefix_groups": args.lock_prefix_groups, "output_len": args.lock_output_len,
                   "ignore_eos": True, "stream": True, "warmup_requests": args.lock_warmup,
                   "order": ["on" if lock else "off" for lock in order], "rounds_requested": args.lock_rounds,
                   "rounds_run": len(order) // 2},
        "output_tps": {"off": off, "on": on},
        "median_output_tps": {"off": round(statistics.median(off), 3), "on": round(statistics.median(on), 3)},
        "ratio_on_over_off": round(ratio, 4),
        # Each pair ran back to back, so its ratio is less exposed to slow drifts of the machine's load.
        "paired_ratios": [round(b / a, 4) for a, b in zip(off, on)],
        "median_paired_ratio": round(statistics.median(b / a for a, b in zip(off, on)), 4),
        "target": LOCK_TARGET_ON_OVER_OFF,
        "meets_target": ratio >= LOCK_TARGET_ON_OVER_OFF,
        "cache_window_totals": window_totals,
        "runs": runs,
    }


# ---------------------------------------------------------------------------------------------
# Entry point


QUICK = {"prefix_len": 512, "repetitions": 2, "ttft_warmup": 1, "lock_rounds": 2, "lock_num_requests": 16,
         "lock_concurrency": 8, "lock_input_len": 192, "lock_prefix_len": 128, "lock_prefix_groups": 2,
         "lock_output_len": 16, "lock_gpu_blocks": 32, "lock_warmup": 1}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"smoke run (< 3 min): overrides {sorted(QUICK)}")
    parser.add_argument("--skip-ttft", action="store_true", help="only the lock on/off part")
    parser.add_argument("--skip-lock", action="store_true", help="only the TTFT part")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    parser.add_argument("--load-timeout", type=float, default=600.0, help="seconds for one measured load")
    parser.add_argument("--time-budget", type=float, default=600.0,
                        help=f"seconds; lock rounds beyond {MIN_LOCK_ROUNDS} are skipped if they would exceed it")
    ttft = parser.add_argument_group("TTFT per tier")
    ttft.add_argument("--prefix-len", type=int, default=1024, help="tokens of the long prefix")
    ttft.add_argument("--repetitions", type=int, default=5, help="cold / device / storage triples")
    ttft.add_argument("--ttft-warmup", type=int, default=1, help="requests sent first and discarded")
    ttft.add_argument("--swap-space", type=float, default=1.0, help="GiB of host tier of the TTFT server")
    lock = parser.add_argument_group("throughput with FD_USE_KVCACHE_LOCK off / on")
    lock.add_argument("--lock-rounds", type=int, default=3, help="off+on server pairs, alternating")
    lock.add_argument("--lock-num-requests", type=int, default=64)
    lock.add_argument("--lock-concurrency", type=int, default=16)
    lock.add_argument("--lock-input-len", type=int, default=320, help="prompt tokens (exact)")
    lock.add_argument("--lock-prefix-len", type=int, default=256, help="leading tokens shared inside a group")
    lock.add_argument("--lock-prefix-groups", type=int, default=4, help="distinct shared prefixes")
    lock.add_argument("--lock-output-len", type=int, default=64, help="output tokens (ignore_eos)")
    lock.add_argument("--lock-gpu-blocks", type=int, default=64,
                      help="device KV blocks (small, so cached prefixes are swapped out)")
    lock.add_argument("--lock-swap-space", type=float, default=0.25, help="GiB of host tier")
    lock.add_argument("--lock-warmup", type=int, default=2, help="requests per server sent first and discarded")
    parser.add_argument("--out", default=None, help="write the JSON report here too")
    args = parser.parse_args(argv)
    if args.quick:
        for name, value in QUICK.items():
            setattr(args, name, value)
    validate(parser, args)
    return args


def validate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    positive = ("block_size", "prefix_len", "repetitions", "lock_rounds", "lock_num_requests", "lock_concurrency",
                "lock_input_len", "lock_prefix_groups", "lock_output_len", "lock_gpu_blocks")
    for name in positive:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if not 0 <= args.lock_prefix_len < args.lock_input_len:
        parser.error("--lock-prefix-len must be in [0, --lock-input-len)")
    if args.ttft_warmup < 0 or args.lock_warmup < 0:
        parser.error("warm-up counts must be non-negative")
    if args.swap_space <= 0 or args.lock_swap_space <= 0:
        parser.error("the swap spaces must be positive (the host tier is part of what is measured)")
    if args.request_timeout <= 0 or args.load_timeout <= 0 or args.time_budget <= 0:
        parser.error("timeouts must be positive")
    if args.skip_ttft and args.skip_lock:
        parser.error("--skip-ttft and --skip-lock together leave nothing to run")


def _raise_on_sigterm(signum: int, frame: FrameType | None) -> None:
    # Turn SIGTERM into an exception so the servers' finally blocks stop them.
    raise KeyboardInterrupt(f"signal {signum}")


def run(args: argparse.Namespace) -> tuple[dict[str, Any], int]:
    report: dict[str, Any] = {"benchmark": "kv_cache", "command": [Path(sys.argv[0]).name, *sys.argv[1:]],
                              "quick": args.quick, "cpus": os.cpu_count(), "loadavg_start": os.getloadavg(),
                              "note": "shared 2-core machine: figures are noisy; medians over alternating runs"}
    started = time.monotonic()
    code = 0
    try:
        if not args.skip_ttft:
            report["ttft"] = measure_ttft(args)
        if not args.skip_lock:
            report["lock"] = measure_lock(args, deadline=started + args.time_budget)
    except BenchmarkError as exc:
        logger.error("%s", exc)
        report["error"], code = str(exc), 1
    except ServerStartError as exc:
        logger.error("%s", exc)
        report["error"], code = str(exc), 2
    except (OSError, aiohttp.ClientError, asyncio.TimeoutError) as exc:
        logger.error("talking to a server failed: %s: %s", type(exc).__name__, exc)
        report["error"], code = f"{type(exc).__name__}: {exc}", 1
    except KeyboardInterrupt as exc:
        # The servers were stopped on the way out; report what was measured before the interruption.
        logger.error("interrupted (%s)", str(exc) or "SIGINT")
        report["error"], code = "interrupted", 130
    report["loadavg_end"] = os.getloadavg()
    report["duration_s"] = round(time.monotonic() - started, 1)
    return report, code


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    report, code = run(args)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
