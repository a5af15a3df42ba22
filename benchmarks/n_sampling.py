#!/usr/bin/env python3
"""n > 1 prefill sharing: time to the first token of the LAST choice, n=4 against n=1, one long prompt.

Owns the figure of issue 12 item 2 (target: n=4 costs at most 1.3x the prefill of n=1). The real
engine (scheduler, KV cache, ZMQ sockets) runs in a thread of this process with its real worker
process (the default model); the benchmark plays the API server on the engine's sockets, so the
time is the engine's, without HTTP. Each run sends one request with a fresh random prompt of
``--prompt-len`` token ids (no prefix-cache hit), ``max_tokens`` 1, and measures from the send to
the first output of every choice; n=1 and n=4 runs alternate (after one warm-up of each) and the
medians are compared. For scale, each round also sends n separate n=1 requests with n distinct
prompts at once (what n prefills cost without sharing; the same prompt n times would be served
by the prefix cache after the first).

    python benchmarks/n_sampling.py [--prompt-len 512] [--n 4] [--runs 5] [--out result.json]

Prints JSON to stdout (and to ``--out``). Exit code 0 when every request completed (a missed
target is reported in the JSON, not an error), 1 when one failed, 2 when the engine did not start.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import random
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
BENCH_DIR = Path(__file__).resolve().parent
for _path in (str(REPO_ROOT), str(BENCH_DIR)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import zmq  # noqa: E402

from config.engine_config import EngineArgs, build_engine_config  # noqa: E402
from config.sampling_params import SamplingParams  # noqa: E402
from engine.engine_process import Engine, EngineAddresses  # noqa: E402
from engine.request import CACHE_STATS, ControlRequest, EngineRequest  # noqa: E402
from inter_communicator.instance_signals import InstanceSignals  # noqa: E402
from inter_communicator.shm import sweep_stale  # noqa: E402
from serving import write_report  # noqa: E402

logger = logging.getLogger(__name__)

TARGET_RATIO = 1.3
TIMEOUT_S = 120.0
# SmolLM2's vocabulary without the special ids at its start: random prompts of ordinary tokens.
TOKEN_RANGE = (100, 49000)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=int, default=512, help="prompt tokens (default 512)")
    parser.add_argument("--n", type=int, default=4, help="choices of the shared request (default 4)")
    parser.add_argument("--runs", type=int, default=5, help="timed runs of each kind after a warm-up (default 5)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    parser.add_argument("--out", default=None, help="also write the JSON report to this file")
    args = parser.parse_args(argv)
    if args.prompt_len < 2 or args.n < 2 or args.runs < 1:
        parser.error("--prompt-len and --n must be at least 2, --runs at least 1")
    return args


class InProcessEngine:
    """The engine in a thread with its real worker process; ``close`` stops and removes everything."""

    def __init__(self, prompt_len: int, n: int) -> None:
        base = build_engine_config(EngineArgs(max_num_seqs=max(8, n), max_num_batched_tokens=max(512, prompt_len)))
        self.config = dataclasses.replace(base, instance_id=f"nsb-{uuid.uuid4().hex[:10]}")
        self.tmp = tempfile.TemporaryDirectory(prefix="fdserve-nsb-")
        self.signals = InstanceSignals(self.config, create=True)
        self.stop_event = threading.Event()
        self.context = zmq.Context()
        self.engine: Engine | None = None
        self.thread: threading.Thread | None = None
        try:
            addresses = EngineAddresses.in_dir(self.tmp.name)
            self.engine = Engine(self.config, addresses, self.stop_event)
            self.requests = self._socket(zmq.PUSH, addresses.requests)
            self.outputs = self._socket(zmq.PULL, addresses.outputs)
            self.control_in = self._socket(zmq.PUSH, addresses.control_requests)
            self.control_out = self._socket(zmq.PULL, addresses.control_replies)
            self.engine.supervisor.start_workers()
            self.thread = threading.Thread(target=self.engine.run, name="engine", daemon=True)
            self.thread.start()
        except BaseException:
            self.close()
            raise

    def _socket(self, kind: int, address: str) -> zmq.Socket:
        sock = self.context.socket(kind)
        sock.connect(address)
        return sock

    def first_token_times(self, request_id: str, prompt: list[int], n: int, separate: bool = False) -> list[float]:
        """Seconds from the send to the first output of each choice: one request with ``n`` choices,
        or (``separate``) ``n`` requests of one choice sent at once, request i with prompt i + 1 ... ."""
        params = SamplingParams(temperature=0, max_tokens=1, n=1 if separate else n, ignore_eos=True)
        keys = [(f"{request_id}-{i}", 0) for i in range(n)] if separate else [(request_id, i) for i in range(n)]
        started = time.perf_counter()
        for i, rid in enumerate(sorted({rid for rid, _ in keys})):
            # Distinct prompts for separate requests: a shared prompt would be a prefix-cache hit.
            distinct = [(token + i) % TOKEN_RANGE[1] or TOKEN_RANGE[0] for token in prompt]
            self.requests.send_pyobj(EngineRequest(rid, distinct, params))
        first: dict[tuple[str, int], float] = {}
        finished: set[tuple[str, int]] = set()
        while len(finished) < n:
            if not self.outputs.poll(int(TIMEOUT_S * 1000)):
                raise TimeoutError(f"{request_id}: no output within {TIMEOUT_S} s")
            now = time.perf_counter()
            for out in self.outputs.recv_pyobj():
                if out.error:
                    raise RuntimeError(f"{out.request_id} choice {out.index} failed: {out.error}")
                first.setdefault((out.request_id, out.index), now - started)
                if out.finished:
                    finished.add((out.request_id, out.index))
        return [first[key] for key in keys]

    def cache_stats(self) -> dict[str, Any]:
        self.control_in.send_pyobj(ControlRequest("stats", CACHE_STATS))
        if not self.control_out.poll(int(TIMEOUT_S * 1000)):
            raise TimeoutError("no cache stats reply")
        return self.control_out.recv_pyobj().to_json()

    def close(self) -> None:
        self.stop_event.set()
        if self.thread is not None:
            self.thread.join(30)
        if self.engine is not None:
            self.engine.supervisor.stop_workers()
        self.context.destroy(linger=0)
        if self.engine is not None:
            self.engine.close()
        self.signals.close()
        self.signals.unlink()
        sweep_stale(self.config.instance_id)
        self.tmp.cleanup()


def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    engine = InProcessEngine(args.prompt_len, args.n)
    try:
        kinds = ("n=1", f"n={args.n}", f"{args.n} separate")
        times: dict[str, list[float]] = {kind: [] for kind in kinds}
        for run in range(args.runs + 1):  # run 0 warms every path up and is not counted
            for kind in kinds:
                # A fresh prompt each time: the prefix cache must not serve any of it.
                prompt = [rng.randrange(*TOKEN_RANGE) for _ in range(args.prompt_len)]
                n = 1 if kind == "n=1" else args.n
                first = engine.first_token_times(f"{kind}-{run}".replace(" ", "-").replace("=", ""), prompt, n,
                                                 separate=kind.endswith("separate"))
                if run > 0:
                    times[kind].append(round(max(first), 4))  # the last choice's first token
        stats = engine.cache_stats()
    finally:
        engine.close()
    medians = {kind: statistics.median(values) for kind, values in times.items()}
    ratio = medians[f"n={args.n}"] / medians["n=1"]
    return {
        "benchmark": "n_sampling",
        "prompt_len": args.prompt_len,
        "n": args.n,
        "runs": args.runs,
        "ttft_last_choice_s": times,
        "median_s": {kind: round(value, 4) for kind, value in medians.items()},
        "ratio": round(ratio, 3),
        "separate_ratio": round(medians[f"{args.n} separate"] / medians["n=1"], 3),
        "target_ratio": TARGET_RATIO,
        "target_met": ratio <= TARGET_RATIO,
        "fork_shared_blocks": stats.get("fork_shared_blocks"),
        "fork_copied_blocks": stats.get("fork_copied_blocks"),
    }


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    args = parse_args(argv)
    try:
        report = benchmark(args)
    except (TimeoutError, RuntimeError) as exc:
        logger.error("benchmark failed: %s", exc)
        return 1
    except OSError as exc:
        logger.error("the engine could not start: %s", exc)
        return 2
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
