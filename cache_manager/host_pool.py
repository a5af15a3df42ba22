"""The host (CPU memory) KV block pool: free list, LRU of cached blocks, pins of copies in flight.

A host block is free, cached (its hash in the ``PrefixIndex`` host map, in the
LRU), or pinned by copies reading or writing it. A pinned block is never handed
out or dropped; the transfer planner pins and unpins around each copy and
decides what an evicted block's last copy needs (a write-back).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from cache_manager.prefix_index import PrefixIndex


@dataclass
class HostBlock:
    host_id: int
    block_hash: str | None = None
    pinned: int = 0  # copies in flight reading or writing it


class HostPool:
    def __init__(self, num_blocks: int, index: PrefixIndex) -> None:
        self.blocks = [HostBlock(i) for i in range(num_blocks)]
        self._index = index
        self._free: list[int] = list(range(num_blocks))[::-1]
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached and indexed; oldest first

    @property
    def num_used(self) -> int:
        return len(self.blocks) - len(self._free)

    def take_free(self) -> int | None:
        return self._free.pop() if self._free else None

    def evict_lru(self) -> HostBlock | None:
        """Unindex the least recently used unpinned cached block and return it, its hash still set."""
        for host_id in self._lru:
            host = self.blocks[host_id]
            if host.pinned:
                continue
            del self._lru[host_id]
            self._index.remove_host(host.block_hash, host_id)
            return host
        return None

    def store(self, host_id: int, block_hash: str) -> bool:
        """A copy into ``host_id`` completed: cache it unless another host block holds the hash already."""
        if self._index.has_host(block_hash):
            self.put_back(host_id)
            return False
        self.blocks[host_id].block_hash = block_hash
        self._index.add_host(block_hash, host_id)
        self._lru[host_id] = None
        return True

    def put_back(self, host_id: int) -> None:
        if host_id not in self._free:
            self._free.append(host_id)

    def put_back_if_idle(self, host_id: int) -> None:
        """Free an evicted block once its last copy is done (it holds nothing and nothing pins it)."""
        host = self.blocks[host_id]
        if host.block_hash is None and not host.pinned:
            self.put_back(host_id)

    def touch(self, host_id: int) -> None:
        self._lru.move_to_end(host_id)

    def pin(self, host_id: int) -> None:
        self.blocks[host_id].pinned += 1

    def unpin(self, host_id: int) -> None:
        self.blocks[host_id].pinned -= 1

    def drop_cached(self) -> int:
        """Free every unpinned cached block (prefix reset); returns how many."""
        dropped = 0
        for host_id in list(self._lru):
            host = self.blocks[host_id]
            if host.pinned:
                continue
            del self._lru[host_id]
            self._index.remove_host(host.block_hash, host_id)
            host.block_hash = None
            self._free.append(host_id)
            dropped += 1
        return dropped

    def forget_all(self) -> None:
        """The host memory is gone (its process died): every block is free and unpinned."""
        self._index.clear_host()
        self._lru.clear()
        for host in self.blocks:
            host.block_hash = None
            host.pinned = 0
        self._free = list(range(len(self.blocks)))[::-1]
