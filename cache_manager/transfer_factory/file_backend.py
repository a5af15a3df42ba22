"""The ``file`` KV-cache storage backend: one checksummed file per key in a local directory.

This module owns the on-disk layout and its crash/corruption rules:

- ``<root>/<namespace>/<xx>/<key>.kv`` where ``xx`` is the low byte of crc32(key) in hex, so
  no directory grows past a few thousand entries;
- a put writes the header + payload to a temp file in the same directory and ``os.replace``s
  it over the final name, so a reader sees the old object or the new one, never a torn one.
  ``fsync`` is off by default: the tier is a cache of recomputable data, and a file torn by a
  power loss fails its checksum and becomes a miss. Turn it on for shared/network storage
  where another host must see the data after a crash;
- a get verifies header, length and crc32 in a staging buffer before copying into the
  caller's buffer; a corrupt object is counted, logged once per key, deleted, and missed.
  crc32 (zlib) costs ~0.45 ms for a 2.9 MB block here, small against the write;
- I/O errors (read-only or full directory, permission denied) are logged and reported as
  False/miss, never raised;
- an optional size cap (``max_bytes``, ``--file-backend-max-bytes``): before a write that would
  take the objects past it, the least recently used object files are deleted (recency is the
  file's mtime, which a successful read touches). The size is counted from a directory scan,
  repeated whenever this process's running estimate reaches the cap or it wrote a tenth of the
  cap since the last scan, so several processes sharing the directory stay close to it. A
  reader racing an eviction sees a missing file (a miss); a file deleted while open is still
  read whole (POSIX keeps its data until closed).

Thread safety: one thread per instance (see base.py). Several processes may share a
directory: writes are atomic renames and temp names carry the writer's pid.
"""
from __future__ import annotations

import errno
import itertools
import logging
import os
import shutil
import tempfile
import zlib
from pathlib import Path

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

from inter_communicator.process_utils import process_alive

logger = logging.getLogger(__name__)

_OBJECT_SUFFIX = ".kv"
_TEMP_SUFFIX = ".tmp"
_MAX_WARNED_KEYS = 10_000  # bounds the once-per-key warning memory
_EVICT_SLACK = 10  # an eviction frees 1/_EVICT_SLACK of the cap beyond what the write needs (fewer scans)


def default_storage_dir() -> Path:
    """Where the file backend stores objects when no directory is configured."""
    return Path(tempfile.gettempdir()) / "fdserve_kvcache"


class FileStorageBackend(KVStorageBackend):
    """KV blocks as files under ``root_dir/namespace``; see the module docstring."""

    name = "file"

    def __init__(self, root_dir: str | os.PathLike | None = None, namespace: str = "default",
                 fsync: bool = False, max_bytes: int = 0) -> None:
        validate_namespace(namespace)
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0 (0: unbounded), got {max_bytes}")
        self.root_dir = Path(root_dir) if root_dir else default_storage_dir()
        self.namespace = namespace
        self.directory = self.root_dir / namespace
        self.fsync = fsync
        self.max_bytes = max_bytes
        self._used_bytes: int | None = None  # estimate of the objects' bytes; None: scan before the next put
        self._written_since_scan = 0
        self.evicted = 0  # objects this instance deleted to stay under max_bytes
        self._stats = BackendStats()
        self._staging = StagingBuffer()
        self._temp_counter = itertools.count()
        self._warned_corrupt: set[str] = set()
        self._closed = False
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            # Not fatal: puts will fail and log, gets will miss; the directory may appear later.
            logger.error("file storage: cannot create %s: %s", self.directory, exc)
        self._sweep_dead_temp_files()

    # ---- paths -------------------------------------------------------------------------

    def _subdir(self, key: str) -> Path:
        return self.directory / f"{zlib.crc32(key.encode('ascii')) & 0xFF:02x}"

    def object_path(self, key: str) -> Path:
        """The file holding ``key``'s object (public so tests and tools can inspect it)."""
        return self._subdir(key) / (key + _OBJECT_SUFFIX)

    def _temp_path(self, key: str) -> Path:
        return self._subdir(key) / f".{key}.{os.getpid()}.{next(self._temp_counter)}{_TEMP_SUFFIX}"

    # ---- put ---------------------------------------------------------------------------

    def batch_put(self, keys: list[str], values: list[np.ndarray]) -> list[bool]:
        self._check_open()
        validate_keys(keys, values)
        payloads = [byte_view(value) for value in values]
        results: list[bool] = []
        first_error: OSError | None = None
        for key, payload in zip(keys, payloads):
            self._stats.puts += 1
            try:
                self._put_one(key, payload)
            except OSError as exc:
                self._stats.put_errors += 1
                first_error = first_error or exc
                results.append(False)
                continue
            self._stats.put_bytes += payload.nbytes
            results.append(True)
        if first_error is not None:
            # One line per batch: a full disk would otherwise log once per block.
            logger.error("file storage: %d of %d puts failed in %s: %s",
                         results.count(False), len(keys), self.directory, first_error)
        return results

    def _put_one(self, key: str, payload: memoryview) -> None:
        header = encode_header(key, payload)
        if self.max_bytes:
            self._make_room(len(header) + payload.nbytes)
        subdir = self._subdir(key)
        subdir.mkdir(parents=True, exist_ok=True)
        temp_path = self._temp_path(key)
        try:
            fd = os.open(temp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                _write_all(fd, memoryview(header))
                _write_all(fd, payload)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(temp_path, subdir / (key + _OBJECT_SUFFIX))
        except OSError:
            _unlink_quietly(temp_path)
            raise
        if self.fsync:
            _fsync_directory(subdir)
        if self.max_bytes and self._used_bytes is not None:
            self._used_bytes += len(header) + payload.nbytes
            self._written_since_scan += len(header) + payload.nbytes

    # ---- size cap ----------------------------------------------------------------------

    def disk_usage(self) -> int:
        """Bytes of the object files now in the namespace directory (a scan; temp files excluded)."""
        return sum(size for _, size, _ in self._scan_objects())

    def _scan_objects(self) -> list[tuple[int, int, str]]:
        """(mtime_ns, size, path) of every object file; files vanishing during the scan are skipped."""
        objects = []
        try:
            subdirs = [entry.path for entry in os.scandir(self.directory) if entry.is_dir()]
        except FileNotFoundError:
            return objects
        for subdir in subdirs:
            try:
                entries = list(os.scandir(subdir))
            except FileNotFoundError:
                continue  # removed by a concurrent clear
            for entry in entries:
                if not entry.name.endswith(_OBJECT_SUFFIX):
                    continue
                try:
                    info = entry.stat()
                except FileNotFoundError:
                    continue  # evicted by another process between listing and stat
                objects.append((info.st_mtime_ns, info.st_size, entry.path))
        return objects

    def _make_room(self, nbytes: int) -> None:
        """Delete least recently used objects so ``nbytes`` more fit under ``max_bytes``; OSError if never."""
        if nbytes > self.max_bytes:
            raise OSError(errno.EFBIG, f"a {nbytes}-byte object exceeds the {self.max_bytes}-byte cap "
                                       "(--file-backend-max-bytes)")
        if (self._used_bytes is not None and self._used_bytes + nbytes <= self.max_bytes
                and self._written_since_scan < self.max_bytes // _EVICT_SLACK):
            return
        objects = self._scan_objects()
        used = sum(size for _, size, _ in objects)
        self._written_since_scan = 0
        if used + nbytes > self.max_bytes:
            target = max(0, self.max_bytes - nbytes - self.max_bytes // _EVICT_SLACK)
            objects.sort()  # oldest mtime first
            evicted = 0
            for _, size, path in objects:
                if used <= target:
                    break
                try:
                    os.unlink(path)
                    evicted += 1
                except FileNotFoundError:
                    pass  # another process evicted it first: the space is free all the same
                used -= size
            self.evicted += evicted
            logger.debug("file storage: evicted %d objects to stay under %d bytes", evicted, self.max_bytes)
        self._used_bytes = used

    # ---- get ---------------------------------------------------------------------------

    def batch_get(self, keys: list[str], buffers: list[np.ndarray]) -> list[bool]:
        self._check_open()
        validate_keys(keys, buffers)
        destinations = [byte_view(buffer, writable=True) for buffer in buffers]
        results = []
        for key, destination in zip(keys, destinations):
            self._stats.gets += 1
            hit = self._get_one(key, destination)
            if hit:
                self._stats.hits += 1
                self._stats.get_bytes += destination.nbytes
            else:
                self._stats.misses += 1
            results.append(hit)
        return results

    def _get_one(self, key: str, destination: memoryview) -> bool:
        path = self.object_path(key)
        try:
            with open(path, "rb", buffering=0) as file:
                file_size = os.fstat(file.fileno()).st_size
                header = decode_header(key, _read_exact(file, HEADER_SIZE))
                if file_size != HEADER_SIZE + header.payload_len:
                    raise CorruptObject(f"file is {file_size} bytes, header says "
                                        f"{HEADER_SIZE} + {header.payload_len}")
                if header.payload_len != destination.nbytes:
                    logger.debug("file storage: %s holds %d bytes, buffer has %d: miss",
                                 key, header.payload_len, destination.nbytes)
                    return False
                self._staging.ensure(header.payload_len)
                staged = self._staging.view(0, header.payload_len)
                _readinto_exact(file, staged)
                verify_payload(header, staged)
        except FileNotFoundError:
            return False
        except CorruptObject as exc:
            self._handle_corrupt(key, path, exc)
            return False
        except OSError as exc:
            self._stats.errors += 1
            logger.error("file storage: reading %s failed: %s", path, exc)
            return False
        destination[:] = staged
        try:
            os.utime(path)  # recency for the LRU cap: a read keeps the object
        except OSError as exc:
            # Evicted or replaced since it was read: the data read is verified all the same.
            logger.debug("file storage: cannot touch %s after reading it: %s", path, exc)
        return True

    def _handle_corrupt(self, key: str, path: Path, reason: CorruptObject) -> None:
        self._stats.corrupt += 1
        if key not in self._warned_corrupt:
            if len(self._warned_corrupt) >= _MAX_WARNED_KEYS:
                self._warned_corrupt.clear()
            self._warned_corrupt.add(key)
            logger.warning("file storage: corrupt object %s (%s); deleting it", path, reason)
        try:
            path.unlink()
        except FileNotFoundError:
            pass  # a concurrent remove or clear got there first
        except OSError as exc:
            self._stats.errors += 1
            logger.error("file storage: cannot delete corrupt object %s: %s", path, exc)

    # ---- exists / remove / clear -------------------------------------------------------

    def exists(self, keys: list[str]) -> list[bool]:
        self._check_open()
        validate_keys(keys)
        return [self.object_path(key).is_file() for key in keys]

    def remove(self, keys: list[str]) -> int:
        self._check_open()
        validate_keys(keys)
        removed = 0
        for key in keys:
            try:
                self.object_path(key).unlink()
                removed += 1
            except FileNotFoundError:
                continue
            except OSError as exc:
                self._stats.errors += 1
                logger.error("file storage: cannot remove %s: %s", key, exc)
        return removed

    def clear(self) -> None:
        self._check_open()
        self._used_bytes = None
        if not self.directory.exists():
            return
        try:
            # Keep the namespace directory itself: it may be a mount point or configured
            # with permissions the operator chose.
            for entry in os.scandir(self.directory):
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path)
                else:
                    os.unlink(entry.path)
        except OSError as exc:
            self._stats.errors += 1
            logger.error("file storage: clearing %s failed: %s", self.directory, exc)

    def close(self) -> None:
        self._closed = True
        self._staging = StagingBuffer()

    def stats(self) -> dict[str, int]:
        return self._stats.as_dict()

    # ---- internals ---------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("file storage backend used after close()")

    def _sweep_dead_temp_files(self) -> None:
        """Remove temp files whose writer process is gone (it crashed between write and rename)."""
        if not self.directory.is_dir():
            return
        try:
            subdirs = [entry.path for entry in os.scandir(self.directory) if entry.is_dir()]
            for subdir in subdirs:
                for entry in os.scandir(subdir):
                    if entry.name.startswith(".") and entry.name.endswith(_TEMP_SUFFIX):
                        if not _writer_alive(entry.name):
                            _unlink_quietly(Path(entry.path))
        except OSError as exc:
            logger.warning("file storage: temp-file sweep of %s failed: %s", self.directory, exc)


def _write_all(fd: int, data: memoryview) -> None:
    # os.write may write less than asked (signals, >2 GiB requests); loop until done.
    offset = 0
    while offset < data.nbytes:
        written = os.write(fd, data[offset:])
        if written <= 0:
            raise OSError(errno.EIO, "write returned 0 bytes")
        offset += written


def _read_exact(file, size: int) -> bytes:
    data = file.read(size)
    if data is None or len(data) != size:
        raise CorruptObject(f"file truncated inside the header ({0 if data is None else len(data)} bytes)")
    return data


def _readinto_exact(file, destination: memoryview) -> None:
    # A regular-file read may return fewer bytes than asked (signals, huge requests).
    offset = 0
    while offset < destination.nbytes:
        count = file.readinto(destination[offset:])
        if not count:
            raise CorruptObject(f"payload truncated at {offset} of {destination.nbytes} bytes")
        offset += count


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink_quietly(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass  # never created, or already removed: nothing to clean
    except OSError as exc:
        logger.warning("file storage: cannot remove temp file %s: %s", path, exc)


def _writer_alive(temp_name: str) -> bool:
    """Whether the pid embedded in ``.<key>.<pid>.<n>.tmp`` is a live process."""
    parts = temp_name.split(".")
    try:
        pid = int(parts[-3])
    except (IndexError, ValueError):
        return False
    return process_alive(pid, None)
