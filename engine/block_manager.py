"""The pool of KV-cache blocks on the device tier and each sequence's block table.

Blocks are plain integers indexing the worker's cache arrays. The manager only
does bookkeeping; the worker owns the memory. Allocation is all-or-nothing per
call so a failed allocation leaves no half-grown block table behind.
"""
from __future__ import annotations

import logging
from collections import deque

from engine.sequence import Sequence

logger = logging.getLogger(__name__)


class BlockAllocationError(RuntimeError):
    pass


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        missing = self.blocks_needed(num_tokens) - len(seq.block_table)
        return missing <= len(self._free)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow ``seq.block_table`` to hold ``num_tokens`` tokens."""
        missing = self.blocks_needed(num_tokens) - len(seq.block_table)
        if missing > len(self._free):
            raise BlockAllocationError(f"{seq.request_id}: needs {missing} more blocks, {len(self._free)} free")
        for _ in range(missing):
            seq.block_table.append(self._free.popleft())

    def free(self, seq: Sequence) -> None:
        # Most recently used blocks go to the back so they are reused last
        # (cheap locality for a later prefix cache).
        self._free.extend(seq.block_table)
        seq.block_table = []
