"""The device KV block pool: reference counts, block states, the free queue and the evictable LRU.

Every device block is in exactly one of these places:

- the free queue (no reference, no registered prefix), oldest released first;
- the cached LRU (no reference, holds the registered prefix of its hash): taken
  from, least recently used first, only when the free queue is empty;
- referenced by sequences (``ref_count`` > 0, IN_USE);
- quarantined: unreferenced with a copy in flight (``transfer_id`` set). It is
  parked only when its copy reports, so no copy ever races a new owner.

Every state change is mirrored into ``state_array`` (shared memory) that the
worker and the transfer process check under the sanitizer. Whether a block's
hash is the registered one is asked of the ``PrefixIndex``; evicting a cached
block drops its entry there.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from cache_manager.block_state import BlockState
from cache_manager.prefix_index import PrefixIndex


class BlockAllocationError(RuntimeError):
    pass


@dataclass
class DeviceBlock:
    block_id: int
    ref_count: int = 0
    block_hash: str | None = None
    state: BlockState = BlockState.FREE
    transfer_id: int | None = None  # a copy in flight on this block


class BlockPool:
    def __init__(self, num_blocks: int, index: PrefixIndex, state_array: np.ndarray | None = None) -> None:
        self.num_blocks = num_blocks
        self.blocks = [DeviceBlock(i) for i in range(num_blocks)]
        self.state_array = state_array if state_array is not None else np.zeros(num_blocks, np.int8)
        self.state_array[:] = BlockState.FREE
        self._index = index
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached_lru: OrderedDict[int, None] = OrderedDict()  # ref 0, hashed, evictable; oldest first

    # ---- counts -----------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks a take can get now: free ones plus unreferenced cached ones."""
        return len(self._free) + len(self._cached_lru)

    @property
    def num_never_cached_free(self) -> int:
        """Free blocks that hold nothing worth keeping (the offload watermark counts these)."""
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        return len(self._cached_lru)

    def is_evictable(self, block_id: int) -> bool:
        return block_id in self._cached_lru

    def evictable_blocks(self) -> Iterator[DeviceBlock]:
        """Unreferenced cached blocks, least recently used first."""
        for block_id in self._cached_lru:
            yield self.blocks[block_id]

    # ---- references -------------------------------------------------------------------

    def take(self) -> int:
        """A block with one reference: a free one, else the least recently used cached one (evicted)."""
        if self._free:
            block_id, _ = self._free.popitem(last=False)
        elif self._cached_lru:
            block_id, _ = self._cached_lru.popitem(last=False)
            self.forget_hash(self.blocks[block_id])
        else:
            raise BlockAllocationError("no free or evictable device block left")
        block = self.blocks[block_id]
        self.set_state(block, BlockState.IN_USE)
        block.ref_count = 1
        return block_id

    def share(self, block_id: int) -> None:
        """One more reference to a block that holds a shareable prefix."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self._cached_lru.pop(block_id, None)
            if block.transfer_id is None:
                self.set_state(block, BlockState.IN_USE)
        block.ref_count += 1

    def release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count > 0:
            return
        if block.transfer_id is not None:
            return  # quarantined: end_copy parks it when the copy completes
        self._park(block)

    def _park(self, block: DeviceBlock) -> None:
        """An unreferenced, idle block: cached if it holds a registered prefix, else free."""
        if self._index.holds_device(block.block_hash, block.block_id):
            self.set_state(block, BlockState.CACHED)
            self._cached_lru[block.block_id] = None
        else:
            block.block_hash = None
            self.set_state(block, BlockState.FREE)
            self._free[block.block_id] = None

    def register(self, block_id: int, block_hash: str) -> None:
        """Make ``block_id`` the shareable holder of ``block_hash``."""
        self.blocks[block_id].block_hash = block_hash
        self._index.add_device(block_hash, block_id)

    def forget_hash(self, block: DeviceBlock) -> None:
        self._index.remove_device(block.block_hash, block.block_id)
        block.block_hash = None

    def set_state(self, block: DeviceBlock, state: BlockState) -> None:
        block.state = state
        self.state_array[block.block_id] = state

    # ---- copies in flight -------------------------------------------------------------

    def withdraw(self, block_id: int) -> None:
        """Take an unreferenced cached block off the LRU before a copy-out: it must not be reused meanwhile."""
        self._cached_lru.pop(block_id, None)

    def begin_copy(self, block_id: int, task_id: int, state: BlockState | None) -> None:
        block = self.blocks[block_id]
        block.transfer_id = task_id
        if state is not None:
            self.set_state(block, state)

    def end_copy(self, block_id: int) -> None:
        """A copy on the block completed: back to the state its references say."""
        block = self.blocks[block_id]
        block.transfer_id = None
        if block.ref_count > 0:
            self.set_state(block, BlockState.IN_USE)
        else:
            self._park(block)

    # ---- resets -----------------------------------------------------------------------

    def drop_cached(self) -> int:
        """Free every idle cached block (prefix reset); returns how many."""
        dropped = 0
        for block_id in list(self._cached_lru):
            block = self.blocks[block_id]
            if block.transfer_id is not None:
                continue
            del self._cached_lru[block_id]
            self.forget_hash(block)
            self._park(block)
            dropped += 1
        return dropped

    def forget_all(self) -> None:
        """The device memory was recreated: every block is free and empty (the caller cleared the index)."""
        self._cached_lru.clear()
        self._free.clear()
        for block in self.blocks:
            block.ref_count = 0
            block.block_hash = None
            block.transfer_id = None
            self.set_state(block, BlockState.FREE)
            self._free[block.block_id] = None
