#!/usr/bin/env python3
"""Serving benchmark: load generator for an OpenAI-compatible ``POST /v1/completions``.

Owns the measurement of a running server from the outside: it sends prompts of exact token
lengths (lists of random token ids, optionally sharing a prefix), keeps ``--concurrency``
requests in flight, and reports completed/failed counts, request and output-token throughput,
TTFT, TPOT and end-to-end latency percentiles as JSON (stdout and ``--out``).

Standalone on purpose (stdlib + aiohttp), so it can measure any server, not only fdserve.

    python benchmarks/serving.py --port 8000 --num-requests 64 --concurrency 8 \\
        --input-len 128 --output-len 64 --out benchmarks/results/run.json --label baseline

Definitions: TTFT = request start to the first streamed chunk carrying text; e2e = request
start to the end of the response; TPOT = (e2e - TTFT) / (output tokens - 1). Output tokens
come from the final ``usage`` (``stream_options.include_usage``) when the server sends it,
otherwise from the number of text chunks. Without streaming only e2e is observable.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Awaitable, Callable

import aiohttp

logger = logging.getLogger(__name__)

TOKEN_ID_RANGE = (1000, 40000)  # ordinary vocabulary ids: no special tokens, valid for 49k vocabularies
MAX_ERRORS_REPORTED = 10


@dataclass
class RequestResult:
    ok: bool = False
    ttft: float | None = None
    e2e: float | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0
    usage_reported: bool = False
    error: str | None = None


@dataclass
class Config:
    base_url: str
    model: str
    num_requests: int
    concurrency: int
    input_len: int
    output_len: int
    shared_prefix_len: int
    stream: bool
    ignore_eos: bool
    seed: int
    request_timeout: float
    total_timeout: float
    warmup: int
    label: str


def build_prompts(num: int, input_len: int, shared_prefix_len: int, seed: int) -> list[list[int]]:
    """``num`` prompts of exactly ``input_len`` token ids; the first ``shared_prefix_len`` shared."""
    rng = random.Random(seed)
    low, high = TOKEN_ID_RANGE
    prefix = [rng.randrange(low, high) for _ in range(shared_prefix_len)]
    return [prefix + [rng.randrange(low, high) for _ in range(input_len - shared_prefix_len)] for _ in range(num)]


def request_body(config: Config, prompt: list[int]) -> dict:
    body = {
        "model": config.model,
        "prompt": prompt,
        "max_tokens": config.output_len,
        "temperature": 0.0,
        "ignore_eos": config.ignore_eos,
        "stream": config.stream,
    }
    if config.stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def post_and_read(session: aiohttp.ClientSession, url: str, body: dict, request_timeout: float,
                        result: Any, read: Callable[[aiohttp.ClientResponse], Awaitable[None]]) -> bool:
    """POST ``body`` to ``url`` and hand a 200 response to ``read``. Shared with ``multiturn.py``.

    An error status, no complete response within ``request_timeout`` or a transport error becomes
    ``result.error`` (any object with an ``error`` attribute) and False; True once ``read`` returned (it may
    have set ``result.error`` itself).
    """
    try:
        async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=request_timeout)) as resp:
            if resp.status != 200:
                text = (await resp.text())[:300]
                result.error = f"HTTP {resp.status}: {text}"
                return False
            await read(resp)
    except asyncio.TimeoutError:
        result.error = f"no complete response within --request-timeout {request_timeout}s"
        return False
    except (aiohttp.ClientError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:300]
        return False
    return True


async def send_request(session: aiohttp.ClientSession, config: Config, prompt: list[int]) -> RequestResult:
    result = RequestResult(prompt_tokens=len(prompt))
    start = time.perf_counter()

    async def read(resp: aiohttp.ClientResponse) -> None:
        if config.stream:
            await read_stream(resp, result, start)
        else:
            read_completion(await resp.json(), result)

    if not await post_and_read(session, f"{config.base_url}/v1/completions", request_body(config, prompt),
                               config.request_timeout, result, read):
        return result
    result.e2e = time.perf_counter() - start
    result.ok = result.error is None
    return result


class SSEStream:
    """The JSON events of a server-sent-event response, in order, up to ``data: [DONE]``.

    Iterating reads the body to its end, also past ``[DONE]``, so the response completes
    cleanly; ``done`` tells whether ``[DONE]`` came. Shared with ``load_test.py``.
    """

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self.resp = resp
        self.done = False

    async def __aiter__(self):
        async for raw_line in self.resp.content:
            line = raw_line.decode("utf-8", errors="replace").strip()
            if self.done or not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                self.done = True
                continue
            yield json.loads(data)


def stream_error(chunk: dict) -> str | None:
    """The error an event carries (a server's mid-stream failure), as one bounded line."""
    return f"stream error: {json.dumps(chunk['error'])[:300]}" if "error" in chunk else None


async def read_stream(resp: aiohttp.ClientResponse, result: RequestResult, start: float) -> None:
    """Consume server-sent events, timing the first text chunk and counting tokens."""
    text_chunks = 0
    async for chunk in SSEStream(resp):
        error = stream_error(chunk)
        if error:
            result.error = error
            return
        if any(choice.get("text") for choice in chunk.get("choices") or []):
            text_chunks += 1
            if result.ttft is None:
                result.ttft = time.perf_counter() - start
        apply_usage(chunk.get("usage"), result)
    if not result.usage_reported:
        result.output_tokens = text_chunks


def read_completion(body: dict, result: RequestResult) -> None:
    apply_usage(body.get("usage"), result)
    if not result.usage_reported:
        result.error = "non-streaming response without usage: output tokens unknown"


def apply_usage(usage: dict | None, result: RequestResult) -> None:
    if usage and usage.get("completion_tokens") is not None:
        result.output_tokens = int(usage["completion_tokens"])
        result.prompt_tokens = int(usage.get("prompt_tokens", result.prompt_tokens))
        result.usage_reported = True


async def discover_model(session: aiohttp.ClientSession, base_url: str, timeout: float) -> str:
    async with session.get(f"{base_url}/v1/models", timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
        resp.raise_for_status()
        models = (await resp.json()).get("data") or []
    if not models:
        raise RuntimeError(f"{base_url}/v1/models lists no model; pass --model")
    return models[0]["id"]


async def run_load(
    session: aiohttp.ClientSession, config: Config, prompts: list[list[int]], results: list[RequestResult | None]
) -> None:
    """Send every prompt with at most ``concurrency`` in flight, filling ``results[i]`` as each ends.

    Results go into the caller's list so a run cut by the total timeout still reports what finished.
    """
    next_index = iter(range(len(prompts)))

    async def worker() -> None:
        for i in next_index:
            results[i] = await send_request(session, config, prompts[i])

    workers = [asyncio.create_task(worker()) for _ in range(min(config.concurrency, len(prompts)))]
    try:
        await asyncio.gather(*workers)
    finally:
        for task in workers:
            task.cancel()


async def run_bounded(
    session: aiohttp.ClientSession, config: Config, prompts: list[list[int]]
) -> tuple[list[RequestResult], bool]:
    """``run_load`` cut off after ``total_timeout``; (results in prompt order, timed out?)."""
    results: list[RequestResult | None] = [None] * len(prompts)
    timed_out = False
    try:
        await asyncio.wait_for(run_load(session, config, prompts, results), config.total_timeout)
    except asyncio.TimeoutError:
        timed_out = True
    unfinished = RequestResult(error=f"not finished within --total-timeout {config.total_timeout}s")
    return [r if r is not None else unfinished for r in results], timed_out


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lower = int(pos)
    upper = min(lower + 1, len(ordered) - 1)
    return ordered[lower] + (ordered[upper] - ordered[lower]) * (pos - lower)


def ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000.0, 3)


def summarize(config: Config, results: list[RequestResult], duration: float, timed_out: bool) -> dict:
    done = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    ttfts = [r.ttft for r in done if r.ttft is not None]
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in done if r.ttft is not None and r.output_tokens > 1]
    e2es = [r.e2e for r in done]
    output_tokens = sum(r.output_tokens for r in done)
    return {
        "label": config.label,
        "config": asdict(config),
        "completed": len(done),
        "failed": len(failed),
        "timed_out": timed_out,
        "duration_s": round(duration, 3),
        "request_throughput_rps": round(len(done) / duration, 4) if duration > 0 else None,
        "output_throughput_tps": round(output_tokens / duration, 3) if duration > 0 else None,
        "total_input_tokens": sum(r.prompt_tokens for r in done),
        "total_output_tokens": output_tokens,
        "usage_reported": all(r.usage_reported for r in done) if done else None,
        "ttft_ms": {"mean": ms(sum(ttfts) / len(ttfts)) if ttfts else None, "p50": ms(percentile(ttfts, 50)),
                    "p99": ms(percentile(ttfts, 99))},
        "tpot_ms": {"mean": ms(sum(tpots) / len(tpots)) if tpots else None, "p50": ms(percentile(tpots, 50)),
                    "p99": ms(percentile(tpots, 99))},
        "e2e_ms": {"p50": ms(percentile(e2es, 50)), "p99": ms(percentile(e2es, 99))},
        "errors": sorted({r.error for r in failed if r.error})[:MAX_ERRORS_REPORTED],
    }


async def benchmark(args: argparse.Namespace) -> dict:
    base_url = f"http://{args.host}:{args.port}"
    # One connection per request: llama-server closes a connection after a streamed response without
    # saying so, and a client that reuses it fails the next request ("Can not write request body").
    # A fresh 127.0.0.1 connection costs well under a millisecond, the same for every server measured.
    connector = aiohttp.TCPConnector(limit=max(args.concurrency, 1), force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session:
        model = args.model or await discover_model(session, base_url, args.request_timeout)
        config = Config(
            base_url=base_url, model=model, num_requests=args.num_requests, concurrency=args.concurrency,
            input_len=args.input_len, output_len=args.output_len, shared_prefix_len=args.shared_prefix_len,
            stream=args.stream, ignore_eos=args.ignore_eos, seed=args.seed, request_timeout=args.request_timeout,
            total_timeout=args.total_timeout, warmup=args.warmup, label=args.label,
        )
        # Warm-up prompts come from another seed so they do not pre-fill a prefix cache for the run
        # (beyond the shared prefix, which is the point of --shared-prefix-len).
        if config.warmup:
            warmup = build_prompts(config.warmup, config.input_len, config.shared_prefix_len, config.seed + 1)
            warm, _ = await run_bounded(session, config, warmup)
            if not any(r.ok for r in warm):
                logger.warning("all warm-up requests failed: %s", sorted({str(r.error) for r in warm}))
        prompts = build_prompts(config.num_requests, config.input_len, config.shared_prefix_len, config.seed)
        start = time.perf_counter()
        results, timed_out = await run_bounded(session, config, prompts)
        return summarize(config, results, time.perf_counter() - start, timed_out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", default=None, help="model name (default: the first of GET /v1/models)")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--input-len", type=int, default=128, help="prompt length in tokens (exact)")
    parser.add_argument("--output-len", type=int, default=64, help="max_tokens of every request")
    parser.add_argument("--shared-prefix-len", type=int, default=0, help="leading tokens shared by all prompts")
    parser.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=0, help="requests sent and discarded before measuring")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--total-timeout", type=float, default=3600.0, help="seconds for the whole run")
    parser.add_argument("--out", default=None, help="write the JSON report here too")
    parser.add_argument("--label", default="", help="free text stored in the report")
    args = parser.parse_args(argv)
    for name in ("num_requests", "concurrency", "input_len", "output_len"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if not 0 <= args.shared_prefix_len <= args.input_len:
        parser.error("--shared-prefix-len must be in [0, --input-len]")
    if args.request_timeout <= 0 or args.total_timeout <= 0 or args.warmup < 0:
        parser.error("timeouts must be positive and --warmup non-negative")
    return args


def write_report(report: dict, out: str | None) -> None:
    """The JSON report on stdout and, with ``--out``, in that file too. Shared with ``multiturn.py``."""
    text = json.dumps(report, indent=2)
    print(text)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w", encoding="utf-8") as f:
            f.write(text + "\n")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    args = parse_args(argv)
    try:
        report = asyncio.run(benchmark(args))
    except (aiohttp.ClientError, OSError, RuntimeError, asyncio.TimeoutError) as exc:
        logger.error("benchmark could not run against %s:%s: %s", args.host, args.port, exc)
        return 2
    write_report(report, args.out)
    return 0 if report["failed"] == 0 and report["completed"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
