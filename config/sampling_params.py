"""Sampling parameters of one request, validated once at the API boundary."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from config.structured_output import StructuredOutputSpec


# logprobs / top_logprobs / prompt_logprobs: OpenAI's completions cap is 5, chat's 20; vLLM takes 20.
MAX_LOGPROBS = 20
# Choices per request: OpenAI documents no cap, vLLM none either; 128 keeps one request from filling the
# whole batch (every choice is one running sequence) while leaving room for n-best style evaluation.
MAX_N = 128


class InvalidRequestError(ValueError):
    """A client error: becomes an HTTP 400 with this message."""


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # Logits processing (vLLM's definitions; applied batched in the worker's sampler).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0  # eos and stop_token_ids are banned until this many tokens were generated
    min_p: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)  # tokenized by the API server
    # Log-probabilities: None = off; k = the chosen token's logprob plus the k most likely alternatives.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Choices sampled from one prompt (prefilled once, KV blocks shared).
    n: int = 1
    structured_output: StructuredOutputSpec | None = None

    def validate(self) -> None:
        """Raise ``InvalidRequestError`` naming the first out-of-range field (its message starts with
        the field name: the API maps it to the request parameter)."""
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise InvalidRequestError(f"top_k must be -1, 0 or positive, got {self.top_k}")
        if self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidRequestError(f"seed must be in [0, 2**63), got {self.seed}")
        self._validate_logits_controls()
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (_is_int(value) and 0 <= value <= MAX_LOGPROBS):
                raise InvalidRequestError(f"{name} must be null or an integer in [0, {MAX_LOGPROBS}], got {value!r}")
        if not (_is_int(self.n) and 1 <= self.n <= MAX_N):
            raise InvalidRequestError(f"n must be an integer in [1, {MAX_N}], got {self.n!r}")

    def _validate_logits_controls(self) -> None:
        # NaN passes every comparison unnoticed, so each float is first checked to be finite.
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (_is_finite_number(value) and -2.0 <= value <= 2.0):
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {value!r}")
        if not (_is_finite_number(self.repetition_penalty) and self.repetition_penalty > 0):
            raise InvalidRequestError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")
        if not (_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens):
            raise InvalidRequestError(
                f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        if not (_is_finite_number(self.min_p) and 0.0 <= self.min_p <= 1.0):
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not isinstance(self.logit_bias, dict):
            raise InvalidRequestError(f"logit_bias must be a map of token id to bias, got {type(self.logit_bias).__name__}")
        for token, bias in self.logit_bias.items():
            if not (_is_int(token) and token >= 0):
                raise InvalidRequestError(f"logit_bias keys must be non-negative token ids, got {token!r}")
            if not (_is_finite_number(bias) and -100.0 <= bias <= 100.0):
                raise InvalidRequestError(f"logit_bias values must be in [-100, 100], got {bias!r} for token {token}")
        if not isinstance(self.bad_words_token_ids, list):
            raise InvalidRequestError("bad_words_token_ids must be a list of token-id lists")
        for word in self.bad_words_token_ids:
            if not (isinstance(word, list) and word and all(_is_int(t) and t >= 0 for t in word)):
                raise InvalidRequestError(
                    f"bad_words_token_ids entries must be non-empty lists of non-negative token ids, got {word!r}")

    @property
    def needs_logits_processing(self) -> bool:
        """True when a control changes this request's logits before sampling (penalties, bias, bad
        words). min_tokens bans and structured-output masks arrive per step on ``ScheduledSeq``."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
                or bool(self.logit_bias) or bool(self.bad_words_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def _is_int(value: object) -> bool:
    # bool is an int subclass; "logprobs": true must not pass as 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
