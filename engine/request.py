"""Messages between the API server and the engine process (ZMQ, pickled).

Data flows one way: the API server sends ``EngineRequest`` / ``AbortRequest``;
the engine answers with ``RequestOutput`` batches. Token ids only: text is the
API server's business (tokenizer, detokenizer, stop strings).
"""
from __future__ import annotations

from dataclasses import dataclass

from config.sampling_params import SamplingParams


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = 0.0


@dataclass
class AbortRequest:
    request_id: str


@dataclass
class RequestOutput:
    """New tokens of one request since its previous output."""

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None


@dataclass
class ControlRequest:
    """An administrative command for the engine (``reset_prefix_cache``, ``cache_stats``)."""

    request_id: str
    command: str


@dataclass
class ControlReply:
    request_id: str
    result: dict
    error: str | None = None
