"""Streaming text out of generated token ids, and OpenAI-style stop strings.

Owns: ``IncrementalDetokenizer`` (token ids in, text deltas out, never splitting a UTF-8
character and never re-decoding the whole output) and ``StopChecker`` (cuts the text right
before the first stop string and never streams a piece of one). Runs in the API-server
process; no paddle here.

Typical use per request::

    detok, stops = IncrementalDetokenizer(tokenizer), StopChecker(params.stop)
    for new_ids in outputs:
        text, stopped = stops.update(detok.add(new_ids))
        ...                                   # stream ``text``; abort the request if stopped
    text, stopped = stops.update(detok.flush())
    text += stops.flush()                     # generation ended for another reason
"""
from __future__ import annotations

import logging

from engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    The prefix/read offset technique: ``ids[prefix_offset:read_offset]`` is a short window of
    tokens already turned into text, decoded again only as context (decoders such as
    SentencePiece's drop a leading space at the start of a sequence, so a token decoded alone
    can differ from the same token decoded after its predecessor). Each step decodes the window
    plus the new tokens and emits the text beyond the window's. While that text ends in U+FFFD
    (an incomplete UTF-8 sequence: a character split across tokens) the offsets stay put and
    the dangling part is held back; the complete text before it is emitted at once.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        # Characters already emitted past the decoded window (text before a held-back partial character).
        self._emitted_past_window = 0
        self._pieces: list[str] = []

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._pieces)

    @property
    def token_ids(self) -> list[int]:
        return list(self._ids)

    def add(self, token_ids: list[int]) -> str:
        """Append ``token_ids``; return the text that became final since the previous call."""
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """The held-back tail (e.g. a character cut off by the end of generation), as decode gives it."""
        return self._advance(final=True)

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip_special_tokens)

    def _advance(self, final: bool) -> str:
        window_text = self._decode(self._prefix_offset, self._read_offset)
        full_text = self._decode(self._prefix_offset, len(self._ids))
        complete = not full_text.endswith(_REPLACEMENT_CHAR)
        if complete or final:
            new_text = full_text[len(window_text) + self._emitted_past_window:]
            if len(full_text) > len(window_text) or final:
                # The tokens after read_offset ended on a character boundary: slide the window.
                self._prefix_offset = self._read_offset
                self._read_offset = len(self._ids)
                self._emitted_past_window = 0
        else:
            # Emit what precedes the partial character; keep the window so it is decoded whole later.
            stable = full_text.rstrip(_REPLACEMENT_CHAR)
            new_text = stable[len(window_text) + self._emitted_past_window:]
            self._emitted_past_window += len(new_text)
        if new_text:
            self._pieces.append(new_text)
        return new_text


class StopChecker:
    """Finds OpenAI ``stop`` strings in streamed text.

    ``update(delta)`` returns the part of the text that is safe to emit and whether a stop
    string was reached. The emitted text ends right before the earliest stop string (which is
    itself never emitted); a tail that could still grow into a stop string is held back until
    the next delta decides it. Empty strings in ``stop`` are ignored (they would match before
    any text). With no stop strings every delta passes straight through.
    """

    def __init__(self, stop: list[str]) -> None:
        self._stops = [s for s in dict.fromkeys(stop) if s]
        if len(self._stops) != len(stop):
            logger.debug("stop strings: ignoring empty or duplicate entries in %r", stop)
        self._held = ""
        self._stopped = False
        self.matched_stop: str | None = None

    @property
    def stopped(self) -> bool:
        return self._stopped

    def update(self, delta: str) -> tuple[str, bool]:
        """(text safe to emit now, stopped?) after ``delta`` is appended to the generated text."""
        if self._stopped:
            return "", True
        if not self._stops:
            return delta, False
        text = self._held + delta
        position, matched = self._earliest_stop(text)
        if matched is not None:
            self._stopped = True
            self.matched_stop = matched
            self._held = ""
            return text[:position], True
        keep = self._partial_stop_length(text)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], False

    def flush(self) -> str:
        """The held-back tail, when generation ends without reaching a stop string."""
        held, self._held = self._held, ""
        return "" if self._stopped else held

    def _earliest_stop(self, text: str) -> tuple[int, str | None]:
        best_position, best_stop = len(text), None
        for stop in self._stops:
            position = text.find(stop)
            if position != -1 and position < best_position:
                best_position, best_stop = position, stop
        return best_position, best_stop

    def _partial_stop_length(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return longest
