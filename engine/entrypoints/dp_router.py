"""Data-parallel routing: one API server in front of N engine replicas.

``DPRouter`` has the ``EngineClient`` interface, so the API server does not know
how many ranks there are. A request goes to the rank that served the same
prompt prefix before (its prefix cache is warm there) unless that rank is
overloaded compared with the least loaded one; otherwise to the least loaded
rank. Load is the number of requests a rank is working on. Only ranks whose engine is
running take requests: while one restarts (or stays down) the others serve everything.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Any, AsyncIterator

from cache_manager.block_hash import ROOT_HASH, hash_block
from engine.entrypoints.engine_client import CONTROL_TIMEOUT_S, EngineClient, EngineUnavailableError
from engine.request import EngineRequest, RequestOutput

logger = logging.getLogger(__name__)


class DPRouter:
    def __init__(self, clients: list[EngineClient], block_size: int, affinity_slack: int = 4,
                 max_remembered_prefixes: int = 65536) -> None:
        if not clients:
            raise ValueError("DPRouter needs at least one engine client")
        self.clients = clients
        self.tokenizer = clients[0].tokenizer
        self.block_size = block_size
        # A warm rank is preferred while it has at most this many more requests than the idlest rank.
        self.affinity_slack = affinity_slack
        self._prefix_owner: OrderedDict[str, int] = OrderedDict()
        self._max_prefixes = max_remembered_prefixes
        self._request_rank: dict[str, int] = {}

    async def start(self) -> None:
        for client in self.clients:
            await client.start()

    async def close(self) -> None:
        for client in self.clients:
            await client.close()

    @property
    def num_active_requests(self) -> int:
        return sum(c.num_active_requests for c in self.clients)

    def _prefix_key(self, prompt: list[int]) -> str | None:
        """Hash of the prompt's first full block: the part most likely shared and cached."""
        if len(prompt) < self.block_size:
            return None
        return hash_block(ROOT_HASH, prompt[: self.block_size], "router")

    @property
    def accepting(self) -> bool:
        return any(c.accepting for c in self.clients)

    def unavailable_reason(self) -> str:
        return "; ".join(c.unavailable_reason() for c in self.clients if not c.accepting)

    def stop_accepting(self) -> None:
        for client in self.clients:
            client.stop_accepting()

    def fail_all(self, reason: str) -> int:
        return sum(c.fail_all(reason) for c in self.clients)

    async def wait_idle(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        idle = True
        for client in self.clients:
            idle = await client.wait_idle(max(0.0, deadline - time.monotonic())) and idle
        return idle

    def engine_restarts(self) -> dict[int, int]:
        restarts: dict[int, int] = {}
        for client in self.clients:
            restarts.update(client.engine_restarts())
        return restarts

    def choose_rank(self, prompt: list[int]) -> int:
        """The rank for a prompt; ``EngineUnavailableError`` if no rank takes requests now."""
        available = [i for i, c in enumerate(self.clients) if c.accepting]
        if not available:
            raise EngineUnavailableError(self.unavailable_reason())
        loads = [c.num_active_requests for c in self.clients]
        idlest = min(available, key=loads.__getitem__)
        key = self._prefix_key(prompt)
        owner = self._prefix_owner.get(key) if key else None
        warm = owner is not None and owner in available and loads[owner] <= loads[idlest] + self.affinity_slack
        rank = owner if warm else idlest
        if key:
            self._prefix_owner[key] = rank
            self._prefix_owner.move_to_end(key)
            if len(self._prefix_owner) > self._max_prefixes:
                self._prefix_owner.popitem(last=False)
        return rank

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        rank = self.choose_rank(request.prompt_token_ids)
        self._request_rank[request.request_id] = rank
        try:
            async for output in self.clients[rank].generate(request):
                yield output
        finally:
            self._request_rank.pop(request.request_id, None)

    async def abort(self, request_id: str) -> None:
        rank = self._request_rank.get(request_id)
        if rank is not None:
            await self.clients[rank].abort(request_id)

    async def reset_prefix_cache(self, timeout: float = CONTROL_TIMEOUT_S) -> dict[str, Any]:
        """Reset every running rank's prefix cache (a restarting rank has an empty one anyway)."""
        return _merge([await c.reset_prefix_cache(timeout) for c in self._running()])

    async def cache_stats(self, timeout: float = CONTROL_TIMEOUT_S) -> dict[str, Any]:
        """Every running rank's ``cache_stats`` under ``ranks``, numeric values summed at the top."""
        return _merge([await c.cache_stats(timeout) for c in self._running()])

    def _running(self) -> list[EngineClient]:
        running = [c for c in self.clients if c.accepting]
        if not running:
            raise EngineUnavailableError(self.unavailable_reason())
        return running

    def kvcache_lock_stats(self) -> dict[int, dict[str, Any] | None]:
        """``{dp_rank: KVCacheLock.stats() or None}`` of every rank (see ``EngineClient``)."""
        stats: dict[int, dict[str, Any] | None] = {}
        for client in self.clients:
            stats.update(client.kvcache_lock_stats())
        return stats

    def engine_stats(self) -> dict[str, int]:
        """Every rank's shared-memory gauges, summed."""
        total: dict[str, int] = {}
        for client in self.clients:
            for name, value in client.engine_stats().items():
                total[name] = total.get(name, 0) + value
        return total

    def health(self) -> dict:
        ranks = [c.health() for c in self.clients]
        healthy = all(r["status"] == "ok" for r in ranks)
        scheduler: dict = {}
        for rank in ranks:
            for name, value in rank.get("scheduler", {}).items():
                scheduler[name] = scheduler.get(name, 0) + value
        return {
            "status": "ok" if healthy else "unhealthy",
            "data_parallel_size": len(ranks),
            "ranks": ranks,
            "scheduler": scheduler,
            "workers": [{**w, "dp_rank": dp} for dp, r in enumerate(ranks) for w in r["workers"]],
            "cache_transfer": [{**t, "dp_rank": dp} for dp, r in enumerate(ranks) for t in r.get("cache_transfer", [])],
            "active_requests": self.num_active_requests,
            "engine_restarts": sum(r.get("engine_restarts", 0) for r in ranks),
        }


def _merge(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-rank replies under ``ranks``; their numeric values (not ``dp_rank``) summed at the top."""
    merged: dict[str, Any] = {"ranks": results}
    for result in results:
        for name, value in result.items():
            if name != "dp_rank" and isinstance(value, (int, float)) and not isinstance(value, bool):
                merged[name] = merged.get(name, 0) + value
    return merged
