"""What the KV-cache manager needs to know of a request: its tokens, its blocks and its progress.

The engine's ``Sequence`` satisfies this protocol; the cache manager depends on the protocol, not on the
engine, so the layers run one way (engine -> cache_manager). The cache manager writes ``block_table``,
``block_hashes``, ``num_computed_tokens``, ``num_cached_tokens``, ``skip_cache_once`` and ``remote_prefill`` (set
to None once used); the engine owns the rest. ``remote_prefill`` is optional (read with getattr).
"""
from __future__ import annotations

from typing import Protocol


class CacheSequence(Protocol):
    request_id: str
    block_table: list[int]  # device block ids, in token order
    block_hashes: list[str]  # chained hashes of the leading full blocks of block_table
    num_computed_tokens: int  # tokens whose K/V are in the cache
    num_cached_tokens: int  # prompt tokens served from a cache tier at first admission
    skip_cache_once: bool  # a fill timed out: the next admission recomputes instead of retrying lower tiers

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_uncomputed_tokens(self) -> int: ...

    def token_ids_slice(self, start: int, end: int) -> list[int]: ...
