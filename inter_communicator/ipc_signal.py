"""IPCSignal: small named arrays shared between fdserve processes.

Owns the signals the processes use to observe each other without a message round trip:
readiness and model-loaded flags, heartbeat timestamps, health, step counters, block states.
Payloads (batches, tokens) do not belong here; they travel over ZMQ.

Memory ordering: there is no lock and no fence. Each element has exactly one writing process;
aligned scalar stores of native numpy dtypes (<= 8 bytes) are not torn on x86-64 or ARM64, so a
reader sees the old or the new value of an element, possibly stale, never a mix. Readers must
tolerate staleness (poll with a sleep, compare timestamps with a margin) and must not assume
that two elements written one after the other become visible in that order; anything needing
consistency across several values goes through ZMQ instead.
"""
from __future__ import annotations

import logging

import numpy as np

from inter_communicator.shm import SharedArray, ipc_name

logger = logging.getLogger(__name__)


class IPCSignal:
    """A named shared numpy array ``fd.<instance_id>.<name>.<dp_rank>``.

    Shape and dtype come from ``array``. The creator initialises the segment with
    ``array``'s values; an attacher only uses its shape and dtype and sees the live values.
    ``value`` is the shared array itself: write elements in place (``sig.value[0] = 1``).
    """

    def __init__(
        self,
        name: str,
        array: np.ndarray,
        instance_id: str,
        dp_rank: int = 0,
        *,
        create: bool,
    ) -> None:
        if not isinstance(array, np.ndarray):
            raise TypeError(f"IPCSignal {name}: array must be a numpy array, got {type(array).__name__}")
        self.name = name
        self.shm_name = ipc_name(instance_id, name, dp_rank)
        self._shared = SharedArray(self.shm_name, array.shape or (1,), array.dtype, create=create)
        self.value = self._shared.array if array.shape else self._shared.array.reshape(())
        if create:
            self.value[...] = array
        logger.debug("%s IPC signal %s %s %s", "created" if create else "attached", self.shm_name, array.shape, array.dtype)

    @property
    def created(self) -> bool:
        return self._shared.created

    def close(self) -> None:
        """Drop this process's mapping (the name stays until the creator unlinks it)."""
        self.value = None
        self._shared.close()

    def unlink(self) -> bool:
        """Remove the name; creator only, idempotent. True if this call removed it."""
        return self._shared.unlink()

    def __repr__(self) -> str:
        return f"IPCSignal({self.shm_name!r}, shape={self._shared.shape}, dtype={self._shared.dtype})"
