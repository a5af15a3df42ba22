"""Requests a test sends to a running ``ServerProcess``: its health, a greedy completion checked against
the reference, and a long stream recorded line by line while a fault is injected.

Shared by the fault tests (``test_faults``, ``test_engine_supervision``) so that "the server serves the
reference again" means the same request and the same check everywhere.
"""
from __future__ import annotations

import logging
import threading

import httpx

from harness.reference import expected_prefix, load_reference
from harness.server import ServerProcess

logger = logging.getLogger(__name__)


def health(server: ServerProcess) -> dict:
    return httpx.get(server.base_url + "/health", timeout=10).json()


def complete(server: ServerProcess, entry: dict, timeout: float = 120) -> httpx.Response:
    """A greedy completion of ``entry``'s prompt, as long as its reference output, with token ids."""
    return httpx.post(server.base_url + "/v1/completions", timeout=timeout, json={
        "prompt": entry["prompt_ids"], "max_tokens": len(entry["output_ids"]), "temperature": 0,
        "return_token_ids": True})


def assert_reference_output(server: ServerProcess, entry: dict | None = None) -> None:
    """The server answers ``entry`` (default: the first reference entry) with the reference tokens."""
    if entry is None:
        entry = load_reference()[0]
    resp = complete(server, entry)
    assert resp.status_code == 200, resp.text
    ours, ref = expected_prefix(entry, resp.json()["choices"][0]["completion_token_ids"])
    assert ours == ref


def stream_until_end(server: ServerProcess, events: list[str], first_chunk: threading.Event, *,
                     prompt_ids: list[int], max_tokens: int) -> None:
    """Stream a long greedy completion (EOS ignored) into ``events``, one SSE line each; meant for a thread.

    ``first_chunk`` is set at the first line and on every exit path, so a waiting test never hangs; a
    transport error ends the stream as its last event instead of escaping the thread.
    """
    body = {"prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    try:
        with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=120) as resp:
            for line in resp.iter_lines():
                if line:
                    events.append(line)
                    first_chunk.set()
    except httpx.HTTPError as exc:
        events.append(f"transport error: {exc}")
    finally:
        first_chunk.set()
