#!/usr/bin/env python3
"""KV-cache lock benchmark: what ``FD_USE_KVCACHE_LOCK=1`` costs.

Owns the measurement of ``inter_communicator.kvcache_lock``:
- uncontended cost of one ``with lock.hold(...)`` (median ns per iteration over rounds), for the
  real lock, the null lock (lock off) and, as a floor, a bare posix_ipc semaphore trywait+post;
- contended throughput: ``--processes`` processes (spawn) each running ``hold()`` in a loop for
  ``--seconds``, copying ``--copy-kib`` KiB inside each hold (a stand-in for a KV block copy; 0:
  empty critical section); holds per second and the lock's own wait/hold counters.

    python benchmarks/lock_bench.py --out benchmarks/results/lock.json

Prints JSON to stdout and writes it to ``--out`` if given.
"""
from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import statistics
import sys
import time
import uuid
from typing import Any, Callable

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

import numpy as np  # noqa: E402
import posix_ipc  # noqa: E402

import envs  # noqa: E402
from inter_communicator.kvcache_lock import KVCacheLock, NullKVCacheLock, kvcache_lock_for  # noqa: E402
from inter_communicator.shm import ipc_name, sweep_stale  # noqa: E402

logger = logging.getLogger(__name__)

SPAWN = multiprocessing.get_context("spawn")
READY_TIMEOUT_S = 60.0


def median_ns_per_call(call: Callable[[], object], iterations: int, rounds: int) -> float:
    """Median over ``rounds`` of the mean time per call in a tight loop of ``iterations`` calls.

    Timing batches instead of single calls keeps the clock's own cost (~60 ns) out of the figure.
    """
    per_call = []
    for _ in range(rounds):
        begin = time.perf_counter_ns()
        for _ in range(iterations):
            call()
        per_call.append((time.perf_counter_ns() - begin) / iterations)
    return statistics.median(per_call)


def uncontended(instance_id: str, iterations: int, rounds: int) -> dict[str, float]:
    lock = KVCacheLock.attach(instance_id, 0, "benchmark")
    null = NullKVCacheLock("benchmark")
    bare = posix_ipc.Semaphore("/" + ipc_name(instance_id, "lock_bench_bare"), posix_ipc.O_CREX, mode=0o600,
                               initial_value=1)
    try:
        def bare_semaphore() -> None:
            bare.acquire(0)
            bare.release()

        def real_hold() -> None:
            with lock.hold("bench"):
                pass

        def real_acquire_release() -> None:
            lock.acquire()
            lock.release()

        def null_hold() -> None:
            with null.hold("bench"):
                pass

        return {
            "bare_semaphore_ns": median_ns_per_call(bare_semaphore, iterations, rounds),
            "null_hold_ns": median_ns_per_call(null_hold, iterations, rounds),
            "real_hold_ns": median_ns_per_call(real_hold, iterations, rounds),
            "real_acquire_release_ns": median_ns_per_call(real_acquire_release, iterations, rounds),
        }
    finally:
        lock.close()
        bare.unlink()
        bare.close()


def _contender(instance_id: str, enabled: bool, seconds: float, copy_kib: int, ready, go, results) -> None:
    lock = kvcache_lock_for(instance_id, 0, "benchmark", enabled=enabled)
    source = np.ones(copy_kib * 1024, dtype=np.uint8)
    target = np.empty_like(source)
    ready.set()
    if not go.wait(READY_TIMEOUT_S):
        raise SystemExit("benchmark start signal never came")
    holds = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with lock.hold("bench"):
            if copy_kib:
                np.copyto(target, source)
        holds += 1
    results.put(holds)
    lock.close()


def contended(instance_id: str, enabled: bool, processes: int, seconds: float, copy_kib: int) -> dict[str, Any]:
    ready = [SPAWN.Event() for _ in range(processes)]
    go, results = SPAWN.Event(), SPAWN.Queue()
    children = [SPAWN.Process(target=_contender, args=(instance_id, enabled, seconds, copy_kib, event, go, results),
                              daemon=True) for event in ready]
    try:
        for child in children:
            child.start()
        for event in ready:
            if not event.wait(READY_TIMEOUT_S):
                raise RuntimeError("a benchmark process did not start")
        go.set()
        counts = [results.get(timeout=seconds + READY_TIMEOUT_S) for _ in children]
        for child in children:
            child.join(READY_TIMEOUT_S)
    finally:
        for child in children:
            if child.is_alive():
                child.kill()
                child.join()
    return {"processes": processes, "seconds": seconds, "copy_kib": copy_kib, "holds": sum(counts),
            "holds_per_process": counts, "holds_per_second": sum(counts) / seconds}


def run(args: argparse.Namespace) -> dict[str, Any]:
    instance_id = f"lockbench-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    sweep_stale(instance_id)
    creator = KVCacheLock.create(instance_id, 0, role="benchmark")
    try:
        report: dict[str, Any] = {
            "benchmark": "kvcache_lock",
            "cores": envs.available_cores(),
            "uncontended": uncontended(instance_id, args.iterations, args.rounds),
        }
        before = creator.stats()
        report["contended_lock_on"] = contended(instance_id, True, args.processes, args.seconds, args.copy_kib)
        after = creator.stats()
        acquisitions = after["acquisitions"] - before["acquisitions"]
        contended_count = after["contended"] - before["contended"]
        report["contended_lock_on"].update({
            "contended_fraction": contended_count / max(acquisitions, 1),
            "mean_wait_us_when_contended": (after["wait_ns_total"] - before["wait_ns_total"]) / max(contended_count, 1)
            / 1000,
            "max_wait_us": after["max_wait_ns"] / 1000,
            "mean_hold_us": (after["hold_ns_total"] - before["hold_ns_total"]) / max(acquisitions, 1) / 1000,
            "recoveries": after["recoveries"],
        })
        report["contended_lock_off"] = contended(instance_id, False, args.processes, args.seconds, args.copy_kib)
        return report
    finally:
        creator.close()
        creator.unlink()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=20000, help="calls per timed round (uncontended)")
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds; the median is reported")
    parser.add_argument("--processes", type=int, default=2, help="contending processes")
    parser.add_argument("--seconds", type=float, default=2.0, help="duration of each contended run")
    parser.add_argument("--copy-kib", type=int, default=0, help="KiB copied inside each contended hold (0: none)")
    parser.add_argument("--out", help="also write the JSON report here")
    args = parser.parse_args()
    logging.basicConfig(level=envs.FD_LOG_LEVEL, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    report = run(args)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
