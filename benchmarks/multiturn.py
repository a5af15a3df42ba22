#!/usr/bin/env python3
"""Multi-turn chat benchmark: N concurrent conversations x T turns against ``/v1/chat/completions``.

Owns the measurement of ordinary chat traffic: every conversation starts from one shared
system prompt (so conversations share a prefix), and each turn resends the whole history
(system, every earlier user and assistant message, the new user message), streamed and greedy;
the assistant's reply is appended to the history before the next turn. Conversations run
concurrently; the turns of one conversation run one after another.

Reports as JSON (stdout and ``--out``): per-turn TTFT p50/p90, prefix-cache hit rate per turn and
overall (``usage.prompt_tokens_details.cached_tokens / prompt_tokens`` from the final usage event of
a stream with ``stream_options.include_usage``), output tokens per second, request count and the
errors with their messages. A conversation whose turn fails stops there (its history cannot go on).

``--check-against URL`` replays, after the measured run, every turn on a second server (for
example one started with ``--no-enable-prefix-caching``) with exactly the history the first server
saw (the first server's replies), and counts the turns whose greedy completion token ids differ.

    python benchmarks/multiturn.py --port 8000 --conversations 8 --turns 4 --out /tmp/mt.json \\
        --check-against http://127.0.0.1:8001

Exit status: 2 when the server cannot be reached at all; with ``--strict`` 1 on any error,
unfinished turn or mismatch; otherwise 0.
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
from dataclasses import dataclass, field

import aiohttp

# benchmarks/ is not a package; the SSE reader and helpers are shared with the serving benchmark.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serving import SSEStream, discover_model, ms, percentile, post_and_read, stream_error, write_report  # noqa: E402

logger = logging.getLogger(__name__)

MAX_ERRORS_REPORTED = 20
# Plain lowercase words, about one token each for common BPE vocabularies: lengths below are in words.
WORDS = (
    "apple river stone cloud music garden window yellow silver market paper winter summer forest letter "
    "bridge planet engine pocket candle mirror castle doctor island ladder meadow number orange pencil "
    "rabbit saddle tunnel valley wallet animal basket camera dinner father guitar hammer jacket kettle "
    "lemon mother needle ocean pillow quarter rocket sister ticket umbrella village wizard button carpet "
    "dragon feather honey invent jungle kitten morning noodle parrot rainbow shadow tomato velvet walnut"
).split()


@dataclass
class Config:
    base_url: str
    model: str
    conversations: int
    turns: int
    max_tokens: int
    system_prompt_len: int
    user_len: int
    seed: int
    request_timeout: float
    total_timeout: float
    check_against: str | None = None


@dataclass
class TurnResult:
    conversation: int
    turn: int
    messages: list[dict] = field(default_factory=list)  # the history sent (reply not included)
    ok: bool = False
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    ttft: float | None = None
    e2e: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    usage_reported: bool = False
    error: str | None = None


def make_text(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def build_conversations(conversations: int, turns: int, system_prompt_len: int, user_len: int,
                        seed: int) -> tuple[str, list[list[str]]]:
    """(shared system prompt, per conversation its ``turns`` user messages), deterministic in ``seed``."""
    rng = random.Random(seed)
    system = "You are a helpful assistant. Context: " + make_text(rng, system_prompt_len)
    users = [[f"Question {c}.{t}: tell me about " + make_text(rng, user_len) for t in range(turns)]
             for c in range(conversations)]
    return system, users


def chat_body(model: str, messages: list[dict], max_tokens: int) -> dict:
    return {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }


async def send_turn(session: aiohttp.ClientSession, base_url: str, model: str, max_tokens: int,
                    request_timeout: float, result: TurnResult) -> TurnResult:
    """Stream one chat turn into ``result`` (text, token ids, TTFT, usage or the error)."""
    start = time.perf_counter()

    async def read(resp: aiohttp.ClientResponse) -> None:
        stream = SSEStream(resp)
        async for chunk in stream:
            error = stream_error(chunk)
            if error:
                result.error = error
                return
            read_chunk(chunk, result, start)
        if not stream.done:
            result.error = "stream ended without [DONE]"

    body = chat_body(model, result.messages, max_tokens)
    if not await post_and_read(session, f"{base_url}/v1/chat/completions", body, request_timeout, result, read):
        return result
    if result.error is not None:  # an error event in the stream, or no [DONE]
        return result
    result.e2e = time.perf_counter() - start
    if not result.usage_reported:
        result.error = "no usage event (stream_options.include_usage) at the end of the stream"
        return result
    result.ok = True
    return result


def read_chunk(chunk: dict, result: TurnResult, start: float) -> None:
    for choice in chunk.get("choices") or []:
        text = (choice.get("delta") or {}).get("content") or ""
        if text:
            result.text += text
            if result.ttft is None:
                result.ttft = time.perf_counter() - start
        result.token_ids.extend(choice.get("completion_token_ids") or [])
    usage = chunk.get("usage")
    if usage and usage.get("completion_tokens") is not None:
        result.usage_reported = True
        result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        result.completion_tokens = int(usage["completion_tokens"])
        result.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


async def run_conversation(session: aiohttp.ClientSession, config: Config, index: int, system: str,
                           users: list[str], results: list[TurnResult]) -> None:
    """Turns of one conversation in order, appended to ``results`` as each ends; stops at the first error."""
    history: list[dict] = [{"role": "system", "content": system}]
    for turn, user in enumerate(users):
        history.append({"role": "user", "content": user})
        result = TurnResult(conversation=index, turn=turn, messages=list(history))
        results.append(result)
        await send_turn(session, config.base_url, config.model, config.max_tokens, config.request_timeout, result)
        if not result.ok:
            return
        history.append({"role": "assistant", "content": result.text})


async def run_conversations(session: aiohttp.ClientSession, config: Config, system: str,
                            users: list[list[str]]) -> tuple[list[TurnResult], bool]:
    """Every conversation concurrently, cut off after ``total_timeout``: (turn results, timed out?)."""
    results: list[TurnResult] = []
    tasks = [asyncio.ensure_future(run_conversation(session, config, c, system, users[c], results))
             for c in range(len(users))]
    try:
        await asyncio.wait_for(asyncio.gather(*tasks), config.total_timeout)
        return results, False
    except asyncio.TimeoutError:
        for result in results:
            if not result.ok and result.error is None:
                result.error = f"not finished within --total-timeout {config.total_timeout}s"
        return results, True
    finally:
        for task in tasks:
            task.cancel()


async def replay(session: aiohttp.ClientSession, config: Config, results: list[TurnResult],
                 deadline: float, known: dict[str, TurnResult] | None = None) -> dict:
    """Send every successful turn's exact history to ``config.check_against``; compare completion token ids.

    ``known`` (history as JSON -> the reference's reply) is read and filled, so runs that give the
    same histories (several servers checked against one reference) ask the reference only once.
    """
    base_url = config.check_against.rstrip("/")
    model = await discover_model(session, base_url, config.request_timeout)
    known = {} if known is None else known
    turns = [r for r in results if r.ok]
    replies = [TurnResult(conversation=r.conversation, turn=r.turn, messages=r.messages) for r in turns]
    semaphore = asyncio.Semaphore(max(1, config.conversations))

    async def one(reply: TurnResult) -> None:
        key = json.dumps([base_url, config.max_tokens, reply.messages])
        if key in known:
            reply.ok, reply.text, reply.token_ids = True, known[key].text, known[key].token_ids
            return
        async with semaphore:
            await send_turn(session, base_url, model, config.max_tokens, config.request_timeout, reply)
        if reply.ok:
            known[key] = reply

    timed_out = False
    try:
        await asyncio.wait_for(asyncio.gather(*(one(r) for r in replies)), max(1.0, deadline - time.monotonic()))
    except asyncio.TimeoutError:
        timed_out = True
    mismatches = []
    for ours, theirs in zip(turns, replies):
        if theirs.ok and ours.token_ids != theirs.token_ids:
            mismatches.append({"conversation": ours.conversation, "turn": ours.turn,
                               "tokens": ours.token_ids, "reference_tokens": theirs.token_ids,
                               "text": ours.text, "reference_text": theirs.text})
    errors = [f"conversation {r.conversation} turn {r.turn}: {r.error or 'not finished'}"
              for r in replies if not r.ok]
    return {
        "reference": base_url,
        "compared": sum(1 for r in replies if r.ok),
        "mismatches": len(mismatches),
        "mismatch_details": mismatches[:MAX_ERRORS_REPORTED],
        "errors": errors[:MAX_ERRORS_REPORTED],
        "error_count": len(errors),
        "timed_out": timed_out,
    }


def ratio(numerator: int, denominator: int) -> float | None:
    return round(numerator / denominator, 4) if denominator else None


def summarize(config: Config, results: list[TurnResult], duration: float, timed_out: bool) -> dict:
    done = [r for r in results if r.ok]
    per_turn = []
    for turn in range(config.turns):
        ok = [r for r in done if r.turn == turn]
        ttfts = [r.ttft for r in ok if r.ttft is not None]
        per_turn.append({
            "turn": turn + 1,
            "completed": len(ok),
            "ttft_ms": {"p50": ms(percentile(ttfts, 50)), "p90": ms(percentile(ttfts, 90))},
            "prompt_tokens": sum(r.prompt_tokens for r in ok),
            "cached_tokens": sum(r.cached_tokens for r in ok),
            "hit_rate": ratio(sum(r.cached_tokens for r in ok), sum(r.prompt_tokens for r in ok)),
        })
    later = [r for r in done if r.turn > 0]
    output_tokens = sum(r.completion_tokens for r in done)
    failed = [r for r in results if not r.ok]
    expected = config.conversations * config.turns
    return {
        "config": {k: v for k, v in config.__dict__.items()},
        "requests": len(results),
        "completed": len(done),
        "not_sent": expected - len(results),
        "errors": [f"conversation {r.conversation} turn {r.turn + 1}: {r.error}" for r in failed][:MAX_ERRORS_REPORTED],
        "error_count": len(failed),
        "timed_out": timed_out,
        "duration_s": round(duration, 3),
        "output_tokens": output_tokens,
        "output_throughput_tps": round(output_tokens / duration, 3) if duration > 0 else None,
        "hit_rate": ratio(sum(r.cached_tokens for r in done), sum(r.prompt_tokens for r in done)),
        "hit_rate_later_turns": ratio(sum(r.cached_tokens for r in later), sum(r.prompt_tokens for r in later)),
        "turns": per_turn,
    }


async def benchmark(config: Config, model: str | None = None,
                    known: dict[str, TurnResult] | None = None) -> tuple[dict, list[TurnResult]]:
    """Run the conversations (and the replay when ``config.check_against``, see ``replay`` for ``known``)."""
    deadline = time.monotonic() + config.total_timeout
    # One connection per request, as serving.py: a fresh 127.0.0.1 connection costs well under a millisecond.
    connector = aiohttp.TCPConnector(limit=max(2 * config.conversations, 1), force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session:
        config.model = model or config.model or await discover_model(session, config.base_url, config.request_timeout)
        system, users = build_conversations(config.conversations, config.turns, config.system_prompt_len,
                                            config.user_len, config.seed)
        start = time.perf_counter()
        results, timed_out = await run_conversations(session, config, system, users)
        report = summarize(config, results, time.perf_counter() - start, timed_out)
        if config.check_against:
            report["check"] = await replay(session, config, results, deadline, known)
    return report, results


def failed(report: dict) -> bool:
    """Whether a report shows any error, unfinished turn or output mismatch (``--strict``)."""
    check = report.get("check") or {}
    return bool(report["error_count"] or report["not_sent"] or report["timed_out"]
                or check.get("mismatches") or check.get("error_count") or check.get("timed_out"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--base-url", default=None, help="server URL (overrides --host/--port)")
    parser.add_argument("--model", default=None, help="model name (default: the first of GET /v1/models)")
    parser.add_argument("--conversations", type=int, default=8, help="conversations running at once")
    parser.add_argument("--turns", type=int, default=4, help="user turns per conversation")
    parser.add_argument("--max-tokens", type=int, default=32, help="max_tokens of every turn")
    parser.add_argument("--system-prompt-len", type=int, default=200,
                        help="words of the system prompt every conversation shares (about a token each)")
    parser.add_argument("--user-len", type=int, default=40, help="words per user message")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check-against", default=None,
                        help="URL of a second server: replay every turn there and count greedy output mismatches")
    parser.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    parser.add_argument("--total-timeout", type=float, default=1800.0,
                        help="seconds for the whole run, replay included")
    parser.add_argument("--strict", action="store_true",
                        help="exit 1 on any error, unfinished turn or mismatch")
    parser.add_argument("--out", default=None, help="write the JSON report here too")
    args = parser.parse_args(argv)
    for name in ("conversations", "turns", "max_tokens", "user_len"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.system_prompt_len < 0:
        parser.error("--system-prompt-len must be >= 0")
    if args.request_timeout <= 0 or args.total_timeout <= 0:
        parser.error("timeouts must be positive")
    return args


def config_from_args(args: argparse.Namespace) -> Config:
    return Config(
        base_url=(args.base_url or f"http://{args.host}:{args.port}").rstrip("/"), model=args.model or "",
        conversations=args.conversations, turns=args.turns, max_tokens=args.max_tokens,
        system_prompt_len=args.system_prompt_len, user_len=args.user_len, seed=args.seed,
        request_timeout=args.request_timeout, total_timeout=args.total_timeout, check_against=args.check_against,
    )


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    args = parse_args(argv)
    config = config_from_args(args)
    try:
        report, _ = asyncio.run(benchmark(config))
    except (aiohttp.ClientError, OSError, RuntimeError, asyncio.TimeoutError) as exc:
        logger.error("benchmark could not run against %s: %s", config.base_url, exc)
        return 2
    write_report(report, args.out)
    return 1 if args.strict and failed(report) else 0


if __name__ == "__main__":
    sys.exit(main())
