"""Sampling parameters of one request, validated once at the API boundary."""
from __future__ import annotations

from dataclasses import dataclass, field

from config.structured_output import StructuredOutputSpec


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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1
