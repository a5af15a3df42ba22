"""Log-probabilities as the OpenAI and vLLM responses show them.

Owns: how one token is shown (``TokenTexts``: its decoded text, or ``token_id:<id>`` under vLLM's
``return_tokens_as_token_ids``, and its raw bytes), and the three response shapes built from the
engine's ``TokenLogprobs``:

- completions ``logprobs``: ``{tokens, token_logprobs, top_logprobs, text_offset}``, where
  ``top_logprobs[i]`` maps token text to logprob for the top k alternatives plus the chosen token
  (vLLM's choice: k + 1 entries when the chosen token is not among the top k); a prompt's first
  token (echo) has ``null`` logprob and ``null`` top_logprobs;
- chat ``logprobs``: ``{content: [{token, logprob, bytes, top_logprobs: [k x {token, logprob, bytes}]}]}``;
- vLLM's ``prompt_logprobs``: ``[null, {"<token id>": {logprob, rank, decoded_token}}, ...]`` holding
  the prompt token and the top k alternatives at each position.

A logprob of -inf (a token the model gives no mass in float32) is shown as -9999.0, as vLLM does:
JSON has no infinity. Pure formatting: no engine, no I/O.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from engine.tokenizer import Tokenizer
from inter_communicator.messages import TokenLogprobs

logger = logging.getLogger(__name__)

# What -inf is shown as (vLLM's value).
NEG_INF_LOGPROB = -9999.0


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else NEG_INF_LOGPROB


def _byte_level_decoder() -> dict[str, int]:
    """The inverse of the byte-level BPE alphabet (GPT-2's): each of the 256 bytes is one printable
    character in vocabulary strings. Used to give a token's raw bytes even when it holds only part
    of a UTF-8 character (its decoded text is then U+FFFD)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    table = {chr(byte): byte for byte in printable}
    shifted = 0
    for byte in range(256):
        if byte not in printable:
            table[chr(256 + shifted)] = byte
            shifted += 1
    return table


_BYTE_LEVEL = _byte_level_decoder()


class TokenTexts:
    """How tokens are shown in logprobs, cached per token id (a response repeats the same ids)."""

    def __init__(self, tokenizer: Tokenizer, as_token_ids: bool = False) -> None:
        self._tokenizer = tokenizer
        self._as_token_ids = as_token_ids
        self._texts: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}

    def text(self, token_id: int) -> str:
        """The token decoded on its own (special tokens shown), or ``token_id:<id>``."""
        if self._as_token_ids:
            return f"token_id:{token_id}"
        text = self._texts.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._texts[token_id] = text
        return text

    def raw_bytes(self, token_id: int) -> list[int]:
        """The token's bytes: from its byte-level vocabulary string when it has one, else its text's UTF-8."""
        raw = self._bytes.get(token_id)
        if raw is None:
            piece = self._tokenizer.id_to_token(token_id) or ""
            if piece and all(char in _BYTE_LEVEL for char in piece):
                raw = [_BYTE_LEVEL[char] for char in piece]
            else:
                raw = list(self._tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8"))
            self._bytes[token_id] = raw
        return raw


@dataclass
class TokenEntry:
    """One token of a choice's text as the response shows it.

    ``logprobs`` is None for a token without them (the first prompt token of an echo, or when the
    engine sent none); ``offset`` is the character offset of the token's text in the choice's text
    (prompt included when echoed).
    """

    token_id: int
    logprobs: TokenLogprobs | None
    offset: int


def completion_logprobs(entries: list[TokenEntry], texts: TokenTexts, k: int) -> dict[str, Any]:
    """The completions ``logprobs`` object of ``entries`` (k alternatives per position)."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []
    for entry in entries:
        tokens.append(texts.text(entry.token_id))
        text_offset.append(entry.offset)
        lp = entry.logprobs
        if lp is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(_finite(lp.logprob))
        top: dict[str, float] = {}
        for token_id, logprob in list(zip(lp.top_token_ids, lp.top_logprobs))[:k]:
            top.setdefault(texts.text(token_id), _finite(logprob))
        top.setdefault(texts.text(lp.token_id), _finite(lp.logprob))
        top_logprobs.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offset}


def chat_logprobs(entries: list[TokenEntry], texts: TokenTexts, k: int) -> dict[str, Any]:
    """The chat ``logprobs`` object of ``entries``: ``{"content": [...]}`` with k alternatives each."""
    content: list[dict[str, Any]] = []
    for entry in entries:
        lp = entry.logprobs
        item: dict[str, Any] = {
            "token": texts.text(entry.token_id),
            "logprob": NEG_INF_LOGPROB if lp is None else _finite(lp.logprob),
            "bytes": texts.raw_bytes(entry.token_id),
            "top_logprobs": [],
        }
        if lp is not None:
            item["top_logprobs"] = [
                {"token": texts.text(token_id), "logprob": _finite(logprob), "bytes": texts.raw_bytes(token_id)}
                for token_id, logprob in list(zip(lp.top_token_ids, lp.top_logprobs))[:k]]
        content.append(item)
    return {"content": content}


def vllm_prompt_logprobs(prompt_token_ids: list[int], prompt_logprobs: list[TokenLogprobs | None] | None,
                         texts: TokenTexts, k: int) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: None for the first token (and wherever the engine sent nothing),
    then ``{str(token_id): {logprob, rank, decoded_token}}`` with the prompt token and the top k."""
    shown: list[dict[str, dict[str, Any]] | None] = []
    for position, token_id in enumerate(prompt_token_ids):
        lp = prompt_logprobs[position] if prompt_logprobs is not None and position < len(prompt_logprobs) else None
        if lp is None:
            shown.append(None)
            continue
        entry: dict[str, dict[str, Any]] = {}
        for rank, (top_id, logprob) in enumerate(list(zip(lp.top_token_ids, lp.top_logprobs))[:k], start=1):
            entry[str(top_id)] = {"logprob": _finite(logprob), "rank": rank, "decoded_token": texts.text(top_id)}
        entry.setdefault(str(token_id), {"logprob": _finite(lp.logprob), "rank": lp.rank,
                                         "decoded_token": texts.text(token_id)})
        shown.append(entry)
    return shown
