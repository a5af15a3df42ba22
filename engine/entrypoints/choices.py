"""One choice of a response: engine tokens in, text deltas with their tokens and logprobs out.

Owns: ``ChoiceState`` (per choice: the incremental detokenizer, the stop strings, the tokens still
held back with their logprobs, the finish reason) and ``PromptEcho`` (the prompt as ``echo`` and
``prompt_logprobs`` show it). A request with ``n`` choices has n states; a batched completions
request has one request (and n states) per prompt. Choice ``i`` of prompt ``p`` has the response
index ``p * n + i`` (vLLM's numbering).

Which tokens a delta carries (decided here): a token belongs to the delta in which the first
character it contributed to the text is emitted; tokens that contributed no text yet (part of a
UTF-8 character, text held back because it may start a stop string) wait. When the text is cut at
a stop string, the tokens and logprobs stop at the last token that contributed text before the
cut (with ``include_stop_str_in_output``: the last one contributing to the stop string); tokens
after it are dropped, like the text. When generation ends otherwise, every remaining token is
released. A token that ended generation by being an eos or a stop token id is listed with its
logprobs but adds no text (vLLM's rule; with ``include_stop_str_in_output`` its text stays).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterable

from engine.entrypoints.detokenizer import IncrementalDetokenizer, StopChecker
from engine.entrypoints.logprobs_format import TokenEntry
from engine.tokenizer import Tokenizer
from inter_communicator.messages import TokenLogprobs

logger = logging.getLogger(__name__)


@dataclass
class PromptEcho:
    """The prompt of one engine request as shown by ``echo`` and ``prompt_logprobs``."""

    token_ids: list[int]
    text: str
    entries: list[TokenEntry]  # one per prompt token; offsets into ``text``
    logprobs: list[TokenLogprobs | None] | None  # RequestOutput.prompt_logprobs (None: not sent)

    @classmethod
    def build(cls, tokenizer: Tokenizer, token_ids: list[int],
              logprobs: list[TokenLogprobs | None] | None) -> "PromptEcho":
        # Decoded token by token so each token's offset is exact; special tokens are part of the prompt.
        detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
        entries: list[TokenEntry] = []
        length = 0
        for position, token_id in enumerate(token_ids):
            lp = logprobs[position] if logprobs is not None and position < len(logprobs) else None
            entries.append(TokenEntry(token_id, lp, length))
            length += len(detokenizer.add([token_id]))
        detokenizer.flush()
        return cls(list(token_ids), detokenizer.text, entries, logprobs)


@dataclass
class ChoiceDelta:
    """What one choice adds to the response: text, its token ids and token entries, maybe its end."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    entries: list[TokenEntry] = field(default_factory=list)
    finish_reason: str | None = None
    prompt: PromptEcho | None = None  # set on a choice's first delta when echo / prompt_logprobs need it

    def merge(self, later: "ChoiceDelta") -> None:
        """Append ``later`` (of the same choice) to this delta."""
        self.text += later.text
        self.token_ids.extend(later.token_ids)
        self.entries.extend(later.entries)
        self.finish_reason = later.finish_reason or self.finish_reason
        self.prompt = self.prompt or later.prompt

    @property
    def empty(self) -> bool:
        return not (self.text or self.token_ids or self.entries or self.finish_reason or self.prompt)


class ChoiceState:
    """Tokens of one choice in, ``ChoiceDelta`` out (see the module doc for the token rule).

    ``drop_generated``: the client asked for the prompt alone (echo with max_tokens=0); the engine
    still generates one token, which is dropped here.
    """

    def __init__(self, index: int, tokenizer: Tokenizer, stop: list[str], *, skip_special_tokens: bool = True,
                 include_stop_str: bool = False, drop_generated: bool = False,
                 stop_token_ids: Iterable[int] = ()) -> None:
        self.index = index
        # eos and stop_token_ids: a token that ends generation as one of these shows no text.
        self._stop_token_ids = frozenset(stop_token_ids)
        self._detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
        self._stops = StopChecker(stop) if stop else None
        self._include_stop_str = include_stop_str
        self._drop_generated = drop_generated
        self._generated_chars = 0  # characters decoded so far (before any stop cut)
        self._emitted_chars = 0  # characters released to the client
        self._pending: list[TokenEntry] = []
        self.completion_tokens = 0
        self.finish_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, token_ids: list[int], logprobs: list[TokenLogprobs] | None, finished: bool,
            finish_reason: str | None) -> ChoiceDelta:
        """The delta after the engine sent ``token_ids`` (with their ``logprobs``) for this choice."""
        delta = ChoiceDelta(self.index)
        if self.finished:
            return delta  # cut at a stop string already: the engine's later tokens are not shown
        if self._drop_generated:
            if finished:
                self.finish_reason = delta.finish_reason = "length"
            return delta
        pieces: list[str] = []
        stopped_by_token = (finished and finish_reason == "stop" and bool(token_ids)
                            and token_ids[-1] in self._stop_token_ids and not self._include_stop_str)
        for position, token_id in enumerate(token_ids):
            lp = logprobs[position] if logprobs is not None and position < len(logprobs) else None
            self._pending.append(TokenEntry(token_id, lp, self._generated_chars))
            if stopped_by_token and position == len(token_ids) - 1:
                continue  # the stop token: listed (with its logprobs), no text
            piece = self._detokenizer.add([token_id])
            self._generated_chars += len(piece)
            pieces.append(piece)
        self.completion_tokens += len(token_ids)
        if finished:
            tail = self._detokenizer.flush()
            self._generated_chars += len(tail)
            pieces.append(tail)
        text = "".join(pieces)
        stopped = False
        if self._stops is not None:
            text, stopped = self._stops.update(text)
            if stopped and self._include_stop_str and self._stops.matched_stop:
                text += self._stops.matched_stop
            elif finished and not stopped:
                text += self._stops.flush()
        self._emitted_chars += len(text)
        delta.text = text
        if stopped:
            self.finish_reason = "stop"
        elif finished:
            # The engine reports "stop" for eos / stop token ids and "length" for max_tokens.
            self.finish_reason = finish_reason or "stop"
        self._release(delta, everything=finished and not stopped)
        delta.finish_reason = self.finish_reason
        return delta

    def _release(self, delta: ChoiceDelta, everything: bool) -> None:
        if everything:
            released, self._pending = self._pending, []
        else:
            count = 0
            while count < len(self._pending) and self._pending[count].offset < self._emitted_chars:
                count += 1
            released, self._pending = self._pending[:count], self._pending[count:]
            if self.finished:
                self._pending = []  # cut at a stop string: what was not released is dropped with the text
        delta.entries = released
        delta.token_ids = [entry.token_id for entry in released]
