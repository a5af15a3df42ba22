"""States of a device KV block (ARCHITECTURE.md) and which accesses each state allows."""
from __future__ import annotations

import enum


class BlockState(enum.IntEnum):
    FREE = 0
    IN_USE = 1  # referenced by a running sequence: execute_model reads/writes it
    CACHED = 2  # holds a cached prefix, no reference: evictable
    SWAP_OUT = 3  # being copied device -> host: read-only for the transfer process, not reusable
    SWAP_IN = 4  # being filled host -> device: nobody else may touch it
    LOAD = 5  # being filled storage (or a P/D prefill instance) -> device: nobody else may touch it
    WRITE_BACK = 6  # being copied device -> storage: read-only for the transfer process, not reusable


# State the transfer process requires of a device block before each kind of copy.
TRANSFER_REQUIRED_STATE = {
    "swap_out": BlockState.SWAP_OUT,
    "swap_in": BlockState.SWAP_IN,
    "write_back": BlockState.WRITE_BACK,
    "prefetch": BlockState.LOAD,
    "remote_read": BlockState.LOAD,  # P/D: filled from another instance's pool, exactly like a prefetch
}


class KVCacheSanitizerError(RuntimeError):
    """A process was about to touch a KV block whose state forbids it (FD_KVCACHE_SANITIZER=1)."""
