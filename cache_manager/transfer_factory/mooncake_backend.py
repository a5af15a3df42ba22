"""The ``mooncake`` KV-cache storage backend: objects in a real Mooncake distributed store.

This module owns the Mooncake client of one process: connecting (with a warm-up round trip),
detecting an unreachable master, reconnecting, and mapping Mooncake's integer return codes
to hits, misses and counted errors.

Behaviour measured against mooncake-transfer-engine-non-cuda 0.3.13 (TCP, P2PHANDSHAKE):

- ``put`` on an existing key returns 0 but keeps the old bytes, so puts use ``upsert_parts``
  (insert or overwrite; the header and the payload go in as two parts, no concatenation).
- ``remove`` within the read lease after a ``get`` fails (-706), so every remove is forced.
- ``setup`` against a dead master retries internally for ~90 s, so a TCP connect probe
  (1 s timeout) gates every (re)connect attempt, made at most once per
  ``reconnect_interval_s``.
- With the master gone, an operation can block ~4.5 s before failing with RPC_FAIL (-900),
  while ``health_check()`` answers at once (but may lag the master's death by ~1 s). Each
  batch therefore asks ``health_check()`` first; after a bad health or an RPC failure the
  backend is *degraded*: it skips the rest of the batch and sends nothing until a TCP probe
  of the master succeeds (at most once per ``reconnect_interval_s``) and the client reports
  healthy again. After a master restart on the same address the client re-registers by
  itself within ~1-2 s; one still unhealthy ``rebuild_after_s`` after the master came back
  is closed and rebuilt (closing a client whose master is gone blocks ~7 s, so never then).
- A restarted master has lost its metadata: objects stored before are misses.
- Objects are stored as header + payload (base.py). Gets land in a registered staging
  buffer, are verified (length, crc32, key) and only then copied into the caller's buffer:
  a failed transfer (which may still be writing into registered memory) or a corrupt object
  can never put garbage in the KV cache.

Keys are stored as ``<namespace>/<key>``; ``clear`` removes that prefix only.
Thread safety: one thread per instance (see base.py).
"""
from __future__ import annotations

import itertools
import logging
import re
import socket
import time
import uuid

import numpy as np

from cache_manager.transfer_factory.base import (
    HEADER_SIZE,
    BackendStats,
    CorruptObject,
    KVStorageBackend,
    StagingBuffer,
    byte_view,
    decode_header,
    encode_header,
    validate_keys,
    validate_namespace,
    verify_payload,
)

logger = logging.getLogger(__name__)

# Mooncake ErrorCode values (mooncake-store types.h); Python sees plain ints.
_OBJECT_NOT_FOUND = -704
_BUFFER_TOO_SMALL = -600  # INVALID_PARAMS, returned when the object is larger than the slot
_RPC_ERROR_RANGE = range(-999, -899)  # RPC_FAIL, RPC_TIMEOUT, ...
_HEALTHY = 0

_WARMUP_BYTES = 4096
_PROBE_TIMEOUT_S = 1.0
_STAGING_CHUNK_BYTES = 256 << 20  # larger batches are read in chunks of about this size
_MAX_WARNED_KEYS = 10_000


def _load_store_class() -> type:
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise RuntimeError(
            "the mooncake storage backend needs the Mooncake client: apt-get install libibverbs1 && "
            "pip install mooncake-transfer-engine-non-cuda (see .ci/install_system_deps.sh)") from exc
    return MooncakeDistributedStore


def parse_master_addr(master_addr: str) -> tuple[str, int]:
    host, sep, port = master_addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"Mooncake master address {master_addr!r} is not host:port")
    return host, int(port)


def master_reachable(master_addr: str, timeout_s: float = _PROBE_TIMEOUT_S) -> bool:
    """Whether something accepts TCP connections at the master's address."""
    host, port = parse_master_addr(master_addr)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


class MooncakeStorageBackend(KVStorageBackend):
    """KV blocks in a Mooncake store; see the module docstring."""

    name = "mooncake"

    def __init__(self, master_addr: str, *, metadata_server: str = "P2PHANDSHAKE", protocol: str = "tcp",
                 global_segment_size: int = 512 << 20, local_buffer_size: int = 64 << 20,
                 local_hostname: str = "127.0.0.1", rdma_devices: str = "", namespace: str = "default",
                 reconnect_interval_s: float = 5.0, rebuild_after_s: float = 30.0,
                 lookup_only: bool = False) -> None:
        if not master_addr:
            raise ValueError("the mooncake backend needs a master address (MOONCAKE_MASTER_SERVER_ADDR)")
        parse_master_addr(master_addr)
        validate_namespace(namespace)
        self._store_class = _load_store_class()
        self.master_addr = master_addr
        self.namespace = namespace
        self._setup_args = (local_hostname, metadata_server, int(global_segment_size), int(local_buffer_size),
                            protocol, rdma_devices, master_addr)
        self.reconnect_interval_s = reconnect_interval_s
        self.rebuild_after_s = rebuild_after_s
        # A lookup-only client (the engine's, storage_lookup.py) contributes no memory and only asks which
        # keys exist: its warm-up is an exists round trip, and puts/gets are refused.
        self.lookup_only = lookup_only
        if lookup_only:
            self._setup_args = (local_hostname, metadata_server, 0, min(int(local_buffer_size), 16 << 20),
                                protocol, rdma_devices, master_addr)
        self._stats = BackendStats()
        self._staging = StagingBuffer()
        # Registered memory that may still be a transfer target is kept alive until close().
        self._retired_staging: list[np.ndarray] = []
        self._store = None
        self._next_connect_at = 0.0
        self._degraded_since: float | None = None
        self._master_up_since: float | None = None  # while degraded: first successful probe
        self._next_probe_at = 0.0
        self._next_unreachable_log_at = 0.0
        self._warned_corrupt: set[str] = set()
        self._closed = False
        self._connect()

    # ---- connection --------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self._store is not None

    def _connect(self) -> bool:
        now = time.monotonic()
        if now < self._next_connect_at:
            return False
        self._next_connect_at = now + self.reconnect_interval_s
        if not master_reachable(self.master_addr):
            self._log_unreachable("nothing accepts connections there")
            return False
        started = time.perf_counter()
        store = self._store_class()
        rc = store.setup(*self._setup_args)
        if rc != 0:
            self._log_unreachable(f"setup returned {rc}")
            self._close_store(store)
            return False
        if self._staging.array.nbytes and store.register_buffer(self._staging.array.ctypes.data,
                                                                self._staging.array.nbytes) != 0:
            logger.warning("mooncake: registering the staging buffer failed; reads use the slow path")
        if not self._warm_up(store):
            self._close_store(store)
            return False
        self._store = store
        self._degraded_since = None
        logger.info("mooncake: connected to master %s (namespace %s) in %.0f ms",
                    self.master_addr, self.namespace, (time.perf_counter() - started) * 1e3)
        return True

    def _warm_up(self, store) -> bool:
        """Write, read back and remove 4 KB: proves the whole data path before real traffic."""
        if self.lookup_only:
            codes = store.batch_is_exist([f"{self.namespace}/.warmup-{uuid.uuid4().hex}"])
            if len(codes) != 1 or codes[0] not in (0, 1):
                self._log_unreachable(f"warm-up exists returned {codes}")
                return False
            return True
        key = f"{self.namespace}/.warmup-{uuid.uuid4().hex}"  # '.' keeps it out of user key space
        payload = np.random.default_rng().integers(0, 256, _WARMUP_BYTES, dtype=np.uint8)
        rc = store.upsert(key, memoryview(payload))
        if rc != 0:
            self._log_unreachable(f"warm-up put returned {rc}")
            return False
        readback = np.zeros_like(payload)
        got = store.get_into(key, readback.ctypes.data, readback.nbytes)
        store.remove(key, True)
        if got != _WARMUP_BYTES or not np.array_equal(readback, payload):
            self._log_unreachable(f"warm-up read back {got} bytes, content "
                                  f"{'matches' if np.array_equal(readback, payload) else 'differs'}")
            return False
        return True

    def _available(self) -> bool:
        """Whether the store can be used right now; reconnects (rate-limited) when it cannot.

        Healthy: one ``health_check`` (no RPC). Degraded (health bad, or an RPC failed):
        nothing is sent until a TCP probe of the master succeeds, at most once per
        ``reconnect_interval_s``, and the client reports healthy again, because
        ``health_check`` can still say healthy for a second after the master died while each
        call then blocks ~4.5 s.
        """
        if self._store is None:
            return self._connect()
        if self._degraded_since is None:
            health = self._store.health_check()
            if health == _HEALTHY:
                return True
            self._mark_degraded(f"health_check={health}")
        now = time.monotonic()
        if now < self._next_probe_at:
            return False
        self._next_probe_at = now + self.reconnect_interval_s
        if not master_reachable(self.master_addr):
            self._master_up_since = None
            self._log_unreachable("nothing accepts connections there")
            return False
        health = self._store.health_check()
        if health == _HEALTHY:
            logger.info("mooncake: master %s reachable again after %.1f s", self.master_addr,
                        now - self._degraded_since)
            self._degraded_since = None
            self._master_up_since = None
            return True
        if self._master_up_since is None:
            self._master_up_since = now
        self._log_unreachable(f"the master is up but health_check={health}; the client is reconnecting")
        if now - self._master_up_since < self.rebuild_after_s:
            return False
        # Only rebuild when the master has been up for a while: the client re-registers by
        # itself within ~2 s of a master restart, and closing a client whose master is gone
        # blocks ~7 s.
        logger.warning("mooncake: client still unhealthy %.0f s after the master came back; rebuilding it",
                       now - self._master_up_since)
        self._drop_store()
        self._next_connect_at = 0.0
        return self._connect()

    def _mark_degraded(self, detail: str) -> None:
        if self._degraded_since is None:
            self._degraded_since = time.monotonic()
            self._next_probe_at = 0.0  # the next call may probe at once
        self._log_unreachable(detail)

    def _log_unreachable(self, detail: str) -> None:
        # Every batch would otherwise log while the master is down; once per interval is enough.
        now = time.monotonic()
        if now >= self._next_unreachable_log_at:
            self._next_unreachable_log_at = now + self.reconnect_interval_s
            logger.error("mooncake: master %s unavailable (%s); storage reads are misses and writes "
                         "are dropped until it is back", self.master_addr, detail)

    def _drop_store(self) -> None:
        store, self._store = self._store, None
        self._degraded_since = None
        self._master_up_since = None
        if store is not None:
            self._close_store(store)

    @staticmethod
    def _close_store(store) -> None:
        rc = store.close()
        if rc != 0:
            logger.warning("mooncake: client close returned %d", rc)

    def _stored_key(self, key: str) -> str:
        return f"{self.namespace}/{key}"

    # ---- put ---------------------------------------------------------------------------

    def batch_put(self, keys: list[str], values: list[np.ndarray]) -> list[bool]:
        self._check_open()
        self._check_not_lookup_only("batch_put")
        validate_keys(keys, values)
        payloads = [byte_view(value) for value in values]
        if not keys:
            return []
        self._stats.puts += len(keys)
        results = [False] * len(keys)
        if not self._available():
            self._stats.put_errors += len(keys)
            return results
        failures: list[tuple[str, int]] = []
        for index, (key, payload) in enumerate(zip(keys, payloads)):
            rc = self._store.upsert_parts(self._stored_key(key), encode_header(key, payload), payload)
            if rc == 0:
                results[index] = True
                self._stats.put_bytes += payload.nbytes
                continue
            failures.append((key, rc))
            if rc in _RPC_ERROR_RANGE:
                self._mark_degraded(f"put returned rc={rc}")
                break  # each further call would block seconds on the dead connection
        self._stats.put_errors += results.count(False)
        if failures:
            key, rc = failures[0]
            logger.error("mooncake: %d of %d puts failed (first: %s rc=%d)%s", results.count(False), len(keys),
                         key, rc, "; rest of the batch skipped" if rc in _RPC_ERROR_RANGE else "")
        return results

    # ---- get ---------------------------------------------------------------------------

    def batch_get(self, keys: list[str], buffers: list[np.ndarray]) -> list[bool]:
        self._check_open()
        self._check_not_lookup_only("batch_get")
        validate_keys(keys, buffers)
        destinations = [byte_view(buffer, writable=True) for buffer in buffers]
        if not keys:
            return []
        self._stats.gets += len(keys)
        results = [False] * len(keys)
        if not self._available():
            self._stats.errors += len(keys)
        else:
            start = 0
            while start < len(keys):
                end = _chunk_end(destinations, start)
                if not self._get_chunk(keys, destinations, start, end, results):
                    self._stats.errors += len(keys) - end  # skipped: the connection just failed
                    break
                start = end
        hits = results.count(True)
        self._stats.hits += hits
        self._stats.misses += len(keys) - hits
        return results

    def _get_chunk(self, keys: list[str], destinations: list[memoryview], start: int, end: int,
                   results: list[bool]) -> bool:
        """Read keys[start:end] into the staging buffer, verify, copy hits out.

        Returns False when the connection failed and the rest of the batch should be skipped.
        """
        slot_sizes = [HEADER_SIZE + destinations[i].nbytes for i in range(start, end)]
        offsets = [0, *itertools.accumulate(slot_sizes[:-1])]
        self._ensure_staging(sum(slot_sizes))
        base = self._staging.array.ctypes.data
        codes = self._store.batch_get_into([self._stored_key(k) for k in keys[start:end]],
                                           [base + offset for offset in offsets], slot_sizes)
        connection_failed = False
        for slot, code in enumerate(codes):
            index = start + slot
            if code in _RPC_ERROR_RANGE:
                connection_failed = True
            results[index] = self._accept_slot(keys[index], destinations[index], offsets[slot], slot_sizes[slot], code)
        if connection_failed:
            self._mark_degraded("a batch read failed with an RPC error")
        return not connection_failed

    def _accept_slot(self, key: str, destination: memoryview, offset: int, slot_size: int, code: int) -> bool:
        if code == slot_size:
            raw = self._staging.view(offset, slot_size)
            try:
                header = decode_header(key, raw[:HEADER_SIZE])
                verify_payload(header, raw[HEADER_SIZE:])
            except CorruptObject as exc:
                self._handle_corrupt(key, exc)
                return False
            destination[:] = raw[HEADER_SIZE:]
            self._stats.get_bytes += destination.nbytes
            return True
        if code == _OBJECT_NOT_FOUND or code == _BUFFER_TOO_SMALL:
            return False  # absent, or stored with a larger payload than this buffer
        if code >= 0:
            self._classify_short_object(key, offset, code)
            return False
        self._stats.errors += 1
        if code not in _RPC_ERROR_RANGE:  # RPC failures are logged once per batch by the caller
            logger.error("mooncake: get %s failed with rc=%d", key, code)
        return False

    def _classify_short_object(self, key: str, offset: int, length: int) -> None:
        """An object shorter than the buffer: a smaller block (plain miss) or a torn one (corrupt)."""
        raw = self._staging.view(offset, length)
        try:
            header = decode_header(key, raw[:HEADER_SIZE])
            if header.payload_len != length - HEADER_SIZE:
                raise CorruptObject(f"object is {length} bytes, header says {HEADER_SIZE} + {header.payload_len}")
        except CorruptObject as exc:
            self._handle_corrupt(key, exc)
            return
        logger.debug("mooncake: %s holds %d bytes, buffer is larger: miss", key, header.payload_len)

    def _handle_corrupt(self, key: str, reason: CorruptObject) -> None:
        self._stats.corrupt += 1
        if key not in self._warned_corrupt:
            if len(self._warned_corrupt) >= _MAX_WARNED_KEYS:
                self._warned_corrupt.clear()
            self._warned_corrupt.add(key)
            logger.warning("mooncake: corrupt object %s (%s); removing it", key, reason)
        rc = self._store.remove(self._stored_key(key), True)
        if rc not in (0, _OBJECT_NOT_FOUND):
            self._stats.errors += 1
            logger.error("mooncake: cannot remove corrupt object %s: rc=%d", key, rc)

    def _ensure_staging(self, nbytes: int) -> None:
        old = self._staging.array
        if not self._staging.ensure(nbytes):
            return
        if old.nbytes:
            self._retired_staging.append(old)
        rc = self._store.register_buffer(self._staging.array.ctypes.data, self._staging.array.nbytes)
        if rc != 0:
            # TCP transfers also work into unregistered memory (measured); RDMA would not.
            logger.warning("mooncake: registering a %d-byte staging buffer returned %d", nbytes, rc)

    # ---- exists / remove / clear -------------------------------------------------------

    def exists(self, keys: list[str]) -> list[bool]:
        self._check_open()
        validate_keys(keys)
        if not keys:
            return []
        if not self._available():
            self._stats.errors += 1
            return [False] * len(keys)
        codes = self._store.batch_is_exist([self._stored_key(key) for key in keys])
        self._note_failures("exists", codes, ok=(0, 1))
        return [code == 1 for code in codes]

    def remove(self, keys: list[str]) -> int:
        self._check_open()
        validate_keys(keys)
        if not keys:
            return 0
        if not self._available():
            self._stats.errors += 1
            return 0
        # Forced: an object read within its lease (10 s by default) cannot be removed otherwise.
        codes = self._store.batch_remove([self._stored_key(key) for key in keys], True)
        self._note_failures("remove", codes, ok=(0, _OBJECT_NOT_FOUND))
        return sum(code == 0 for code in codes)

    def clear(self) -> None:
        self._check_open()
        if not self._available():
            self._stats.errors += 1
            logger.error("mooncake: clear skipped: master %s unavailable", self.master_addr)
            return
        rc = self._store.remove_by_regex("^" + re.escape(self.namespace + "/"), True)
        if rc < 0:
            self._note_failures("clear", [rc], ok=())

    def _note_failures(self, operation: str, codes: list[int], ok: tuple[int, ...]) -> None:
        failed = [code for code in codes if code not in ok]
        if not failed:
            return
        self._stats.errors += 1
        logger.error("mooncake: %s failed for %d of %d keys (first rc=%d)", operation, len(failed), len(codes),
                     failed[0])
        if any(code in _RPC_ERROR_RANGE for code in failed):
            self._mark_degraded(f"{operation} returned rc={failed[0]}")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._drop_store()
        self._retired_staging.clear()
        self._staging = StagingBuffer()

    def stats(self) -> dict[str, int]:
        return self._stats.as_dict()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("mooncake storage backend used after close()")

    def _check_not_lookup_only(self, operation: str) -> None:
        if self.lookup_only:
            raise RuntimeError(f"mooncake: {operation} on a lookup-only client (it only answers exists)")


def _chunk_end(destinations: list[memoryview], start: int) -> int:
    """End of the chunk starting at ``start`` whose slots fit the staging budget (at least one)."""
    total = 0
    end = start
    while end < len(destinations):
        total += HEADER_SIZE + destinations[end].nbytes
        if end > start and total > _STAGING_CHUNK_BYTES:
            break
        end += 1
    return end
