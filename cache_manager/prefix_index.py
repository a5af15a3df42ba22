"""The prefix cache's lookup tables: block hash -> device block, block hash -> host block.

Owns only the two maps. A hash is in the device map while exactly one device block
holds those contents and may be shared (cached or in use); a block being copied
out is taken off the map so nobody matches it mid-copy. The host map lists host
blocks whose copy-out completed. Which block a hash points at, and when an entry
is dropped, is decided by the block pool, the host pool and the transfer planner.
"""
from __future__ import annotations


class PrefixIndex:
    def __init__(self) -> None:
        self._device: dict[str, int] = {}
        self._host: dict[str, int] = {}

    # ---- device tier ------------------------------------------------------------------

    def device_block(self, block_hash: str) -> int | None:
        return self._device.get(block_hash)

    def has_device(self, block_hash: str) -> bool:
        return block_hash in self._device

    def holds_device(self, block_hash: str | None, block_id: int) -> bool:
        """Whether ``block_id`` is the registered holder of ``block_hash`` (a private duplicate is not)."""
        return block_hash is not None and self._device.get(block_hash) == block_id

    def add_device(self, block_hash: str, block_id: int) -> None:
        self._device[block_hash] = block_id

    def remove_device(self, block_hash: str | None, block_id: int) -> None:
        """Drop the entry only if ``block_id`` holds it, so a duplicate's release never unregisters the original."""
        if self.holds_device(block_hash, block_id):
            del self._device[block_hash]

    def device_items(self) -> list[tuple[str, int]]:
        return list(self._device.items())

    @property
    def num_device(self) -> int:
        return len(self._device)

    def clear_device(self) -> None:
        self._device.clear()

    # ---- host tier --------------------------------------------------------------------

    def host_block(self, block_hash: str) -> int | None:
        return self._host.get(block_hash)

    def has_host(self, block_hash: str) -> bool:
        return block_hash in self._host

    def add_host(self, block_hash: str, host_id: int) -> None:
        self._host[block_hash] = host_id

    def remove_host(self, block_hash: str | None, host_id: int) -> None:
        if block_hash is not None and self._host.get(block_hash) == host_id:
            del self._host[block_hash]

    def host_ids(self) -> set[int]:
        return set(self._host.values())

    def clear_host(self) -> None:
        self._host.clear()
