#!/usr/bin/env python3
"""Greedy agreement of a running OpenAI-compatible server with fdserve's float32 references.

Owns the "greedy output" column of the peer benchmark: every reference prompt of
/work/shared/reference/smollm2_greedy.json is sent as token ids to ``POST /v1/completions``
(temperature 0, ``max_tokens`` = the reference length, EOS honoured) and the completion text is
compared with the reference text. Text, not token ids, because not every peer returns ids
(llama.cpp's OpenAI endpoint does not); equal text over a greedy run of one model means the
same tokens in practice. Standalone (stdlib only) so it measures any server.

    python benchmarks/peer_greedy.py --port 8000 --reference REF.json [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

logger = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 300.0
PARALLEL_REQUESTS = 6


def served_model(base_url: str) -> str:
    with urllib.request.urlopen(f"{base_url}/v1/models", timeout=REQUEST_TIMEOUT_S) as resp:
        return json.load(resp)["data"][0]["id"]


def complete(base_url: str, model: str, prompt_ids: list[int], max_tokens: int) -> str:
    """The greedy completion text of ``prompt_ids``."""
    body = json.dumps({"model": model, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0.0,
                       "stream": False}).encode("utf-8")
    request = urllib.request.Request(f"{base_url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as resp:
        return json.load(resp)["choices"][0]["text"]


def check_server(base_url: str, references: list[dict]) -> dict:
    """``{"matched": k, "total": n, "prompts": [...]}`` for ``references`` against the server."""
    model = served_model(base_url)
    with ThreadPoolExecutor(PARALLEL_REQUESTS) as pool:
        texts = list(pool.map(lambda ref: complete(base_url, model, ref["prompt_ids"], len(ref["output_ids"])),
                              references))
    rows = [{"prompt": ref["prompt"], "expected": ref["output_text"], "produced": text,
             "match": text.strip() == ref["output_text"].strip()} for ref, text in zip(references, texts)]
    return {"matched": sum(row["match"] for row in rows), "total": len(rows), "prompts": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--reference", required=True, help="smollm2_greedy.json")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    with open(args.reference, encoding="utf-8") as handle:
        references = json.load(handle)
    try:
        report = check_server(f"http://{args.host}:{args.port}", references)
    except (urllib.error.URLError, OSError, KeyError, ValueError) as exc:
        logger.error("greedy check against port %s failed: %s", args.port, exc)
        return 2
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            handle.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
