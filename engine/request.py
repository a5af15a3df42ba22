"""Messages between the API server and the engine process (ZMQ, pickled).

Two channels per DP rank (addresses in ``engine_process.EngineAddresses``):

- requests: the API server sends ``EngineRequest`` / ``AbortRequest`` (``requests``); the engine
  answers with ``RequestOutput`` batches (``outputs``). Token ids only: text is the API server's
  business (tokenizer, detokenizer, stop strings).
- control: the API server sends a ``ControlRequest`` (``control_requests``); the engine answers
  each with exactly one reply (``control_replies``): ``ResetPrefixCacheReply``,
  ``CacheStatsReply`` or ``ControlError``, matched by ``request_id``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

from config.sampling_params import SamplingParams
from inter_communicator.messages import TokenLogprobs


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = 0.0
    # P/D disaggregation (engine/disaggregation.py): the request's kv_transfer_params object, as sent.
    kv_transfer_params: dict[str, Any] | None = None


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
    index: int = 0  # choice index (n > 1): ``finished`` is per choice; a request ends when all n did
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when sampling_params.logprobs is set
    # Every prompt token's logprobs (None for the first token), once, in the output that ends the prefill.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # P/D prefill instance, in the finishing output: the offer for the decode instance (response top level).
    kv_transfer_params: dict[str, Any] | None = None


# Control commands (``ControlRequest.command``).
RESET_PREFIX_CACHE = "reset_prefix_cache"
CACHE_STATS = "cache_stats"
CONTROL_COMMANDS = (RESET_PREFIX_CACHE, CACHE_STATS)


@dataclass
class ControlRequest:
    """An administrative command for the engine: one of ``CONTROL_COMMANDS``."""

    request_id: str
    command: str


@dataclass
class ResetPrefixCacheReply:
    """The device and host tiers' cached prefixes were dropped (the storage tier is kept)."""

    request_id: str
    dropped_blocks: int

    def to_json(self) -> dict[str, Any]:
        return {"dropped_blocks": self.dropped_blocks}


@dataclass
class CacheStatsReply:
    """The prefix cache's counters and gauges (``PrefixCacheManager.summary()``), by name."""

    request_id: str
    cache: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return dict(self.cache)


@dataclass
class ControlError:
    """The command failed (unknown command, or the engine raised while running it)."""

    request_id: str
    error: str


ControlReply = Union[ResetPrefixCacheReply, CacheStatsReply, ControlError]
