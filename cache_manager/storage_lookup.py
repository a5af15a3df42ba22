"""The engine's own view of the storage tier: which block keys exist there now, asked with a bounded wait.

This module owns ``StorageLookup``, the lightweight lookup handle the engine process holds beside the
cache transfer process's full backend (the design LMCache's scheduler-side lookup uses): at admission
the KV-cache manager asks it, in ONE batched call per request, which of the request's remaining block
keys the store holds, so blocks written by another instance on the same Mooncake master or file
directory, by another DP rank, or by an earlier process on the same ``--file-backend-storage-dir`` are
found, not only the ones this process wrote.

- The call runs in its own daemon thread and the engine waits at most ``timeout_s``: a slow or dead
  store costs a miss (counted as a timeout), never a stall of the engine loop. While a timed-out call
  is still running, later lookups do not queue behind it: they are misses at once.
- The answer is not verified (``exists`` only): the prefetch that follows reads each object through
  the backend, which checks its key, length and crc32; a mismatch there is a miss and the sequence
  recomputes that block (``TransferPlanner._finish_plan``).
- The backend is used by one call at a time (backends are single-threaded, base.py): a new call
  starts only after the previous one returned.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Callable

from cache_manager.transfer_factory.base import KVStorageBackend
from config.engine_config import StorageConfig

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class LookupResult:
    """One batched lookup: per key whether it exists; ``timed_out`` when the store did not answer in time."""

    exists: list[bool]
    seconds: float
    timed_out: bool = False


class StorageLookup:
    """Batched, time-bounded ``exists`` over a storage backend; see the module docstring."""

    def __init__(self, backend: KVStorageBackend, timeout_s: float,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if not timeout_s > 0:
            raise ValueError(f"the storage lookup timeout must be positive, got {timeout_s}")
        self.backend = backend
        self.timeout_s = timeout_s
        self._clock = clock
        self._pending: _Call | None = None  # a call that outlived its timeout
        self._warned_slow = False
        self._closed = False

    def lookup(self, keys: list[str]) -> LookupResult:
        """Which of ``keys`` exist, waiting at most ``timeout_s``; all False on timeout or error."""
        if not keys:
            return LookupResult([], 0.0)
        started = self._clock()
        if self._closed or (self._pending is not None and not self._pending.done.is_set()):
            # The previous call still hangs in the store: do not queue behind it.
            return LookupResult([False] * len(keys), 0.0, timed_out=not self._closed)
        self._pending = None
        call = _Call(self.backend, keys)
        # A daemon thread per call: a call hung in the store can never hold up the process's exit.
        threading.Thread(target=call.run, name="storage-lookup", daemon=True).start()
        if not call.done.wait(self.timeout_s):
            self._pending = call
            if not self._warned_slow:
                self._warned_slow = True
                logger.warning("storage lookup of %d keys took longer than %.3f s; counted as misses "
                               "(FD_STORAGE_LOOKUP_TIMEOUT_S; logged once)", len(keys), self.timeout_s)
            return LookupResult([False] * len(keys), self._clock() - started, timed_out=True)
        seconds = self._clock() - started
        if call.error is not None:
            # exists() reports an unreachable store as False itself; this is a closed or misused backend.
            logger.error("storage lookup failed: %s", call.error)
            return LookupResult([False] * len(keys), seconds)
        if len(call.found) != len(keys):
            logger.error("storage lookup answered %d results for %d keys; treating all as misses",
                         len(call.found), len(keys))
            return LookupResult([False] * len(keys), seconds)
        return LookupResult([bool(hit) for hit in call.found], seconds)

    def close(self) -> None:
        """Close the backend, unless a hung call still uses it (the process's exit ends that one)."""
        if self._closed:
            return
        self._closed = True
        if self._pending is None or self._pending.done.is_set():
            self.backend.close()


class _Call:
    """One exists call running in its own thread; ``done`` is set when it returned or raised."""

    def __init__(self, backend: KVStorageBackend, keys: list[str]) -> None:
        self.backend = backend
        self.keys = keys
        self.found: list[bool] = []
        self.error: Exception | None = None
        self.done = threading.Event()

    def run(self) -> None:
        try:
            self.found = list(self.backend.exists(self.keys))
        except (OSError, RuntimeError, ValueError) as exc:
            self.error = exc
        finally:
            self.done.set()


def create_storage_lookup(config: StorageConfig) -> StorageLookup:
    """A lookup handle on the store ``config`` names, separate from the transfer process's client.

    Mooncake: a client that contributes no memory to the store (it only asks ``batch_is_exist``).
    File: the same directory and namespace; ``exists`` is a stat per key file.
    """
    if config.backend == "mooncake":
        # Imported here: the Mooncake client is optional on file-only hosts.
        from cache_manager.transfer_factory.mooncake_backend import MooncakeStorageBackend

        backend: KVStorageBackend = MooncakeStorageBackend(
            config.mooncake_master_addr, metadata_server=config.mooncake_metadata_server,
            protocol=config.mooncake_protocol, local_buffer_size=config.mooncake_local_buffer_size,
            local_hostname=config.mooncake_local_hostname, namespace=config.namespace,
            reconnect_interval_s=config.mooncake_reconnect_interval_s,
            rebuild_after_s=config.mooncake_rebuild_after_s, lookup_only=True)
    else:
        from cache_manager.transfer_factory.factory import create_storage_backend

        # Never evicts: only the transfer process's writer enforces --file-backend-max-bytes.
        backend = create_storage_backend(dataclasses.replace(config, file_max_bytes=0))
    return StorageLookup(backend, config.lookup_timeout_s)
