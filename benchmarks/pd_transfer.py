"""KV transfer bandwidth and latency per block for P/D disaggregation (Mooncake transfer engine, TCP).

What a decode instance does when it reads a prefill instance's blocks (cache_manager/pd_transfer.py), between
two processes on this host: a "prefill" process registers a device-layout KV pool
(``[layers, 2, num_blocks, kv_heads, block_size, head_dim]`` float32, SmolLM2-135M's shape by default) with its
transfer engine; this process reads N blocks into its own registered pool with one
``batch_transfer_sync_read`` (one piece per layer plane and run of consecutive block ids), for N in
``--blocks`` and with the peer's blocks contiguous or scattered (every other block: no run merges). The
push direction (``batch_transfer_sync_write``) is measured the same way for comparison, and so is a plain
in-process numpy copy of the same blocks (``local_copy``: the bytes without the transport). Every variant is
repeated ``--repeat`` times, alternating, and reported as the median; the first read of each size is
checked byte for byte.

    python benchmarks/pd_transfer.py [--block-size 64] [--blocks 1 4 16 64] [--repeat 15] [--out FILE.json]

``--serve`` measures the same transfer inside real servers instead: a prefill and a decode ``launch.py``
instance (SmolLM2, ``--block-size``), prompts of about ``--prompt-tokens`` tokens; for each prompt, alternating,
the decode instance's time to first token (streamed) when it computes the prompt itself (its prefix cache
emptied first) against when it reads the prompt's blocks from the prefill instance (the router's second call),
plus the prefill call's own latency.

    python benchmarks/pd_transfer.py --serve [--prompt-tokens 1000] [--repeat 4]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

import numpy as np

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from cache_manager.pd_transfer import KVTransferEngine, block_segments  # noqa: E402

PEER_START_TIMEOUT_S = 60.0


def pool_shape(args: argparse.Namespace, num_blocks: int) -> tuple[int, ...]:
    return (args.layers, 2, num_blocks, args.kv_heads, args.block_size, args.head_dim)


def run_peer(shape: tuple[int, ...], ready: Any, stop: Any) -> None:
    """The prefill side: a registered pool whose every float is its flat index (so a wrong read shows)."""
    pool = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    engine = KVTransferEngine("127.0.0.1")
    address = engine.register(pool)
    ready.put((engine.session, address))
    stop.wait()
    engine.close()


def measure(engine: KVTransferEngine, session: str, segments: tuple[list[int], list[int], list[int]],
            write: bool) -> float:
    started = time.perf_counter()
    if write:
        engine.write(session, *segments)
    else:
        engine.read(session, *segments)
    return time.perf_counter() - started


def local_copy_s(local: np.ndarray, source: np.ndarray, peer_ids: list[int]) -> float:
    """The same blocks copied within one process (numpy gather): what the bytes cost without the network."""
    started = time.perf_counter()
    local[:, :, :len(peer_ids)] = source[:, :, peer_ids]
    return time.perf_counter() - started


def _ttft(url: str, body: dict[str, Any]) -> tuple[float, int]:
    """Seconds to the first streamed token and the usage's cached_tokens."""
    import httpx

    started = time.perf_counter()
    first, cached = None, -1
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True,
                      "stream_options": {"include_usage": True}}, timeout=300) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and any(c["delta"].get("content") for c in chunk["choices"]):
                first = time.perf_counter() - started
            if chunk.get("usage"):
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    if first is None:
        raise RuntimeError("the stream carried no token")
    return first, cached


def serve_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Decode-side TTFT computing the prompt locally against reading it from a prefill instance (see the docstring)."""
    import httpx

    from harness.server import ServerProcess

    common = ("--block-size", str(args.block_size), "--max-model-len", "4096", "--max-num-seqs", "8")
    words = "the quick brown fox jumps over the lazy dog while the cat sleeps on a warm mat".split()
    rows: dict[str, list[float]] = {"local_ttft_s": [], "pd_decode_ttft_s": [], "prefill_call_s": []}
    cached_tokens = []
    prefill = ServerProcess(*common, "--splitwise-role", "prefill", id_prefix="bpp", die_with_parent=True)
    decode = ServerProcess(*common, "--splitwise-role", "decode", id_prefix="bpd", die_with_parent=True)
    try:
        prefill.launch()
        decode.launch()
        prefill.wait_healthy()
        decode.wait_healthy()
        for round_index in range(args.repeat + 1):  # round 0 warms both up and is not counted
            # A different prompt every round: neither instance has it cached.
            text = " ".join(words[(i * 7 + round_index) % len(words)] for i in range(args.prompt_tokens))
            body = {"messages": [{"role": "user", "content": f"{round_index}: {text}"}], "temperature": 0,
                    "max_tokens": 4}
            httpx.post(decode.base_url + "/v1/cache/reset", timeout=30).raise_for_status()
            local, _ = _ttft(decode.base_url, body)
            httpx.post(decode.base_url + "/v1/cache/reset", timeout=30).raise_for_status()
            started = time.perf_counter()
            response = httpx.post(prefill.base_url + "/v1/chat/completions", timeout=300,
                                  json={**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
            response.raise_for_status()
            prefill_s = time.perf_counter() - started
            remote, cached = _ttft(decode.base_url, {**body, "kv_transfer_params": response.json()["kv_transfer_params"]})
            if round_index:
                rows["local_ttft_s"].append(local)
                rows["pd_decode_ttft_s"].append(remote)
                rows["prefill_call_s"].append(prefill_s)
                cached_tokens.append(cached)
    finally:
        decode.close()
        prefill.close()
    medians = {name: round(statistics.median(values), 4) for name, values in rows.items()}
    return {"benchmark": "pd_transfer --serve", "block_size": args.block_size, "prompt_words": args.prompt_tokens,
            "repeat": args.repeat, "statistic": "median", "load_average": os.getloadavg()[0],
            "transferred_tokens": cached_tokens, **medians,
            "decode_ttft_speedup": round(medians["local_ttft_s"] / medians["pd_decode_ttft_s"], 2),
            "samples": {name: [round(v, 4) for v in values] for name, values in rows.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--blocks", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--out", default=None, help="write the JSON here as well as to stdout")
    parser.add_argument("--serve", action="store_true", help="measure inside a prefill and a decode server")
    parser.add_argument("--prompt-tokens", type=int, default=1000, help="--serve: words per prompt (~tokens)")
    args = parser.parse_args()
    if args.serve:
        report = serve_benchmark(args)
        text = json.dumps(report, indent=2)
        print(text)
        if args.out:
            with open(args.out, "w") as handle:
                handle.write(text + "\n")
        return
    most = max(args.blocks)
    peer_blocks = 2 * most + 1  # room for the scattered pattern
    peer_shape = pool_shape(args, peer_blocks)
    context = mp.get_context("spawn")
    ready, stop = context.Queue(), context.Event()
    peer = context.Process(target=run_peer, args=(peer_shape, ready, stop), daemon=True)
    peer.start()
    engine = None
    try:
        session, peer_addr = ready.get(timeout=PEER_START_TIMEOUT_S)
        local = np.zeros(pool_shape(args, most), dtype=np.float32)
        engine = KVTransferEngine("127.0.0.1")
        local_addr = engine.register(local)
        planes = args.layers * 2
        block_bytes = args.kv_heads * args.block_size * args.head_dim * 4
        expected = np.arange(int(np.prod(peer_shape)), dtype=np.float32).reshape(peer_shape)
        variants = []
        for count in args.blocks:
            for pattern in ("contiguous", "scattered"):
                peer_ids = list(range(count)) if pattern == "contiguous" else list(range(0, 2 * count, 2))
                pairs = list(zip(range(count), peer_ids))
                segments = block_segments(planes, block_bytes, local_addr, most, peer_addr, peer_blocks, pairs)
                variants.append({"blocks": count, "pattern": pattern, "pieces": len(segments[0]),
                                 "segments": segments, "peer_ids": peer_ids, "read_s": [], "write_s": [],
                                 "local_copy_s": []})
        for variant in variants:  # warm-up (connections, first touch) and the correctness check
            local[:] = 0
            measure(engine, session, variant["segments"], write=False)
            count = variant["blocks"]
            if not np.array_equal(local[:, :, :count], expected[:, :, variant["peer_ids"]]):
                raise RuntimeError(f"read of {count} {variant['pattern']} blocks returned wrong bytes")
        for _ in range(args.repeat):  # alternate the variants so load drifts hit them alike
            for variant in variants:
                variant["read_s"].append(measure(engine, session, variant["segments"], write=False))
                variant["write_s"].append(measure(engine, session, variant["segments"], write=True))
                variant["local_copy_s"].append(local_copy_s(local, expected, variant["peer_ids"]))
        results = []
        total_block_bytes = planes * block_bytes
        for variant in variants:
            row = {"blocks": variant["blocks"], "pattern": variant["pattern"], "pieces": variant["pieces"],
                   "bytes": variant["blocks"] * total_block_bytes}
            for direction in ("read", "write", "local_copy"):
                median = statistics.median(variant[f"{direction}_s"])
                row[f"{direction}_ms"] = round(median * 1e3, 3)
                row[f"{direction}_ms_per_block"] = round(median * 1e3 / variant["blocks"], 3)
                row[f"{direction}_gb_per_s"] = round(row["bytes"] / median / 1e9, 3)
            results.append(row)
        report = {"benchmark": "pd_transfer", "transport": "mooncake transfer engine, tcp, 127.0.0.1",
                  "block": {"layers": args.layers, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
                            "block_size": args.block_size, "bytes": total_block_bytes},
                  "repeat": args.repeat, "statistic": "median", "cpu_count": os.cpu_count(),
                  "load_average": os.getloadavg()[0], "results": results}
        text = json.dumps(report, indent=2)
        print(text)
        if args.out:
            with open(args.out, "w") as handle:
                handle.write(text + "\n")
    finally:
        if engine is not None:
            engine.close()
        stop.set()
        peer.join(timeout=10)
        if peer.is_alive():
            peer.kill()
            peer.join()


if __name__ == "__main__":
    main()
